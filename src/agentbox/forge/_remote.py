"""Which forge a git remote is on: GitHub or GitLab, its host, the repo's path, the API URL.

A remote URL names the host and the repo (``https://github.com/owner/repo.git``,
``git@github.com:owner/repo.git``, ``ssh://git@gitlab.example/group/sub/repo``).
github.com and gitlab.com are known; any other host is a forge only when the
host's settings name it (``forge_hosts``: ``HOST=github|gitlab[:API-URL]``,
for GitHub Enterprise and self-hosted GitLab). A URL with no host (a path, a
``file://`` URL) is on no forge.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from agentbox.errors import ForgeError

Kind = Literal["github", "gitlab"]

_KNOWN: dict[str, tuple[Kind, str]] = {
    "github.com": ("github", "https://api.github.com"),
    "gitlab.com": ("gitlab", "https://gitlab.com"),
}
#: scp-like syntax: ``[user@]host:path`` (no ``//`` after the colon, no slash before it).
_SCP = re.compile(r"(?:[^@/]+@)?(?P<host>[^:/]+):(?!//)(?P<path>.+)")
#: One path segment of a forge repo: what GitHub and GitLab accept in names.
_SEGMENT = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,99}")


@dataclass(frozen=True)
class ForgeRepo:
    """A repository on a forge, as a remote URL names it."""

    kind: Kind
    host: str
    path: str
    """``owner/repo`` on GitHub; ``group[/subgroup…]/project`` on GitLab."""
    api_url: str
    """GitHub: the REST API root (``https://api.github.com``); GitLab: the instance's
    URL (the client adds ``/api/v4``)."""

    @property
    def owner(self) -> str:
        """Everything before the last segment (the owner, or the GitLab namespace)."""
        return self.path.rpartition("/")[0]

    @property
    def name(self) -> str:
        """The last segment: the repository's name."""
        return self.path.rpartition("/")[2]


def _hosts(settings: Iterable[str]) -> dict[str, tuple[Kind, str]]:
    table = dict(_KNOWN)
    for entry in settings:
        host, sep, rest = entry.partition("=")
        kind, _, api = rest.partition(":")
        host = host.strip().lower()
        if not sep or not host or kind not in ("github", "gitlab"):
            raise ForgeError(f"forge_hosts entry {entry!r:.80} is not HOST=github|gitlab[:API-URL]")
        if not api:
            api = "https://api.github.com" if host == "github.com" else f"https://{host}"
            if kind == "github" and host != "github.com":
                api = f"https://{host}/api/v3"  # GitHub Enterprise Server's REST root
        if urlsplit(api).scheme not in ("http", "https"):
            raise ForgeError(f"forge_hosts entry {entry!r:.80}: the API URL is not http(s)")
        table[host] = ("github" if kind == "github" else "gitlab", api.rstrip("/"))
    return table


def _split(url: str) -> tuple[str, str]:
    """(host, path) of a remote URL; ("", "") when it names no host."""
    if "://" in url:
        parts = urlsplit(url)
        if parts.scheme not in ("https", "http", "ssh", "git", "git+ssh", "ssh+git"):
            return "", ""
        return (parts.hostname or "").lower(), parts.path
    m = _SCP.fullmatch(url)
    if m is None:
        return "", ""
    return m["host"].lower(), m["path"]


def parse_remote(url: str, forge_hosts: Iterable[str] = ()) -> ForgeRepo:
    """The forge repo a remote URL names; :class:`~agentbox.errors.ForgeError` when it is
    on no forge agentbox knows (the message says which setting adds one)."""
    host, path = _split(url.strip())
    if not host:
        raise ForgeError(f"the remote {url!r:.200} is not on a forge (no host in its URL)")
    table = _hosts(forge_hosts)
    if host not in table:
        raise ForgeError(
            f"{host} is not a forge agentbox knows: add it to the host's settings "
            f"(AGENTBOX_FORGE_HOSTS={host}=github or ={host}=gitlab)"
        )
    kind, api = table[host]
    path = path.strip("/")
    path = path.removesuffix(".git")
    segments = path.split("/")
    ok = all(_SEGMENT.fullmatch(s) and s not in (".", "..") for s in segments)
    if not ok or len(segments) < 2 or (kind == "github" and len(segments) != 2):
        want = "owner/repo" if kind == "github" else "group/project"
        raise ForgeError(f"the remote {url!r:.200} does not name a {kind} repo ({want})")
    return ForgeRepo(kind=kind, host=host, path="/".join(segments), api_url=api)
