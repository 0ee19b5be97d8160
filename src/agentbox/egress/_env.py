"""What a phase with egress needs inside the sandbox: proxy variables and the host's CA bundle.

Networks that intercept TLS re-sign it with a CA the host trusts and the image does
not; so a phase with egress trusts the CA bundle the host's own clients use (the
host's system bundle unless the ``egress_ca_bundle`` setting names another),
mounted read-only and named by every variable the usual clients read.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from agentbox.config import Settings
from agentbox.errors import ConfigError

#: Variables naming the CA bundle for Python (ssl, pip, requests), curl, git, Node and npm.
CA_ENV_VARS = (
    "SSL_CERT_FILE",
    "PIP_CERT",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "GIT_SSL_CAINFO",
    "NODE_EXTRA_CA_CERTS",
    "npm_config_cafile",
)
_SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
    "/etc/ssl/cert.pem",
)


def host_ca_bundle(settings: Settings) -> Path:
    """The CA bundle (a regular file, links resolved) that phases with egress trust.

    The ``egress_ca_bundle`` setting if given; else the bundle the host's OpenSSL
    uses by default (``SSL_CERT_FILE`` if the host sets it); else the usual system
    paths. :class:`ConfigError` if none is a readable file.
    """
    candidates: list[str] = []
    if settings.egress_ca_bundle is not None:
        candidates.append(str(settings.egress_ca_bundle))
    else:
        paths = ssl.get_default_verify_paths()
        candidates += [p for p in (paths.cafile, paths.openssl_cafile) if p]
        candidates += _SYSTEM_BUNDLES
    for cand in candidates:
        path = Path(cand).resolve()
        if path.is_file():
            return path
        if settings.egress_ca_bundle is not None:
            raise ConfigError(f"egress_ca_bundle {cand} is not a file")
    raise ConfigError("no CA bundle found on this host; set AGENTBOX_EGRESS_CA_BUNDLE")


def proxy_env(port: int, ca_path: Path | str) -> dict[str, str]:
    """Environment for a command inside the sandbox that reaches out through the proxy.

    ``port``: where the in-sandbox relay listens on 127.0.0.1; ``ca_path``: where the
    host's CA bundle is mounted inside. ``NO_PROXY`` keeps 127.0.0.1 (the gateway)
    off the proxy.
    """
    if not 0 < port < 65536:
        raise ConfigError(f"proxy port {port} out of range")
    proxy = f"http://127.0.0.1:{port}"
    env = {
        "HTTP_PROXY": proxy,
        "HTTPS_PROXY": proxy,
        "http_proxy": proxy,
        "https_proxy": proxy,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "PIP_PROXY": proxy,
        "npm_config_proxy": proxy,
        "npm_config_https_proxy": proxy,
    }
    env.update(dict.fromkeys(CA_ENV_VARS, str(ca_path)))
    return env
