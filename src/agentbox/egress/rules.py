"""Request-level egress rules: which requests to a host pass, and what header is added.

A :class:`NetworkRule` names a host (exact or ``*.suffix``), the methods and path
globs it allows, the phases it applies in, and optionally an :class:`Inject`: a
header the proxy adds on the way out (its value a template that may name secrets,
``${secret:NAME}``). A rule with ``refuse_message`` is a deny rule: a request it
matches is refused with that message. Rules come from a Boxfile's
``[[network.rule]]`` tables (``origin="boxfile"``) and from the host's own client
configuration (``host-pip``, ``host-npm``, ``host-netrc``, ``host-keyring``, ``git-fetch``).

For a host some rule names, the proxy terminates TLS and decides per request with
:func:`match_rule` (the first rule that matches wins); nothing here does I/O.

Public API::

    rule = NetworkRule(host="pypi.corp.example", paths=("/simple/*",),
                       inject=Inject("Authorization", "Bearer ${secret:TOKEN}"))
    match_rule(rules, host="pypi.corp.example", method="GET", path="/simple/x/", phase="setup")
    rule_hosts(rules)                 # the host patterns that need TLS termination
    suggest_rule("h", "POST", "/a/b") # a [[network.rule]] line a user can paste
    rule.to_dict() / NetworkRule.from_dict(d)   # JSON-able, for the proxy's stdin
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from agentbox.core.hostname import normalize_host
from agentbox.egress._addr import host_matches, normalize_pattern

__all__ = [
    "ORIGINS",
    "PHASES",
    "PLACEHOLDER",
    "Inject",
    "NetworkRule",
    "canonical_path",
    "expand",
    "host_has_rules",
    "match_rule",
    "path_matches",
    "rule_hosts",
    "secret_names",
    "suggest_rule",
]

#: What the sandbox may send where a tool insists on a token; the proxy replaces it.
PLACEHOLDER = "agentbox-brokered"
PHASES = frozenset({"setup", "agent"})
ORIGINS = frozenset(
    {"boxfile", "host-pip", "host-npm", "host-netrc", "host-keyring", "git-fetch", "test"}
)

_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_SECRET_REF = re.compile(r"\$\{secret:([^}]*)\}")
_SECRET_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,63}")
#: Headers an injection may never set: framing, routing and hop-by-hop ones.
_FORBIDDEN_INJECT = frozenset(
    [
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "upgrade",
        "te",
        "trailer",
        "expect",
        "proxy-authorization",
        "proxy-authenticate",
    ]
)


def _find_refs(template: str) -> list[str]:
    """Secret names a template references (``${secret:NAME}``); ValueError on a bad one."""
    try:
        from agentbox.secrets import find_refs
    except ImportError:  # the secrets package is not there: the same grammar, here
        names = _SECRET_REF.findall(template)
        for name in names:
            if not _SECRET_NAME.fullmatch(name):
                raise ValueError(f"bad secret name {name!r:.80} in ${{secret:...}}") from None
        if _SECRET_REF.sub("", template).find("${secret:") >= 0:
            raise ValueError("an unclosed ${secret: (write ${secret:NAME})") from None
        return list(dict.fromkeys(names))
    try:
        return list(find_refs(template))
    except ValueError:
        raise
    except Exception as exc:  # agentbox.errors.InvalidValue: a pydantic-friendly error
        raise ValueError(str(exc)) from None


def expand(template: str, values: Mapping[str, str]) -> str:
    """``template`` with each ``${secret:NAME}`` replaced by ``values[NAME]`` (one pass).

    KeyError naming a missing secret (never a value).
    """
    _find_refs(template)

    def one(m: re.Match[str]) -> str:
        return values[m.group(1)]

    return _SECRET_REF.sub(one, template)


@dataclass(frozen=True)
class Inject:
    """A header the proxy adds to a matching request (the sandbox's own value is dropped)."""

    header: str
    value: str
    """A template: ``${secret:NAME}`` is replaced by the secret's value in the proxy only."""

    def __post_init__(self) -> None:
        if not _TOKEN.match(self.header):
            raise ValueError(f"inject header {self.header!r:.80} is not a header name")
        if self.header.lower() in _FORBIDDEN_INJECT:
            raise ValueError(f"inject header {self.header!r} cannot be set by a rule")
        if any(c in self.value for c in "\r\n\0"):
            raise ValueError("inject value has a line break or NUL")
        _find_refs(self.value)

    @property
    def secrets(self) -> tuple[str, ...]:
        """The secret names the value references, in order."""
        return tuple(_find_refs(self.value))


@dataclass(frozen=True)
class NetworkRule:
    """Which requests to ``host`` pass (and what is injected into them), in which phases.

    Rules with ``refuse_message`` are deny rules: a request they match is refused
    with that message (``git-receive-pack``: "results are published from the host").
    """

    host: str
    """Exact name or ``*.suffix`` (strict subdomains)."""
    methods: tuple[str, ...] = ("GET", "HEAD")
    paths: tuple[str, ...] = ("/*",)
    """Globs on the path without its query; ``*`` matches any run of characters, ``/`` too."""
    inject: Inject | None = None
    phases: frozenset[str] = frozenset({"setup", "agent"})
    refuse_message: str | None = None
    origin: str = "boxfile"
    query: str | None = None
    """If set, the request's query must equal this exactly (``service=git-upload-pack``)."""
    line: int | None = field(default=None, compare=False)
    """Where the rule was written (a Boxfile's ``[[network.rule]]`` number), for messages."""

    def __post_init__(self) -> None:
        pattern = normalize_pattern(self.host)
        if pattern == "*":
            raise ValueError("a rule's host must name hosts ('*' names everything)")
        object.__setattr__(self, "host", pattern)
        methods = tuple(m.upper() for m in self.methods)
        if not methods or not all(_TOKEN.match(m) for m in methods):
            raise ValueError(f"rule for {pattern}: methods must be HTTP method names")
        if "CONNECT" in methods:
            raise ValueError(f"rule for {pattern}: CONNECT is not a request a rule can allow")
        object.__setattr__(self, "methods", methods)
        paths = tuple(self.paths)
        if not paths or not all(p.startswith("/") for p in paths):
            raise ValueError(f"rule for {pattern}: every path must start with '/'")
        if any(c in p for p in paths for c in "?# \t\r\n"):
            raise ValueError(f"rule for {pattern}: a path glob has no query, fragment or space")
        object.__setattr__(self, "paths", paths)
        phases = frozenset(self.phases)
        if not phases or not phases <= PHASES:
            raise ValueError(f"rule for {pattern}: phases are 'setup' and/or 'agent'")
        object.__setattr__(self, "phases", phases)
        if self.origin not in ORIGINS:
            raise ValueError(f"rule origin {self.origin!r} unknown")
        if self.refuse_message is not None and self.inject is not None:
            raise ValueError(f"rule for {pattern}: a deny rule injects nothing")

    @property
    def deny(self) -> bool:
        """A deny rule (it has a ``refuse_message``)."""
        return self.refuse_message is not None

    @property
    def name(self) -> str:
        """How the log names this rule: ``boxfile#2:pypi.corp.example GET,HEAD /simple/*``."""
        where = f"{self.origin}#{self.line}" if self.line is not None else self.origin
        return f"{where}:{self.host} {','.join(self.methods)} {' '.join(self.paths)}"

    def matches(self, host: str, method: str, path: str, phase: str, query: str = "") -> bool:
        """Whether this rule names the request (``host`` normalized, ``path`` without query)."""
        if phase not in self.phases or not host_matches(self.host, host):
            return False
        if method.upper() not in self.methods:
            return False
        if self.query is not None and query != self.query:
            return False
        return any(path_matches(g, path) for g in self.paths)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (the proxy's stdin); secret values are never part of a rule."""
        return {
            "host": self.host,
            "methods": list(self.methods),
            "paths": list(self.paths),
            "inject": None
            if self.inject is None
            else {"header": self.inject.header, "value": self.inject.value},
            "phases": sorted(self.phases),
            "refuse_message": self.refuse_message,
            "origin": self.origin,
            "query": self.query,
            "line": self.line,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NetworkRule:
        """The inverse of :meth:`to_dict`."""
        inj = d.get("inject")
        return cls(
            host=str(d["host"]),
            methods=tuple(d.get("methods", ("GET", "HEAD"))),
            paths=tuple(d.get("paths", ("/*",))),
            inject=None if inj is None else Inject(str(inj["header"]), str(inj["value"])),
            phases=frozenset(d.get("phases", PHASES)),
            refuse_message=d.get("refuse_message"),
            origin=str(d.get("origin", "boxfile")),
            query=d.get("query"),
            line=d.get("line"),
        )


@lru_cache(maxsize=512)
def _glob(pattern: str) -> re.Pattern[str]:
    return re.compile("".join(".*" if c == "*" else re.escape(c) for c in pattern) + r"\Z", re.S)


def path_matches(glob: str, path: str) -> bool:
    """Whether ``path`` (no query) fits ``glob``; ``*`` matches anything, ``/`` included."""
    return _glob(glob).match(path) is not None


_DOT_SEGMENT = re.compile(r"(^|/)\.{1,2}(/|$)")


def canonical_path(path: str) -> bool:
    """Whether a request path is plain enough to match globs on.

    No dot segments, no empty segments, no backslash, no percent-encoded ``\\``,
    ``.`` or ``%`` (which a server would decode into a different path than the one
    matched here), no control characters. A percent-encoded ``/`` is allowed (npm asks
    for a scoped package as ``/@scope%2fname``) when the path with it decoded passes
    the same checks: a glob's ``*`` matches ``/`` too, so a server that decodes it
    sees a path the glob matched as well.
    """
    if not path.startswith("/") or "\\" in path:
        return False
    if any(ord(c) < 0x21 or ord(c) > 0x7E for c in path):
        return False
    low = path.lower()
    if any(enc in low for enc in ("%5c", "%2e", "%25", "%00")):
        return False
    decoded = low.replace("%2f", "/")
    return "//" not in decoded and _DOT_SEGMENT.search(decoded) is None


def match_rule(
    rules: Sequence[NetworkRule],
    *,
    host: str,
    method: str,
    path: str,
    phase: str,
    query: str = "",
) -> NetworkRule | None:
    """The first rule that names the request, or None (refused: no rule allows it)."""
    for rule in rules:
        if rule.matches(host, method, path, phase, query):
            return rule
    return None


def rule_hosts(rules: Iterable[NetworkRule]) -> tuple[str, ...]:
    """The host patterns rules name, in order, without repeats (TLS is terminated for them)."""
    return tuple(dict.fromkeys(r.host for r in rules))


def host_has_rules(rules: Iterable[NetworkRule], host: str) -> bool:
    """Whether some rule names ``host`` (normalized): its requests are decided per request."""
    return any(host_matches(r.host, host) for r in rules)


def secret_names(rules: Iterable[NetworkRule]) -> tuple[str, ...]:
    """Every secret name the rules' injections reference, in order, without repeats."""
    out: dict[str, None] = {}
    for r in rules:
        if r.inject is not None:
            out.update(dict.fromkeys(r.inject.secrets))
    return tuple(out)


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def suggest_rule(host: str, method: str, path: str) -> str:
    """A ``[[network.rule]]`` table (TOML lines) a user can paste into the Boxfile to allow this.

    The path is generalized to its first segment (``/a/b/c`` → ``/a/*``).
    """
    try:
        host = normalize_host(host)
    except ValueError:
        host = "HOST"
    seg = path.split("?", 1)[0].lstrip("/").split("/", 1)[0]
    glob = f"/{seg}/*" if seg and "/" in path.lstrip("/") else (f"/{seg}" if seg else "/")
    if not re.fullmatch(r"[A-Za-z0-9._~!$&'()+,;=:@%-]*", seg):
        glob = "/*"
    meth = method.upper() if _TOKEN.match(method) else "GET"
    return (
        f"[[network.rule]]\nhost = {_toml_str(host)}\nmethods = [{_toml_str(meth)}]\n"
        f"paths = [{_toml_str(glob)}]"
    )
