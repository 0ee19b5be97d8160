"""Reading a dead guest's ``/data`` disk without mounting it, for partial results.

A guest that stopped mid-run (deadline, crash, broken protocol) cannot stream
its files out, but its ``/data`` disk is still there. The host never mounts a
guest-written filesystem; instead, in the same kind of jail as the VMM (own
namespaces, an unprivileged uid that owns nothing, no capabilities, only the
disk and an empty output dir bound), ``e2fsck -E journal_only`` replays the
journal and ``debugfs rdump`` copies the tree out in userspace. Whatever that
produced is then copied into the destination through the safe path layer
(links kept only when they stay inside, specials skipped, setuid dropped), as
the hostile tree it is.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from agentbox.backends.microvm._export import MAX_EXPORT_BYTES, MAX_EXPORT_FILE, _inside
from agentbox.backends.microvm._jail import JailSpec, jail_argv
from agentbox.core import proc as _proc
from agentbox.errors import CollectError, PathRefused
from agentbox.safepath import Kind, SafeWriter, Tree

EXPORT_TIMEOUT = 900.0


def export_disk(image: Path, dest: Path, *, uid: int) -> list[tuple[str, str]]:
    """Copy the files of the ext4 ``image`` into ``dest`` (which must not exist).

    ``uid`` is the unprivileged host uid the reader runs as. Returns what was skipped.
    """
    if dest.exists() or dest.is_symlink():
        raise PathRefused("export destination exists", path=dest)
    with tempfile.TemporaryDirectory(prefix=".agentbox-rdump-", dir=dest.parent) as tmp:
        out = Path(tmp) / "out"
        out.mkdir(mode=0o700)
        os.chown(out, uid, uid)
        os.chown(image, uid, uid)
        disk = "/vm/data.img"
        ro: tuple[tuple[Path, str], ...] = ()
        rw: tuple[tuple[Path, str], ...] = ((image, "/vm/data.img"), (out, "/vm/out"))
        flatten = ""
        if _is_qcow2(image):
            # A fork's disk (microvm/_fork.py): a qcow2 overlay over data-base.img beside
            # it. Flattened in the jail first; its backing is named here, never taken from
            # the (VMM-written) header.
            base = image.with_name("data-base.img")
            flat = Path(tmp) / "flat"
            flat.mkdir(mode=0o700)
            os.chown(flat, uid, uid)
            ro, rw = ((base, "/vm/data-base.img"),), (*rw, (flat, "/vm/flat"))
            disk = "/vm/flat/data.img"
            flatten = (
                "qemu-img convert -q -O raw --image-opts driver=qcow2,file.filename=/vm/data.img,"
                "backing.driver=raw,backing.file.filename=/vm/data-base.img /vm/flat/data.img"
                " || exit 1;"
            )
        inner = [
            "/bin/sh", "-c",
            f"{flatten} e2fsck -E journal_only -y {disk} >/dev/null 2>&1;"
            f" exec debugfs -R 'rdump / /vm/out' {disk}",
        ]  # fmt: skip
        spec = JailSpec(ro, rw, uid, uid)
        try:
            _proc.run(jail_argv(spec, inner), timeout=EXPORT_TIMEOUT)
        except Exception as exc:
            raise CollectError(f"cannot read the guest's /data disk {image}: {exc}") from exc
        return _copy_tree(out, dest)


def _is_qcow2(image: Path) -> bool:
    with image.open("rb") as f:
        return f.read(4) == b"QFI\xfb"


def _copy_tree(src: Path, dest: Path) -> list[tuple[str, str]]:
    skipped: list[tuple[str, str]] = []
    dest.mkdir(mode=0o755)
    with (
        Tree(src) as tree,
        SafeWriter(dest, max_file_size=MAX_EXPORT_FILE, max_total_size=MAX_EXPORT_BYTES) as w,
    ):
        # lost+found is mkfs's; the environment's layer is the guest agent's (never the
        # workspace's: guest/_agent_mounts.py ENV_LAYER).
        for e in tree.walk(prune=lambda rel: rel in (b"lost+found", b".agentbox-env-layer")):
            rel = e.path.decode(errors="surrogateescape")
            try:
                if e.kind is Kind.DIR:
                    w.mkdir(rel, e.mode)
                elif e.kind is Kind.FILE:
                    fd = tree.open(e.path)
                    with os.fdopen(fd, "rb") as f:
                        w.write_file(rel, f, e.mode)
                elif e.kind is Kind.SYMLINK:
                    target = tree.readlink(e.path).decode(errors="surrogateescape")
                    if _inside(rel.split("/"), target):
                        w.symlink(rel, target)
                    else:
                        skipped.append((rel, "link pointing out of the copy"))
                else:
                    skipped.append((rel, e.other or "special file"))
            except PathRefused as exc:
                skipped.append((rel, str(exc)))
        skipped += [(p.decode(errors="replace"), why) for p, why in tree.skipped]
    shutil.rmtree(src, ignore_errors=True)
    return skipped
