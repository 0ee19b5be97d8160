"""The guest agent's mounts at ``hello``: the workspace disk, declared read-only
disks and copy-on-write overlays (part of :mod:`agentbox.guest.agent`)."""

from __future__ import annotations

# ruff: noqa: SIM105 - try/except/pass instead of contextlib.suppress: no contextlib import
import fcntl
import os

if __package__:
    from .wire import (
        DATA_LABEL,
        ProtocolError,
    )
else:  # pragma: no cover - the guest's layout: top-level modules next to agent.py
    from wire import (  # type: ignore[import-not-found,no-redef]
        DATA_LABEL,
        ProtocolError,
    )
if __package__:
    from ._agent_sys import (
        COW_DIR,
        MOUNT_LABEL_PREFIX,
        MS_NODEV,
        MS_NOSUID,
        MS_RDONLY,
        WORKSPACE,
        Channel,
        _find_label,
        _mount,
    )
else:  # pragma: no cover - the guest's layout: top-level modules next to agent.py
    from _agent_sys import (  # type: ignore[import-not-found,no-redef]
        COW_DIR,
        MOUNT_LABEL_PREFIX,
        MS_NODEV,
        MS_NOSUID,
        MS_RDONLY,
        WORKSPACE,
        Channel,
        _find_label,
        _mount,
    )


#: The copy-on-write mounts' writable layers, at the root of the /data disk.
ENV_LAYER = ".agentbox-env-layer"


