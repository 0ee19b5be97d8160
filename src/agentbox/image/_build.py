"""Build the default image: a cached Debian base, then Claude Code, guest programs, hardening.

Cache layout under ``Settings.cache_dir / "images"``::

    .lock                       held (flock) by whoever builds or removes
    .tmp-*/                     a build in progress; renamed into place when done
    digests.json                sha256 of the Claude Code binary by (size, mtime, inode)
    base/<base-key>/rootfs/     the mmdebstrap root (pristine), manifest.json
    <hash>/rootfs/              the finished, verified root (the microVM disk's source)
    <hash>/manifest.json        what went in: keys, packages, claude, guest files, removals

Every build writes into a ``.tmp-*`` dir and renames it into place, under the
lock, so two builds at once never see or leave a half-made image.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agentbox.config import DEFAULT_IMAGE, Settings
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, CommandError, ImageError
from agentbox.image import _harden, _keys, _podman
from agentbox.image._rootfs import safe_rmtree
from agentbox.image._types import HASH_LABEL, ImageInfo

log = get_logger(__name__)

Progress = Callable[[str], None]
DEFAULT_REPO, _, DEFAULT_TAG = DEFAULT_IMAGE.rpartition(":")
BASE_LABEL = "io.agentbox.image.base"
_HASH_RE = re.compile(r"[0-9a-f]{16}")


def images_dir(settings: Settings) -> Path:
    """Where built images are cached."""
    return settings.cache_dir / "images"


@contextlib.contextmanager
def build_lock(images: Path, say: Progress) -> Iterator[None]:
    """Hold the cache's exclusive lock; say so when another build has it."""
    images.mkdir(parents=True, exist_ok=True)
    fd = os.open(images / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("lock: waiting for another image build to finish")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def podman_changes(key: str, base: str, sandbox_uid: int) -> list[str]:
    """The image config given to ``podman import --change``."""
    env = {
        "HOME": "/home/agent",
        "PATH": _harden.IMAGE_PATH,
        "LANG": "C.UTF-8",
        "SHELL": "/bin/bash",
        "USER": "agent",
        # Claude Code: no self-update on a read-only root, the system rg for its search tool.
        "DISABLE_AUTOUPDATER": "1",
        "USE_BUILTIN_RIPGREP": "0",
    }
    return [
        'ENTRYPOINT ["/usr/bin/tini", "--"]',
        'CMD ["/bin/bash"]',
        f"USER {sandbox_uid}:{sandbox_uid}",
        "WORKDIR /workspace",
        *(f"ENV {k}={v}" for k, v in env.items()),
        f"LABEL {HASH_LABEL}={key}",
        f"LABEL {BASE_LABEL}={base}",
    ]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _clean_stale(images: Path) -> None:
    # Only called with the lock held: any .tmp-* left is from a build that died.
    for p in images.glob(".tmp-*"):
        log.info("removing stale build dir", path=str(p))
        safe_rmtree(p)


def _line_sink(say: Progress, phase: str) -> tuple[Callable[[bytes], None], list[str]]:
    buf = bytearray()
    tail: list[str] = []

    def sink(chunk: bytes) -> None:
        buf.extend(chunk)
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            text = line.decode(errors="replace").strip()
            if text:
                tail.append(text)
                del tail[:-30]
                say(f"{phase}: {text}")

    return sink, tail


def _build_base(images: Path, key: str, sources: _keys.AptSources, say: Progress) -> Path:
    tmp = images / f".tmp-base-{key}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        mirrors = []
        if sources.deb822:
            (tmp / "host.sources").write_text(sources.deb822)
            mirrors.append(str(tmp / "host.sources"))
        if sources.one_line:
            (tmp / "host.list").write_text(sources.one_line)
            mirrors.append(str(tmp / "host.list"))
        argv = [
            "mmdebstrap",
            "--variant=minbase",
            "--mode=root",
            "--format=directory",
            f"--include={','.join(_keys.PACKAGES)}",
            '--aptopt=Acquire::Languages "none"',
            *(f"--dpkgopt={o}" for o in _keys.DPKG_OPTIONS),
            _keys.SUITE,
            str(tmp / "rootfs"),
            *mirrors,
        ]
        sink, tail = _line_sink(say, "base")
        started = time.monotonic()
        try:
            rc = _proc.stream(argv, on_stdout=sink, on_stderr=sink, timeout=1800)
        except AgentboxError as exc:
            raise ImageError(f"mmdebstrap failed: {exc}\n" + "\n".join(tail[-10:])) from exc
        if rc != 0:
            raise ImageError(f"mmdebstrap {_keys.SUITE} exited {rc}:\n" + "\n".join(tail[-15:]))
        _write_json(
            tmp / "manifest.json",
            {
                "key": key,
                "suite": _keys.SUITE,
                "packages": list(_keys.PACKAGES),
                "builder_version": _keys.BUILDER_VERSION,
                "apt_sources_from": [str(p) for p in sources.origin],
                "seconds": round(time.monotonic() - started, 1),
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
            },
        )
        dest = images / "base" / key
        dest.parent.mkdir(exist_ok=True)
        safe_rmtree(dest)
        tmp.rename(dest)
        return dest
    except BaseException:
        safe_rmtree(tmp)
        raise


#: Finished images kept besides the newest, so a running sandbox's image survives a rebuild.
KEEP_PREVIOUS = 2


def _is_default(entry: Path) -> bool:
    """True for a kept default image (not one built from a Containerfile)."""
    try:
        data = json.loads((entry / "manifest.json").read_text())
    except (OSError, ValueError):
        return True
    return not (isinstance(data, dict) and data.get("kind") == "containerfile")


def _prune(images: Path, key: str, base: str) -> list[str]:
    """Drop older default images (cache dir and podman tags) and unused bases.

    Called with the lock held, after a new image is in place. An image a
    container still uses stays (podman refuses; we never force).
    """
    olds = sorted(
        (
            p
            for p in images.iterdir()
            if _HASH_RE.fullmatch(p.name) and p.name != key and _is_default(p)
        ),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    keep = {key, *(p.name for p in olds[:KEEP_PREVIOUS])}
    removed: list[str] = []
    for entry in _podman.list_labelled(HASH_LABEL):
        labels = entry.get("Labels")
        old = str(labels.get(HASH_LABEL)) if isinstance(labels, dict) else ""
        names = [str(n) for n in entry.get("Names") or [] if str(n).startswith(f"{DEFAULT_REPO}:")]
        if old in keep or not names or DEFAULT_IMAGE in names:
            continue
        try:
            _podman.remove_names(names)
        except ImageError as exc:
            log.info("keeping an old image still in use", image=names, error=str(exc))
            keep.add(old)
            continue
        removed += names
    for p in olds:
        if p.name not in keep:
            safe_rmtree(p)
            removed.append(str(p))
    bases = images / "base"
    if bases.is_dir():
        for p in bases.iterdir():
            if p.name != base:
                safe_rmtree(p)
                removed.append(str(p))
    return removed


def _import(root: Path, workdir: Path, key: str, base: str, uid: int, say: Progress) -> str:
    say("import: packing the root")
    tarball = workdir / f".tmp-import-{key}-{secrets.token_hex(4)}.tar"
    try:
        try:
            _proc.run(
                ["tar", "--create", "--file", str(tarball), "--numeric-owner",
                 "--one-file-system", "-C", str(root), "."],
                timeout=900,
            )  # fmt: skip
        except CommandError as exc:
            raise ImageError(f"cannot pack {root} for podman: {exc}") from exc
        say("import: podman import")
        ref = f"{DEFAULT_REPO}:{key}"
        pid = _podman.import_tarball(tarball, reference=ref, changes=podman_changes(key, base, uid))
        _podman.tag(ref, DEFAULT_IMAGE)
        return pid
    finally:
        tarball.unlink(missing_ok=True)


def _base_image(images: Path, bkey: str, say: Progress) -> None:
    """``localhost/agentbox-base``: the Debian root without our layer, for Containerfiles."""
    from agentbox.image._containerfile import ensure_base_image, prune_base_images

    base = images / "base" / bkey / "rootfs"
    if base.is_dir():
        ensure_base_image(base, bkey, say)
        for gone in prune_base_images(bkey):
            say(f"prune: {gone}")


def build_default(
    settings: Settings, *, force: bool = False, progress: Progress | None = None
) -> ImageInfo:
    """Build (or find in the cache) the default image and return it.

    Imports it into podman as ``localhost/agentbox-default:<hash>`` and
    ``:latest``, and keeps its verified root under the cache dir. Its Debian
    root without our layer (apt kept) becomes ``localhost/agentbox-base``, the
    usual ``FROM`` of a Containerfile (:func:`build_containerfile`). With nothing
    changed, returns at once with ``cached=True``. ``force`` rebuilds the
    Debian base and the image. ``progress`` receives ``"<phase>: <what>"`` lines.
    """
    say: Progress = progress or (lambda _msg: None)
    images = images_dir(settings)
    claude = settings.claude_binary
    if not claude.is_file():
        raise ImageError(
            f"Claude Code binary not found at {claude}: run scripts/setup.sh "
            f"(it installs @anthropic-ai/claude-code@{settings.claude_code_version})"
        )
    if os.geteuid() != 0:
        raise ImageError("agentbox image build runs as root (mmdebstrap root mode, podman as root)")
    for tool, package in (("mmdebstrap", "mmdebstrap"), ("podman", "podman"), ("tar", "tar")):
        if shutil.which(tool) is None:
            raise ImageError(
                f"{tool} not found: the image build needs it (apt-get install {package})"
            )
    say("inputs: hashing apt sources, Claude Code, guest programs")
    sources = _keys.host_apt_sources()
    bkey = _keys.base_key(sources)
    images.mkdir(parents=True, exist_ok=True)
    cdigest = _keys.file_digest(claude, images / "digests.json")
    gdir = _keys.guest_dir()
    guest = _keys.guest_files(gdir)
    uid = settings.sandbox_uid
    key = _keys.final_key(
        bkey,
        claude_version=settings.claude_code_version,
        claude_digest=cdigest,
        guest=guest,
        sandbox_uid=uid,
    )
    ref = f"{DEFAULT_REPO}:{key}"
    final = images / key
    with build_lock(images, say):
        if not force and (final / "manifest.json").is_file() and (final / "rootfs").is_dir():
            got = _podman.inspect(ref)
            if got is not None and _podman.labels_of(got).get(HASH_LABEL) == key:
                latest = _podman.inspect(DEFAULT_IMAGE)
                if latest is None or latest.get("Id") != got.get("Id"):
                    _podman.tag(ref, DEFAULT_IMAGE)
                _base_image(images, bkey, say)
                say(f"cached: {key}")
                return ImageInfo(DEFAULT_IMAGE, key, final / "rootfs", str(got.get("Id")), True)
            # The root is kept but podman lost the image (podman rmi, storage reset).
            pid = _import(final / "rootfs", images, key, bkey, uid, say)
            return ImageInfo(DEFAULT_IMAGE, key, final / "rootfs", pid, False)

        _clean_stale(images)
        base = images / "base" / bkey
        if force or not (base / "manifest.json").is_file():
            say(f"base: mmdebstrap {_keys.SUITE} (minbase + {len(_keys.PACKAGES)} packages)")
            base = _build_base(images, bkey, sources, say)
        else:
            say(f"base: cached {bkey}")

        tmp = images / f".tmp-{key}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            root = tmp / "rootfs"
            say("copy: base root")
            try:
                _proc.run(
                    ["cp", "-a", "--reflink=auto", str(base / "rootfs"), str(root)], timeout=600
                )
            except CommandError as exc:
                raise ImageError(f"cannot copy the base root: {exc}") from exc
            say("install: Claude Code, guest programs, agent user")
            _harden.install(
                root, claude_binary=claude, guest_source=gdir, guest_names=guest, sandbox_uid=uid
            )
            say("harden: removing apt/dpkg, su, identity tools; stripping setuid/setgid")
            done = _harden.harden(root)
            say("verify: walking the finished root")
            _harden.verify(root, sandbox_uid=uid, guest_names=sorted(guest))
            _write_json(
                tmp / "manifest.json",
                {
                    "hash": key,
                    "base": bkey,
                    "name": DEFAULT_IMAGE,
                    "suite": _keys.SUITE,
                    "packages": list(_keys.PACKAGES),
                    "claude_code": {"version": settings.claude_code_version, "sha256": cdigest},
                    "guest": guest,
                    "sandbox_uid": uid,
                    "hardening_version": _keys.HARDENING_VERSION,
                    "removed": done["removed"],
                    "stripped": done["stripped"],
                    "created": datetime.now(UTC).isoformat(timespec="seconds"),
                },
            )
            safe_rmtree(final)
            tmp.rename(final)
        except BaseException:
            safe_rmtree(tmp)
            raise
        pid = _import(final / "rootfs", images, key, bkey, uid, say)
        _base_image(images, bkey, say)
        for gone in _prune(images, key, bkey):
            say(f"prune: {gone}")
        say(f"done: {DEFAULT_IMAGE} ({key})")
        return ImageInfo(DEFAULT_IMAGE, key, final / "rootfs", pid, False)
