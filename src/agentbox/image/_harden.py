"""Turn a Debian root into the sandbox image, then verify the result by reading it.

Three steps, each answering part of the threat model (docs/explanation/image-hardening.md):

* :func:`install` adds Claude Code, our guest programs, the ``agent`` user and
  the mount points;
* :func:`harden` removes the package manager and its data, su/sudo and the
  tools that change passwords or identities, and strips every setuid/setgid
  bit and file capability;
* :func:`verify` walks the finished root, trusting none of the steps above,
  and raises :class:`~agentbox.errors.ImageError` naming every offending path.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

from agentbox.errors import ImageError
from agentbox.image._relay import RELAY_BINARY, RELAY_SOURCE, compile_relay
from agentbox.image._rootfs import resolve_in, resolve_parent_in, walk

CLAUDE_PATH = "/usr/local/bin/claude"
GUEST_DIR = "/opt/agentbox"
AGENT_NAME = "agent"
AGENT_HOME = "/home/agent"
#: The PATH inside the sandbox; every one of these dirs is checked.
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Empty mount points the backends bind or tmpfs over.
MOUNT_POINTS = ("/workspace", "/run/agentbox/gw", AGENT_HOME)
#: Mode of the image's $HOME (see :func:`install`: a tmpfs over it inherits it).
HOME_MODE = 0o1777

#: Package managers and identity changers: none may be on any PATH dir of the image.
FORBIDDEN_ON_PATH = frozenset(
    {
        # package managers (Debian's and, for named foreign images, others')
        "apt", "apt-get", "apt-cache", "apt-cdrom", "apt-config", "apt-key", "apt-mark",
        "aptitude", "dpkg", "apk", "rpm", "yum", "dnf", "microdnf", "zypper", "pacman",
        # becoming someone else
        "su", "sudo", "sudoedit", "doas", "pkexec", "login", "newgrp", "sg",
        "newuidmap", "newgidmap",
        # changing passwords, shells, groups, accounts
        "passwd", "chsh", "chfn", "gpasswd", "chage", "expiry", "chpasswd", "chgpasswd",
        "newusers", "useradd", "usermod", "userdel", "groupadd", "groupmod", "groupdel",
        "vipw", "vigr",
    }
)  # fmt: skip

#: Debian packages whose every file goes (read from dpkg's own file lists).
REMOVED_PACKAGES = ("apt", "dpkg", "libapt-pkg6.0")
#: Package-manager state and configuration, removed after the packages' files.
REMOVED_DATA = (
    "/var/lib/dpkg",
    "/var/lib/apt",
    "/var/cache/apt",
    "/var/log/apt",
    "/var/log/dpkg.log",
    "/var/log/alternatives.log",
    "/etc/apt",
    "/etc/dpkg",
    "/usr/lib/apt",
    "/usr/lib/dpkg",
    "/usr/libexec/dpkg",
    "/usr/share/dpkg",
    "/usr/share/doc/apt",
    "/usr/share/doc/dpkg",
    "/usr/share/doc/libapt-pkg6.0",
    "/usr/share/bash-completion/completions/apt",
)
#: What the sandbox's entrypoint, the agent and our guest programs run: all must resolve.
ESSENTIAL = (
    "/usr/bin/tini",
    "/bin/sh",
    "/bin/bash",
    "/usr/bin/env",
    "/usr/bin/git",
    "/usr/bin/python3",
    "/usr/bin/rg",
)
_MUST_BE_GONE = ("/var/lib/dpkg", "/var/lib/apt", "/etc/apt")
_CAP_XATTR = "security.capability"


def forbidden_name(name: str) -> bool:
    """True for a package manager or identity-changing tool's name."""
    return name in FORBIDDEN_ON_PATH or name.startswith(("apt-", "dpkg-"))


def _path_dirs(root: Path) -> list[Path]:
    seen: list[Path] = []
    for d in IMAGE_PATH.split(":"):
        real = resolve_in(root, d)
        if real.is_dir() and not real.is_symlink() and real not in seen:
            seen.append(real)
    return seen


def _unlink(path: Path, removed: list[str], root: Path) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        path.unlink()
    removed.append("/" + str(path.relative_to(root)))


def _package_lists(root: Path, package: str) -> list[Path]:
    info = root / "var/lib/dpkg/info"
    return [p for p in (info / f"{package}.list", *info.glob(f"{package}:*.list")) if p.is_file()]


def _remove_package(root: Path, package: str, removed: list[str]) -> None:
    """Remove every file and link a package's dpkg list names; its directories stay.

    Directories are shared between packages (``/usr/lib``) and a listed
    "directory" may be a link to one (merged /usr: ``/lib`` → ``usr/lib``), so
    anything that resolves to a directory is left alone; the package's own
    directories are in :data:`REMOVED_DATA`.
    """
    for lst in _package_lists(root, package):
        for line in lst.read_text(errors="replace").splitlines():
            if not line.startswith("/") or line == "/.":
                continue
            if resolve_in(root, line).is_dir():
                continue
            p = resolve_parent_in(root, line)
            if p.is_symlink() or p.exists():
                _unlink(p, removed, root)


