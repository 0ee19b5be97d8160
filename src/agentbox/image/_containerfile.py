"""Images from a user's Containerfile, and ``localhost/agentbox-base`` to build them ``FROM``.

The user's file is the user's trusted step: ``podman build`` runs it with the
host's network (``--network=host``: apt reaches the host's Debian mirror with
the host's resolver and proxy settings). Then, as for the default image,
agentbox copies the result's root out of podman, adds its layer (Claude Code,
the guest programs, the ``agent`` user and its home), runs the hardening pass
and the verifier, and imports the verified root as a one-layer image. A
verifier failure names every offending path, and nothing is tagged.

The hardening pass removes the package manager the build used (the base keeps
apt so ``RUN apt-get install`` works) and strips setuid/setgid bits and file
capabilities from files Debian's packages installed. A setuid, setgid or
capability file the Containerfile made itself, or a package-manager binary
kept anywhere in the tree, is not silently fixed: the verifier refuses the
image and names it.

Cache: ``<images>/<key>/{rootfs,manifest.json}`` like the default image. The
key hashes the Containerfile, every file of the context (path, type, mode,
content), the ids of the local images it is built ``FROM``, and our layer
(Claude Code, guest programs, uid, hardening version).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.core.oci import HOST_KERNEL_RUNTIMES, PODMAN_RUNTIMES
from agentbox.errors import AgentboxError, CommandError, ImageError
from agentbox.image import _harden, _keys, _podman
from agentbox.image._build import (
    Progress,
    _line_sink,
    _write_json,
    build_lock,
    images_dir,
    podman_changes,
)
from agentbox.image._cfkey import (
    containerfile_key,
    from_images,
)
from agentbox.image._rootfs import safe_rmtree
from agentbox.image._types import HASH_LABEL, ImageInfo

log = get_logger(__name__)

#: The default image's Debian root without our layer, apt kept: the usual ``FROM``.
BASE_REPO = "localhost/agentbox-base"
BASE_IMAGE = f"{BASE_REPO}:latest"
#: Every Containerfile image is also tagged ``<CUSTOM_REPO>:<key>`` (how the cache finds it).
CUSTOM_REPO = "localhost/agentbox-custom"
#: ``base`` on agentbox-base, ``containerfile`` on images built from a Containerfile.
KIND_LABEL = "io.agentbox.image.kind"
#: The image config keys agentbox sets; a Containerfile's own ENV for these is replaced.
_OWN_ENV = frozenset({"HOME", "PATH", "LANG", "SHELL", "USER", "DISABLE_AUTOUPDATER"})
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


# -- agentbox-base -------------------------------------------------------------------------


def ensure_base_image(base_root: Path, bkey: str, say: Progress) -> str:
    """Import the Debian base root (apt kept) as ``localhost/agentbox-base:{<bkey>,latest}``.

    Cheap when it is there already (one ``podman image inspect``). Called with
    the images lock held, by ``agentbox image build``. Returns the image id.
    """
    ref = f"{BASE_REPO}:{bkey}"
    got = _podman.inspect(ref)
    if got is None or _podman.labels_of(got).get(KIND_LABEL) != "base":
        say("base image: podman import of the Debian root as " + BASE_IMAGE)
        tarball = base_root.parent / f".tmp-import-base-{secrets.token_hex(4)}.tar"
        try:
            try:
                _proc.run(
                    ["tar", "--create", "--file", str(tarball), "--numeric-owner",
                     "--one-file-system", "-C", str(base_root), "."],
                    timeout=900,
                )  # fmt: skip
            except CommandError as exc:
                raise ImageError(f"cannot pack {base_root} for podman: {exc}") from exc
            changes = [
                'CMD ["/bin/bash"]',
                f"ENV PATH={_harden.IMAGE_PATH}",
                "ENV LANG=C.UTF-8",
                f"LABEL {KIND_LABEL}=base",
                f"LABEL io.agentbox.image.base={bkey}",
            ]
            pid = _podman.import_tarball(tarball, reference=ref, changes=changes)
        finally:
            tarball.unlink(missing_ok=True)
    else:
        pid = str(got.get("Id") or "")
    latest = _podman.inspect(BASE_IMAGE)
    if latest is None or str(latest.get("Id")) != pid:
        _podman.tag(ref, BASE_IMAGE)
    return pid


def prune_base_images(keep: str) -> list[str]:
    """Untag ``agentbox-base:<key>`` images of other bases (those a build still uses stay)."""
    removed: list[str] = []
    for entry in _podman.list_labelled(f"{KIND_LABEL}=base"):
        names = [str(n) for n in entry.get("Names") or [] if str(n).startswith(f"{BASE_REPO}:")]
        if not names or f"{BASE_REPO}:{keep}" in names:
            continue
        try:
            _podman.remove_names(names)
        except ImageError as exc:
            log.info("keeping an old base image still in use", image=names, error=str(exc))
            continue
        removed += names
    return removed


# -- the build -----------------------------------------------------------------------------


def _build_runtime(settings: Settings) -> list[str]:
    """``podman build --runtime``: the one agentbox's sandboxes use when it runs on the
    host's kernel (crun refuses hybrid cgroup hosts), else podman's first (its default):
    a runtime with its own kernel (gVisor) does not build (the podman backend's traits,
    :mod:`agentbox.core.oci`)."""
    runtime: str = settings.runtime
    if runtime not in PODMAN_RUNTIMES or runtime not in HOST_KERNEL_RUNTIMES:
        runtime = PODMAN_RUNTIMES[0]
    return ["--runtime", runtime] if shutil.which(runtime) else []


def _user_env(info: dict[str, Any]) -> list[str]:
    """The Containerfile's own ENV lines, minus the ones agentbox sets."""
    env = (info.get("Config") or {}).get("Env") or []
    out = []
    for item in env if isinstance(env, list) else []:
        name, sep, value = str(item).partition("=")
        if sep and _ENV_NAME.fullmatch(name) and name not in _OWN_ENV and "\n" not in value:
            out.append(f"ENV {name}={json.dumps(value)}")
    return out