class Mounts(Channel):
    """Mounting what the host attached, before any command runs."""

    def mount_data(self) -> None:
        # A cold boot's /init has mounted it already (agentbox_data=1); a restored
        # snapshot's template never did, and the disk under it was swapped.
        if not os.path.ismount(WORKSPACE):
            dev = _find_label(DATA_LABEL)
            if dev is None:
                raise OSError("no /data disk")
            with open(dev, "rb") as f:
                # Drop whatever a snapshot's template cached of the placeholder disk.
                fcntl.ioctl(f, 0x1261)  # BLKFLSBUF
            # commit=1: the journal commits every second (default 5), so a VM killed
            # from outside (deadline, launcher crash) loses at most ~1 s of the
            # agent's writes when the host reads the disk back.
            _mount(dev, WORKSPACE, "ext4", 0x2 | 0x4, "commit=1")  # MS_NOSUID | MS_NODEV
        # mkfs.ext4 made it; the workspace should look exactly like the host's copy.
        try:
            os.rmdir(WORKSPACE + "/lost+found")
        except OSError:
            pass
        if os.lstat(WORKSPACE).st_uid != self.uid:
            # The host's copy carries host ids; in here it all belongs to the sandbox uid.
            for root, dirs, files in os.walk(WORKSPACE):
                for name in dirs + files:
                    p = os.path.join(root, name)
                    try:
                        if os.lstat(p).st_uid != self.uid:
                            os.lchown(p, self.uid, self.uid)
                    except OSError:
                        pass
            os.lchown(WORKSPACE, self.uid, self.uid)

    def mount_readonly(self, mounts: list) -> None:  # type: ignore[type-arg]
        # Declared mounts, before any command runs: each is a disk QEMU attached
        # read-only, found by its label. No workload has run yet, so nothing in
        # /tmp or /home/agent can be a planted link on the way to a target.
        for m in mounts:
            label, target = str(m["label"]), str(m["target"])
            if not label.startswith(MOUNT_LABEL_PREFIX) or not target.startswith("/"):
                raise ProtocolError(f"bad mount {label!r} on {target!r}")
            dev = _find_label(label)
            if dev is None:
                raise OSError(f"no disk labelled {label}")
            with open(dev, "rb") as f:
                # A restored snapshot's template cached its placeholder: drop that,
                # then make sure the label is still there on the real disk.
                fcntl.ioctl(f, 0x1261)  # BLKFLSBUF
            if _find_label(label) != dev:
                raise OSError(f"{dev} lost its label {label} after the flush")
            # A target under a tmpfs (/tmp, /home/agent) is made here; the host
            # checked that any other target is a directory in the image.
            os.makedirs(target, 0o755, exist_ok=True)
            # MS_RDONLY | MS_NOSUID | MS_NODEV; noload: never replay a journal.
            _mount(dev, target, "ext4", 0x1 | 0x2 | 0x4, "noload")

    def mount_cow(self, mounts: list, size: object) -> None:  # type: ignore[type-arg]
        # Copy-on-write mounts (a frozen environment): each disk read-only as the
        # lower layer of an overlay at its target. The upper layers live on the
        # /data disk, in ENV_LAYER (root's, 0700), so what the workload writes
        # there shares the task's disk limit with the workspace (ENOSPC past it)
        # and costs no guest memory (a tmpfs layer counted it twice: in the guest's
        # page cache and as the VM's RAM). ``size`` (the disk limit) is checked
        # only: the disk is the bound. The disk under the overlay never changes.
        if not mounts:
            return
        if type(size) is not int or size <= 0:
            raise ProtocolError(f"bad cow size {size!r}")
        if not os.path.ismount(WORKSPACE):
            raise OSError("copy-on-write mounts need the /data disk mounted")
        layer = WORKSPACE + "/" + ENV_LAYER
        if os.path.lexists(layer):
            raise OSError(f"the workspace holds {ENV_LAYER}: the environment's layer's name")
        os.mkdir(layer, 0o700)
        os.makedirs(COW_DIR, 0o700, exist_ok=True)
        for m in mounts:
            label, target = str(m["label"]), str(m["target"])
            if not label.startswith(MOUNT_LABEL_PREFIX) or not target.startswith("/"):
                raise ProtocolError(f"bad cow mount {label!r} on {target!r}")
            dev = _find_label(label)
            if dev is None:
                raise OSError(f"no disk labelled {label}")
            with open(dev, "rb") as f:
                fcntl.ioctl(f, 0x1261)  # BLKFLSBUF (see mount_readonly)
            if _find_label(label) != dev:
                raise OSError(f"{dev} lost its label {label} after the flush")
            lower = f"{COW_DIR}/{label}.lower"
            upper, work = (f"{layer}/{label}.{x}" for x in ("upper", "work"))
            for d in (lower, upper, work):
                os.mkdir(d, 0o755)
            _mount(dev, lower, "ext4", MS_RDONLY | MS_NOSUID | MS_NODEV, "noload")
            # The overlay's root takes the upper dir's owner and mode: the lower root's.
            st = os.stat(lower)
            os.chown(upper, st.st_uid, st.st_gid)
            os.chmod(upper, st.st_mode & 0o777)
            self._make_dirs(target)
            opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
            _mount("overlay", target, "overlay", MS_NOSUID | MS_NODEV, opts)
            self.cow_targets.append(target)
        # The overlays hold their layer dirs; an empty read-only tmpfs over the name
        # leaves the workload nothing to read, rename or fill there, and the layer is
        # skipped like a target when /workspace is copied out (the host's read of a
        # dead VM's disk prunes it by name: agentbox.backends.microvm._diskexport).
        _mount("tmpfs", layer, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | 0x8, "size=4k,mode=0555")
        self.cow_targets.append(layer)

    def _make_dirs(self, target: str) -> None:
        # Each component a directory, never a link: /workspace is the repo's (the
        # host made the mount point; a repo's link there must not lead the mount).
        import stat as _stat

        path = ""
        for part in target.strip("/").split("/"):
            if part in ("", ".", ".."):
                raise ProtocolError(f"bad mount target {target!r}")
            path += "/" + part
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                os.mkdir(path, 0o755)
                if path.startswith((WORKSPACE + "/", "/home/agent/")):
                    os.lchown(path, self.uid, self.uid)
                continue
            if not _stat.S_ISDIR(mode):
                raise OSError(f"mount target {target}: {path} is not a directory")