def packaged_paths(root: Path) -> set[Path]:
    """Every path dpkg's file lists attribute to an installed package, resolved in ``root``."""
    out: set[Path] = set()
    info = root / "var/lib/dpkg/info"
    if not info.is_dir() or info.is_symlink():
        return out
    for lst in sorted(info.glob("*.list")):
        for line in lst.read_text(errors="replace").splitlines():
            if line.startswith("/") and line != "/.":
                out.add(resolve_parent_in(root, line))
    return out


def harden(root: Path, *, strip: Literal["all", "packaged"] = "all") -> dict[str, list[str]]:
    """Remove the package manager, su/sudo and identity tools; strip setuid/setgid/caps.

    ``strip="all"`` (the default image: every file came from Debian's packages)
    strips every setuid/setgid bit and file capability. ``strip="packaged"``
    (an image from a user's Containerfile) strips them from directories (a
    setgid directory such as ``/var/mail`` only passes on its group) and from
    files a Debian package installed, as read from dpkg's lists before they
    go; any other file (a binary the Containerfile made setuid, or gave a
    capability) is left for :func:`verify` to refuse by name. Returns what was
    done (``removed`` and ``stripped`` paths, image-relative), for the
    manifest. :func:`verify` checks the result independently.
    """
    packaged = packaged_paths(root) if strip == "packaged" else None
    removed: list[str] = []
    for pkg in REMOVED_PACKAGES:
        _remove_package(root, pkg, removed)
    for d in _path_dirs(root):
        for entry in sorted(d.iterdir()):
            if forbidden_name(entry.name):
                _unlink(entry, removed, root)
    for rel in REMOVED_DATA:
        _unlink(resolve_parent_in(root, rel), removed, root)

    stripped: list[str] = []
    for p, st in walk(root):
        if stat.S_ISLNK(st.st_mode):
            continue
        if packaged is not None and not stat.S_ISDIR(st.st_mode) and p not in packaged:
            continue  # left for verify() to refuse by name
        changed = False
        if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            # The path's components are real directories (walk never follows links),
            # so chmod cannot land outside the root.
            p.chmod(stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
            changed = True
        if stat.S_ISREG(st.st_mode) and _CAP_XATTR in _xattrs(p):
            os.removexattr(p, _CAP_XATTR, follow_symlinks=False)
            changed = True
        if changed:
            stripped.append("/" + str(p.relative_to(root)))
    return {"removed": removed, "stripped": stripped}


def _xattrs(p: Path) -> list[str]:
    try:
        return os.listxattr(p, follow_symlinks=False)
    except OSError:
        return []


def _is_elf(p: Path) -> bool:
    """True if ``p`` (a regular file, not followed if a link) is an ELF program."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.read(fd, 4) == b"\x7fELF"
    except OSError:
        return False
    finally:
        os.close(fd)


def _replace_entries(path: Path, name: str, ident: int, line: str) -> None:
    """Write ``line`` into a passwd-style file, dropping entries with its name or id."""
    old = path.read_text().splitlines() if path.exists() else []
    keep = []
    for entry in old:
        fields = entry.split(":")
        if fields[0] == name or (len(fields) > 2 and fields[2] == str(ident)):
            continue
        keep.append(entry)
    path.write_text("\n".join([*keep, line]) + "\n")


def install(
    root: Path,
    *,
    claude_binary: Path,
    guest_source: Path,
    guest_names: Iterable[str],
    sandbox_uid: int,
) -> None:
    """Add Claude Code, the guest programs, the ``agent`` user and the mount points."""
    claude = resolve_parent_in(root, CLAUDE_PATH)
    claude.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copyfile(claude_binary, claude, follow_symlinks=True)
    except OSError as exc:
        raise ImageError(f"cannot copy Claude Code from {claude_binary}: {exc}") from exc
    os.chown(claude, 0, 0)
    claude.chmod(0o755)

    gdir = resolve_parent_in(root, GUEST_DIR)
    gdir.mkdir(mode=0o755, parents=True, exist_ok=True)
    gdir.chmod(0o755)
    for name in guest_names:
        src = guest_source / name
        dst = gdir / name
        data = src.read_bytes()
        dst.write_bytes(data)
        os.chown(dst, 0, 0)
        dst.chmod(0o755 if data.startswith(b"#!") else 0o644)
    if RELAY_SOURCE in guest_names:
        compile_relay(guest_source / RELAY_SOURCE, gdir / RELAY_BINARY)

    uid = sandbox_uid
    etc = resolve_in(root, "/etc")
    _replace_entries(
        etc / "passwd",
        AGENT_NAME,
        uid,
        f"{AGENT_NAME}:x:{uid}:{uid}:agentbox agent:{AGENT_HOME}:/bin/bash",
    )
    _replace_entries(etc / "group", AGENT_NAME, uid, f"{AGENT_NAME}:x:{uid}:")
    if (etc / "shadow").exists():
        _replace_entries(etc / "shadow", AGENT_NAME, -1, f"{AGENT_NAME}:!:19000:0:99999:7:::")
    # mmdebstrap leaves the build host's name and resolver here; the sandbox has neither.
    for rel, text in (
        ("hostname", "agentbox\n"),
        ("hosts", "127.0.0.1\tlocalhost\n::1\tlocalhost\n"),
        ("resolv.conf", ""),
    ):
        _unlink(etc / rel, [], root)
        (etc / rel).write_text(text)
        (etc / rel).chmod(0o644)
    for mp in MOUNT_POINTS:
        d = resolve_parent_in(root, mp)
        d.mkdir(mode=0o755, parents=True, exist_ok=True)
        d.chmod(0o755)
    home = resolve_in(root, AGENT_HOME)
    os.chown(home, uid, uid)
    # podman (4.3, runc) gives a tmpfs mounted on a directory that exists in the image
    # that directory's mode, owned by root, and ignores the tmpfs `mode=` option: the
    # sandbox's $HOME tmpfs is writable by the agent only if the image's is 1777.
    home.chmod(HOME_MODE)


def verify(
    root: Path,
    *,
    sandbox_uid: int = 64000,
    guest_names: Sequence[str] = (),
    require_claude: bool = True,
    tools_anywhere: bool = False,
) -> None:
    """Read the finished root and raise ImageError naming every offending path.

    Checks: no setuid/setgid file or directory and no file capability anywhere;
    no package manager, su/sudo or identity tool on any PATH dir (with
    ``tools_anywhere``, as for an image from a user's Containerfile: no
    executable ELF program by such a name anywhere, so a copy of ``dpkg``
    kept in ``/opt`` is found too, while a packaged hook script such as
    ``/usr/share/bug/dpkg-dev`` is not a package manager); no dpkg/apt
    state; Claude Code present and executable; tini, the ``agent`` user, the
    guest programs and the mount points present.
    """
    problems: list[str] = []
    path_dirs = _path_dirs(root)
    for p, st in walk(root):
        if stat.S_ISLNK(st.st_mode):
            continue
        rel = "/" + str(p.relative_to(root)) if p != root else "/"
        if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            kind = "setuid" if st.st_mode & stat.S_ISUID else "setgid"
            problems.append(f"{kind} {oct(stat.S_IMODE(st.st_mode))}: {rel}")
        elif stat.S_ISREG(st.st_mode) and _CAP_XATTR in _xattrs(p):
            problems.append(f"file capability: {rel}")
        if (
            tools_anywhere
            and stat.S_ISREG(st.st_mode)
            and st.st_mode & 0o111
            and forbidden_name(p.name)
            and p.parent not in path_dirs
            and _is_elf(p)
        ):
            problems.append(f"forbidden tool: {rel}")
    for d in path_dirs:
        for entry in sorted(d.iterdir()):
            if forbidden_name(entry.name):
                problems.append(f"forbidden tool on PATH: /{entry.relative_to(root)}")
    for rel in _MUST_BE_GONE:
        if resolve_parent_in(root, rel).exists():
            problems.append(f"package-manager state left: {rel}")

    def executable(rel: str) -> bool:
        p = resolve_in(root, rel)
        try:
            st = p.lstat()
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and bool(st.st_mode & 0o111) and st.st_size > 0

    if require_claude and not executable(CLAUDE_PATH):
        problems.append(f"Claude Code missing or not executable: {CLAUDE_PATH}")
    for rel in ESSENTIAL:
        if not executable(rel):
            problems.append(f"essential program missing: {rel}")
    for rel in ("/bin", "/sbin", "/lib", "/usr/lib", "/tmp", "/etc"):
        if not resolve_in(root, rel).is_dir():
            problems.append(f"essential directory missing: {rel}")
    passwd = resolve_in(root, "/etc/passwd")
    want = f":{sandbox_uid}:{sandbox_uid}:"
    if not passwd.is_file() or not any(
        line.startswith(f"{AGENT_NAME}:") and want in line
        for line in passwd.read_text(errors="replace").splitlines()
    ):
        problems.append(f"user {AGENT_NAME} ({sandbox_uid}) missing: /etc/passwd")
    for name in guest_names:
        if not resolve_in(root, f"{GUEST_DIR}/{name}").is_file():
            problems.append(f"guest program missing: {GUEST_DIR}/{name}")
    if RELAY_SOURCE in guest_names:
        relay = resolve_in(root, f"{GUEST_DIR}/{RELAY_BINARY}")
        if not relay.is_file() or not os.access(relay, os.X_OK):
            problems.append(f"guest program missing: {GUEST_DIR}/{RELAY_BINARY}")
    for mp in MOUNT_POINTS:
        if not resolve_in(root, mp).is_dir():
            problems.append(f"mount point missing: {mp}")
    home = resolve_in(root, AGENT_HOME)
    if home.is_dir() and stat.S_IMODE(home.lstat().st_mode) != HOME_MODE:
        problems.append(f"{AGENT_HOME} must be mode {oct(HOME_MODE)} (a tmpfs over it inherits it)")
    if problems:
        shown = problems[:40]
        more = f"\n  … and {len(problems) - 40} more" if len(problems) > 40 else ""
        raise ImageError(
            f"image root {root} failed verification ({len(problems)} problem(s)):\n  "
            + "\n  ".join(shown)
            + more
        )