@contextlib.contextmanager
def _mounted(image_id: str) -> Iterator[Path]:
    try:
        res = _proc.run(["podman", "image", "mount", image_id], timeout=120)
    except AgentboxError as exc:
        raise ImageError(f"podman image mount {image_id[:12]} failed: {exc}") from exc
    try:
        yield Path(res.stdout.strip())
    finally:
        with contextlib.suppress(AgentboxError):
            _proc.run(["podman", "image", "unmount", image_id], timeout=120)


def _podman_build(
    settings: Settings, containerfile: Path, context: Path, tag: str, iidfile: Path, say: Progress
) -> str:
    argv = [
        "podman", "build", *_build_runtime(settings), "--network=host",
        "--file", str(containerfile), "--tag", tag, "--iidfile", str(iidfile),
        "--label", f"{KIND_LABEL}=build", str(context),
    ]  # fmt: skip
    sink, tail = _line_sink(say, "build")
    try:
        rc = _proc.stream(argv, on_stdout=sink, on_stderr=sink, timeout=3600)
    except FileNotFoundError as exc:
        raise ImageError("podman not found: apt-get install podman") from exc
    except AgentboxError as exc:
        raise ImageError(f"podman build failed: {exc}\n" + "\n".join(tail[-10:])) from exc
    if rc != 0:
        raise ImageError(f"podman build of {containerfile} exited {rc}:\n" + "\n".join(tail[-15:]))
    return iidfile.read_text().strip().removeprefix("sha256:")


def _checked_tag(tag: str | None) -> str | None:
    if tag is None:
        return None
    _podman.check_reference(tag)
    bare = tag.rsplit("/", 1)[-1]
    if bare.split(":", 1)[0] in ("agentbox-default", "agentbox-base", "agentbox-custom"):
        raise ImageError(f"--tag {tag}: that name belongs to an image agentbox makes itself")
    return tag


