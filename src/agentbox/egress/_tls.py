"""TLS for the hosts the proxy decides per request: a per-task CA and the upstream check.

:class:`TaskCA` is made inside the proxy process when it starts (an EC P-256 key
that exists only in that process's memory) and signs, on first use, one leaf
certificate per host name the sandbox connects to. Its certificate carries X.509
name constraints: it can vouch only for the host names the task's rules name, so
even a stolen copy of the sandbox's trust store vouches for nothing else. Only its
certificate leaves the process (written once for the launcher, who adds it to the
sandbox's CA bundle).

The standard library loads a certificate and key only from a file; a leaf's PEM is
written to an anonymous memory file (``memfd_create``) and loaded from its
``/proc/self/fd`` path, then closed: no name on any file system.

:func:`upstream_context` is the client side: the host's system bundle plus the CA
files of the ``egress_upstream_ca`` setting (read before the proxy drops its
privileges), certificate and host name verified, ALPN offering only ``http/1.1``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import ssl
from collections import OrderedDict
from collections.abc import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: The only application protocol offered either way: HTTP/2 is never intercepted.
ALPN = ["http/1.1"]
_LEAF_CACHE = 256
_LEAF_DAYS = 7


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class TaskCA:
    """One task's CA: its key in memory only, leaves signed per host name on demand."""

    def __init__(self, names: Iterable[str], *, label: str = "agentbox task CA") -> None:
        """``names``: the rule host patterns (``host`` or ``*.suffix``) it may vouch for."""
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, label)])
        permitted = sorted({n.removeprefix("*.") for n in names})
        now = _now()
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=_LEAF_DAYS + 1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
        )
        if permitted:
            builder = builder.add_extension(
                x509.NameConstraints(
                    permitted_subtrees=[x509.DNSName(n) for n in permitted],
                    excluded_subtrees=None,
                ),
                critical=True,
            )
        self._cert = builder.sign(self._key, hashes.SHA256())
        self.cert_pem = self._cert.public_bytes(serialization.Encoding.PEM)
        self._leaf_key_pem = self._leaf_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        self._contexts: OrderedDict[str, ssl.SSLContext] = OrderedDict()

    def leaf_pem(self, host: str) -> bytes:
        """A certificate for ``host`` signed by this CA (PEM, chain included)."""
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self._cert.subject)
            .public_key(self._leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=_LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM) + self.cert_pem

    def context_for(self, host: str) -> ssl.SSLContext:
        """The server context presenting ``host``'s leaf (cached; HTTP/1.1 only)."""
        ctx = self._contexts.get(host)
        if ctx is not None:
            self._contexts.move_to_end(host)
            return ctx
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(ALPN)

        def same_name(_sock: object, name: str | None, _ctx: ssl.SSLContext) -> int | None:
            # The SNI must name the CONNECT's host (none at all: the leaf names it anyway).
            if name is None or name.lower().rstrip(".") == host:
                return None
            return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME

        ctx.sni_callback = same_name
        fd = os.memfd_create("agentbox-leaf", os.MFD_CLOEXEC)
        try:
            os.write(fd, self.leaf_pem(host) + self._leaf_key_pem)
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        self._contexts[host] = ctx
        if len(self._contexts) > _LEAF_CACHE:
            self._contexts.popitem(last=False)
        return ctx


def upstream_context(ca_files: Iterable[str] = ()) -> ssl.SSLContext:
    """Verify upstreams against the system bundle plus ``ca_files`` (read now)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    for path in ca_files:
        ctx.load_verify_locations(cafile=path)
    ctx.set_alpn_protocols(ALPN)
    with contextlib.suppress(AttributeError):  # OpenSSL 3: no renegotiation
        ctx.options |= ssl.OP_NO_RENEGOTIATION
    return ctx
