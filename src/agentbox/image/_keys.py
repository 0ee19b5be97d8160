"""What an image is made of, and the content hashes that name it.

Two layers, so a change to our guest programs does not redo mmdebstrap:

* the **base key** covers the Debian root: suite, package list, the host's apt
  sources (their content, not their names), dpkg path filters, architecture and
  the builder version;
* the **final key** covers the base key, Claude Code (version and the digest of
  the binary), every guest program's content, the sandbox uid and the hardening
  version.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentbox.errors import ImageError

#: Bump when the way the base root is built changes (options, hooks).
BUILDER_VERSION = "1"
#: Bump when hardening, the added files or the podman config change.
HARDENING_VERSION = "4"
SUITE = "bookworm"

#: On top of ``--variant=minbase`` (which brings coreutils, bash, grep, sed, findutils,
#: diffutils, gzip, tar, mawk, …). What an agent needs: Claude Code's Bash tool, git,
#: ripgrep for its search tool, python3; less/file/patch/procps for everyday shell work;
#: tini as pid 1; ca-certificates so TLS to a gateway could be verified.
PACKAGES: tuple[str, ...] = (
    "bash",
    "ca-certificates",
    "coreutils",
    "diffutils",
    "file",
    "findutils",
    "git",
    "grep",
    "less",
    "patch",
    "procps",
    "python3",
    # venv + ensurepip + pip's bundled wheel: `python3 -m venv .venv` in a [setup] works
    # on the default image, with no Containerfile.
    "python3-venv",
    "ripgrep",
    "sed",
    "tini",
)

#: Leave out documentation and translations: smaller root, faster import and disk image.
DPKG_OPTIONS: tuple[str, ...] = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
)

_APT_DIR = Path("/etc/apt")


def _hash(obj: object) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class AptSources:
    """The host's apt sources for one suite: one-line entries and deb822 stanzas."""

    one_line: str
    deb822: str
    origin: tuple[Path, ...]

    @property
    def content(self) -> str:
        """Both parts, as hashed into the base key."""
        return self.one_line + "\n--\n" + self.deb822


def _suite_matches(name: str, suite: str) -> bool:
    return name == suite or name.startswith((f"{suite}-", f"{suite}/"))


def _one_line_entries(text: str, suite: str) -> list[str]:
    keep = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        words = line.split()
        # deb [options] URI SUITE COMPONENTS…: the options bracket may span words.
        i = 1
        if words[1].startswith("["):
            while i < len(words) and not words[i].endswith("]"):
                i += 1
            i += 1
        if len(words) > i + 1 and _suite_matches(words[i + 1], suite):
            keep.append(line)
    return keep


def _deb822_stanzas(text: str, suite: str) -> list[str]:
    out = []
    for block in text.split("\n\n"):
        fields: list[tuple[str, str]] = []
        for raw in block.splitlines():
            if raw.startswith("#") or not raw.strip():
                continue
            if raw[0] in " \t" and fields:  # continuation (e.g. an inline Signed-By key)
                fields[-1] = (fields[-1][0], fields[-1][1] + "\n" + raw)
                continue
            key, _, value = raw.partition(":")
            fields.append((key.strip(), value.strip()))
        got = {k.lower(): v for k, v in fields}
        if "deb" not in got.get("types", "").split() or got.get("enabled", "yes") == "no":
            continue
        suites = [s for s in got.get("suites", "").split() if _suite_matches(s, suite)]
        if not suites:
            continue
        lines = []
        for key, value in fields:
            if key.lower() == "types":
                value = "deb"
            elif key.lower() == "suites":
                value = " ".join(suites)
            lines.append(f"{key}: {value}")
        out.append("\n".join(lines))
    return out


def host_apt_sources(suite: str = SUITE, apt_dir: Path = _APT_DIR) -> AptSources:
    """The host's own apt sources for ``suite`` (and its -updates/-security).

    The image is built from the mirrors the host already uses, so no mirror
    hostname is ever written in agentbox. Entries for other suites (third-party
    repositories) are left out.
    """
    files = [apt_dir / "sources.list"]
    d = apt_dir / "sources.list.d"
    if d.is_dir():
        files += sorted(p for p in d.iterdir() if p.suffix in (".list", ".sources"))
    one_line: list[str] = []
    deb822: list[str] = []
    origin: list[Path] = []
    for f in files:
        try:
            text = f.read_text()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ImageError(f"cannot read apt sources {f}: {exc}") from exc
        got = _deb822_stanzas(text, suite) if f.suffix == ".sources" else []
        lines = _one_line_entries(text, suite) if f.suffix == ".list" else []
        if got or lines:
            origin.append(f)
        deb822 += got
        one_line += lines
    if not one_line and not deb822:
        raise ImageError(
            f"no apt source for Debian {suite} in {apt_dir}/sources.list(.d): the default "
            f"image is built from the host's own Debian sources; add a {suite} entry"
        )
    return AptSources(
        "\n".join(one_line) + ("\n" if one_line else ""),
        "\n\n".join(deb822) + ("\n" if deb822 else ""),
        tuple(origin),
    )


def base_key(
    sources: AptSources,
    *,
    suite: str = SUITE,
    packages: Sequence[str] = PACKAGES,
    dpkg_options: Sequence[str] = DPKG_OPTIONS,
) -> str:
    """The content key of the Debian base root."""
    return _hash(
        {
            "builder": BUILDER_VERSION,
            "suite": suite,
            "packages": sorted(set(packages)),
            "sources": sources.content,
            "dpkg": list(dpkg_options),
            "arch": platform.machine(),
        }
    )


def final_key(
    base: str,
    *,
    claude_version: str,
    claude_digest: str,
    guest: Mapping[str, str],
    sandbox_uid: int,
) -> str:
    """The content key of the finished image (names its cache dir and podman tag)."""
    return _hash(
        {
            "base": base,
            "claude": [claude_version, claude_digest],
            "guest": dict(sorted(guest.items())),
            "uid": sandbox_uid,
            "hardening": HARDENING_VERSION,
        }
    )


def file_digest(path: Path, cache: Path | None = None) -> str:
    """sha256 of a file; with ``cache``, remembered by (size, mtime, inode).

    Claude Code's binary is ~370 MB: hashing it on every build would cost
    the cached path its "seconds".
    """
    try:
        st = path.stat()
    except OSError as exc:
        raise ImageError(f"cannot read {path}: {exc}") from exc
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    memo: dict[str, object] = {}
    if cache is not None:
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads(cache.read_text())
            if isinstance(loaded, dict):
                memo = loaded
        hit = memo.get(str(path))
        if (
            isinstance(hit, dict)
            and hit.get("stamp") == stamp
            and isinstance(hit.get("sha256"), str)
        ):
            return str(hit["sha256"])
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    if cache is not None:
        memo[str(path)] = {"stamp": stamp, "sha256": digest}
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(memo))
            tmp.replace(cache)
    return digest


def guest_dir() -> Path:
    """Where our in-sandbox programs live (``src/agentbox/guest``)."""
    import agentbox.guest

    return Path(agentbox.guest.__file__).parent


def guest_files(directory: Path | None = None) -> dict[str, str]:
    """Every ``*.py`` and ``*.c`` in the guest dir, name → sha256 of its content."""
    d = directory or guest_dir()
    out: dict[str, str] = {}
    for p in sorted([*d.glob("*.py"), *d.glob("*.c")]):
        if p.is_file() and not p.is_symlink():
            out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