def build_containerfile(
    settings: Settings,
    containerfile: Path,
    *,
    context: Path | None = None,
    tag: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> ImageInfo:
    """Build an image from ``containerfile`` with agentbox's layer, hardened and verified.

    ``context`` defaults to the Containerfile's directory. The image is tagged
    ``localhost/agentbox-custom:<key>`` and, if given, ``tag``; its verified
    root is kept for the microVM backends. With nothing changed (same
    Containerfile, context, base image ids and agentbox layer) it returns at
    once with ``cached=True``. A verifier failure raises ImageError naming
    every offending path, and nothing is tagged.
    """
    say: Progress = progress or (lambda _msg: None)
    tag = _checked_tag(tag)
    if os.geteuid() != 0:
        raise ImageError("agentbox image build runs as root (podman as root)")
    claude = settings.claude_binary
    if not claude.is_file():
        raise ImageError(
            f"Claude Code binary not found at {claude}: run scripts/setup.sh "
            f"(it installs @anthropic-ai/claude-code@{settings.claude_code_version})"
        )
    try:
        cf_stat = containerfile.stat()
    except OSError as exc:
        raise ImageError(f"cannot read the Containerfile {containerfile}: {exc}") from exc
    if not stat.S_ISREG(cf_stat.st_mode):
        raise ImageError(f"the Containerfile {containerfile} is not a regular file")
    if cf_stat.st_size > 1 << 20:
        raise ImageError(f"the Containerfile {containerfile} is larger than 1 MiB")
    text = containerfile.read_bytes()
    ctx = (context or containerfile.parent).resolve()
    if not ctx.is_dir():
        raise ImageError(f"the build context {ctx} is not a directory")

    say("inputs: hashing the Containerfile, its context, base images, our layer")
    from_ids: dict[str, str] = {}
    for ref in from_images(text.decode(errors="replace")):
        got = _podman.inspect(ref) if _podman.valid_reference(ref) else None
        # A name podman does not have locally (or one with build ARGs in it) keys by its
        # text; podman build then finds it or fails with its own message.
        from_ids[ref] = str(got.get("Id")) if got is not None else f"unresolved:{ref}"
    # A ``localhost/`` name is never pulled: one podman does not have fails now, not after
    # the build lock (another build may hold it for minutes) and podman's three pull tries.
    local = [
        r
        for r, i in from_ids.items()
        if i.startswith("unresolved:") and _local_only(r) and _podman.valid_reference(r)
    ]
    if local:
        raise ImageError(
            f"FROM {', '.join(local)}: not in podman's local storage (run `agentbox image "
            f"build` for {BASE_IMAGE}, or build it first)"
        )
    images = images_dir(settings)
    images.mkdir(parents=True, exist_ok=True)
    cdigest = _keys.file_digest(claude, images / "digests.json")
    gdir = _keys.guest_dir()
    guest = _keys.guest_files(gdir)
    uid = settings.sandbox_uid
    key = containerfile_key(
        text,
        ctx,
        from_ids,
        claude_version=settings.claude_code_version,
        claude_digest=cdigest,
        guest=guest,
        sandbox_uid=uid,
    )
    ref = f"{CUSTOM_REPO}:{key}"
    name = tag or ref
    final = images / key
    with build_lock(images, say):
        if not force and (final / "manifest.json").is_file() and (final / "rootfs").is_dir():
            got = _podman.inspect(ref)
            if got is not None and _podman.labels_of(got).get(HASH_LABEL) == key:
                if tag is not None:
                    named = _podman.inspect(tag)
                    if named is None or named.get("Id") != got.get("Id"):
                        _podman.tag(ref, tag)
                say(f"cached: {key}")
                return ImageInfo(name, key, final / "rootfs", str(got.get("Id")), True)

        started = time.monotonic()
        tmp = images / f".tmp-{key}-{secrets.token_hex(4)}"
        tmp.mkdir()
        build_tag = f"localhost/agentbox-build-{secrets.token_hex(6)}:{key}"
        built: str | None = None
        try:
            say(f"build: podman build {containerfile} (context {ctx})")
            try:
                built = _podman_build(settings, containerfile, ctx, build_tag, tmp / "iid", say)
            except ImageError as exc:
                missing = [r for r, i in from_ids.items() if i.startswith("unresolved:")]
                if not missing:
                    raise
                raise ImageError(
                    f"{exc}\nFROM {', '.join(missing)}: not in podman's local storage (run "
                    f"`agentbox image build` for {BASE_IMAGE}, or build or pull it first)"
                ) from exc
            user = _podman.inspect(built) or {}
            root = tmp / "rootfs"
            say("copy: the built image's root")
            with _mounted(built) as mnt:
                try:
                    _proc.run(["cp", "-a", "--reflink=auto", f"{mnt}/.", str(root)], timeout=900)
                except CommandError as exc:
                    raise ImageError(f"cannot copy the built image's root: {exc}") from exc
            say("install: Claude Code, guest programs, agent user")
            _harden.install(
                root, claude_binary=claude, guest_source=gdir, guest_names=guest, sandbox_uid=uid
            )
            say("harden: removing apt/dpkg, su, identity tools; stripping packaged setuid/setgid")
            done = _harden.harden(root, strip="packaged")
            say("verify: walking the finished root")
            _harden.verify(root, sandbox_uid=uid, guest_names=sorted(guest), tools_anywhere=True)
            _write_json(
                tmp / "manifest.json",
                {
                    "hash": key,
                    "kind": "containerfile",
                    "name": name,
                    "containerfile": str(containerfile.resolve()),
                    "context": str(ctx),
                    "from": from_ids,
                    "claude_code": {"version": settings.claude_code_version, "sha256": cdigest},
                    "guest": guest,
                    "sandbox_uid": uid,
                    "hardening_version": _keys.HARDENING_VERSION,
                    "removed": done["removed"],
                    "stripped": done["stripped"],
                    "seconds": round(time.monotonic() - started, 1),
                    "created": datetime.now(UTC).isoformat(timespec="seconds"),
                },
            )
            (tmp / "iid").unlink(missing_ok=True)
            safe_rmtree(final)
            tmp.rename(final)
        except BaseException:
            safe_rmtree(tmp)
            raise
        finally:
            if built is not None:
                with contextlib.suppress(ImageError):
                    _podman.remove_names([build_tag])
        pid = _import(final / "rootfs", images, key, uid, _user_env(user), say)
        if tag is not None:
            _podman.tag(ref, tag)
        say(f"done: {name} ({key})")
        return ImageInfo(name, key, final / "rootfs", pid, False)


def _import(root: Path, workdir: Path, key: str, uid: int, env: list[str], say: Progress) -> str:
    say("import: packing the root")
    tarball = workdir / f".tmp-import-{key}-{secrets.token_hex(4)}.tar"
    try:
        try:
            _proc.run(
                ["tar", "--create", "--file", str(tarball), "--numeric-owner", "--xattrs",
                 "--one-file-system", "-C", str(root), "."],
                timeout=900,
            )  # fmt: skip
        except CommandError as exc:
            raise ImageError(f"cannot pack {root} for podman: {exc}") from exc
        say("import: podman import")
        ref = f"{CUSTOM_REPO}:{key}"
        changes = [
            *env,
            *podman_changes(key, "containerfile", uid),
            f"LABEL {KIND_LABEL}=containerfile",
        ]
        return _podman.import_tarball(tarball, reference=ref, changes=changes)
    finally:
        tarball.unlink(missing_ok=True)


def build_for_boxfile(
    settings: Settings, box: Boxfile, *, progress: Progress | None = None
) -> Boxfile:
    """A Boxfile with an ``[image]`` table, with its image built (or found in the cache).

    Returns ``box`` itself when it names an image; else a copy naming the image
    built from its Containerfile, with the table consumed. A sandbox is never
    made from a Boxfile whose table was not built this way
    (:func:`agentbox.sandbox.spec_from_boxfile` refuses it).
    """
    build = box.image_build
    if build is None:
        return box
    info = build_containerfile(
        settings, build.containerfile, context=build.context, tag=build.tag, progress=progress
    )
    return box.model_copy(update={"image": info.name, "image_build": None})


def _local_only(ref: str) -> bool:
    """Whether image ``ref`` names podman's local storage only (``localhost/…``), which no
    registry serves."""
    return ref.split("/", 1)[0] == "localhost" and "/" in ref
