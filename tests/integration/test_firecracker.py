"""Firecracker's config, jailer argv, jail contents, versions and refusals, without a VMM.

The config is checked against the schema Firecracker documents for
``--config-file`` (its swagger ``FullVmConfiguration`` and the objects it
references; Firecracker rejects unknown fields, so the schema here does too).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import psutil
import pytest

from agentbox.backends.base import BindMount, SandboxSpec
from agentbox.backends.microvm._firecracker import (
    GUEST_CID,
    HOLDER,
    JAIL_FILES,
    MIN_VERSION,
    VSOCK_UDS,
    FcSpec,
    boot_args,
    cgroup_dirs,
    check_versions,
    chroot_dir,
    jailer_argv,
    parse_version,
    place_files,
    vcpu_count,
    vm_config,
)
from agentbox.backends.microvm._jail import VMM_PIDS_MAX
from agentbox.backends.microvm._vm import VMM_OVERHEAD
from agentbox.backends.microvm.firecracker import (
    FirecrackerBackend,
    facility,
    fc_uid,
    firecracker_binaries,
)
from agentbox.backends.microvm.firecracker._backend import _vm_id
from agentbox.backends.microvm.qemu import vmm_uid
from agentbox.config import Settings
from agentbox.errors import AgentboxError, UnsupportedError


def _obj(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required),
            "additionalProperties": False}  # fmt: skip


_RATE = {"type": "object"}
#: Transcribed from Firecracker's swagger (src/firecracker/swagger/firecracker.yaml).
SCHEMA = _obj({
    "boot-source": _obj({"boot_args": {"type": "string"}, "initrd_path": {"type": "string"},
                         "kernel_image_path": {"type": "string"}}, ("kernel_image_path",)),
    "drives": {"type": "array", "items": _obj({
        "drive_id": {"type": "string"}, "partuuid": {"type": "string"},
        "is_root_device": {"type": "boolean"},
        "cache_type": {"enum": ["Unsafe", "Writeback"]},
        "is_read_only": {"type": "boolean"}, "path_on_host": {"type": "string"},
        "rate_limiter": _RATE, "io_engine": {"enum": ["Sync", "Async"]},
        "socket": {"type": "string"},
    }, ("drive_id", "is_root_device"))},
    "machine-config": _obj({
        "cpu_template": {"type": "string"}, "smt": {"type": "boolean"},
        "mem_size_mib": {"type": "integer"}, "track_dirty_pages": {"type": "boolean"},
        "vcpu_count": {"type": "integer", "minimum": 1, "maximum": 32},
        "huge_pages": {"enum": ["None", "Transparent", "2M"]},
    }, ("mem_size_mib", "vcpu_count")),
    "vsock": _obj({"guest_cid": {"type": "integer", "minimum": 3},
                   "uds_path": {"type": "string"}, "vsock_id": {"type": "string"}},
                  ("guest_cid", "uds_path")),
    "network-interfaces": {"type": "array"},
    "logger": _obj({"level": {"enum": ["Error", "Warning", "Info", "Debug", "Trace", "Off"]},
                    "log_path": {"type": "string"}, "show_level": {"type": "boolean"},
                    "show_log_origin": {"type": "boolean"}, "module": {"type": "string"}}),
    "metrics": _obj({"metrics_path": {"type": "string"}}, ("metrics_path",)),
    "balloon": {"type": "object"}, "cpu-config": {"type": "object"},
    "memory-hotplug": {"type": "object"}, "mmds-config": {"type": "object"},
    "pmem": {"type": "array"}, "entropy": {"type": "object"},
})  # fmt: skip


def _spec(
    tmp_path: Path, *, data: bool = True, vcpus: int = 2, uid: int = 165537, mounts: int = 0
) -> FcSpec:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    for name in ("vmlinux", "initramfs.cpio", "root.img"):
        (src / name).write_bytes(name.encode() * 100)
        (src / name).chmod(0o644)
    disk = None
    if data:
        disk = tmp_path / "vm" / "data.img"
        disk.parent.mkdir(exist_ok=True)
        disk.write_bytes(b"\0" * 4096)
    mount_disks = []
    for i in range(mounts):
        m = tmp_path / "vm" / f"m{i}.img"
        m.parent.mkdir(exist_ok=True)
        m.write_bytes(b"\1" * 4096)
        mount_disks.append(m)
    return FcSpec(
        id="task-1-abc123", kernel=src / "vmlinux", initramfs=src / "initramfs.cpio",
        root_disk=src / "root.img", data_disk=disk, vcpus=vcpus, memory_mib=1024,
        uid=uid, gid=uid, mount_disks=tuple(mount_disks),
    )  # fmt: skip


# -- config
@pytest.mark.parametrize("mounts", [0, 2])
def test_config_matches_the_documented_schema(tmp_path: Path, mounts: int) -> None:
    cfg = vm_config(_spec(tmp_path, mounts=mounts))
    jsonschema.validate(cfg, SCHEMA)
    json.dumps(cfg)  # what --config-file gets


def test_config_no_network_root_read_only_data_writable(tmp_path: Path) -> None:
    cfg = vm_config(_spec(tmp_path))
    assert cfg["network-interfaces"] == []
    drives = {d["drive_id"]: d for d in cfg["drives"]}
    assert drives["root"]["is_read_only"] is True
    assert drives["data"]["is_read_only"] is False
    # The initramfs mounts both by label: neither is the kernel's root= device.
    assert not any(d["is_root_device"] for d in cfg["drives"])
    assert cfg["vsock"] == {"guest_cid": GUEST_CID, "uds_path": VSOCK_UDS}
    assert cfg["machine-config"]["mem_size_mib"] == 1024
    assert cfg["machine-config"]["vcpu_count"] == 2
    # Every path the VMM opens is a jail path that place_files puts there.
    paths = [cfg["boot-source"]["kernel_image_path"], cfg["boot-source"]["initrd_path"],
             *(d["path_on_host"] for d in cfg["drives"]), cfg["logger"]["log_path"],
             cfg["metrics"]["metrics_path"]]  # fmt: skip
    assert all(p.startswith("/") and p.count("/") == 1 for p in paths)
    assert {p.lstrip("/") for p in paths} <= set(JAIL_FILES)


def test_config_carries_the_backends_extra_kernel_args(tmp_path: Path) -> None:
    import dataclasses

    spec = dataclasses.replace(_spec(tmp_path), cmdline_extra=("agentbox_data=1",))
    args = vm_config(spec)["boot-source"]["boot_args"].split()
    assert args[-1] == "agentbox_data=1" and "agentbox_transport=vsock" in args


def test_config_without_data_disk(tmp_path: Path) -> None:
    cfg = vm_config(_spec(tmp_path, data=False))
    jsonschema.validate(cfg, SCHEMA)
    assert [d["drive_id"] for d in cfg["drives"]] == ["root"]


def test_boot_args() -> None:
    args = boot_args().split()
    assert "agentbox_transport=vsock" in args
    for want in ("console=ttyS0", "panic=-1", "reboot=k", "tsc=reliable", "init=/init"):
        assert want in args
    assert any(a.startswith("tsc_early_khz=") and a.split("=")[1].isdigit() for a in args)
    # Dotted words go to modules, never to init: the switch must not be one.
    assert not any(a.startswith("agentbox.") for a in args)


@pytest.mark.parametrize(("cpus", "want"), [(1, 1), (2, 2), (3, 2), (5, 4), (0, 1), (64, 32)])
def test_vcpu_count_is_one_or_even(cpus: int, want: int) -> None:
    assert vcpu_count(cpus) == want


# -- jailer argv
def _split(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(unshare part, jailer part, firecracker part); the holder must sit between."""
    first = argv.index("--")
    rest = argv[first + 1 :]
    assert tuple(rest[: len(HOLDER)]) == HOLDER, "pid 1 of the namespace is the holder"
    rest = rest[len(HOLDER) :]
    second = rest.index("--")
    return argv[:first], rest[:second], rest[second + 1 :]


def _flags(part: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for i, a in enumerate(part):
        if a.startswith("--") and i + 1 < len(part) and not part[i + 1].startswith("--"):
            out.setdefault(a, []).append(part[i + 1])
    return out


@pytest.mark.parametrize("version", [1, 2])
def test_jailer_argv(tmp_path: Path, version: int) -> None:
    spec = _spec(tmp_path)
    fc, jl = Path("/opt/fc/firecracker"), Path("/opt/fc/jailer")
    argv = jailer_argv(jl, fc, spec, chroot_base=tmp_path / "jail", cgroup_v=version)
    unshare, jailer, firecracker = _split(argv)
    assert unshare == [
        "unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--net", "--ipc", "--uts",
    ]  # fmt: skip
    assert jailer[0] == str(jl)
    f = _flags(jailer[1:])
    assert f["--id"] == [spec.id]
    assert f["--exec-file"] == [str(fc)]
    assert f["--uid"] == f["--gid"] == [str(spec.uid)]
    assert f["--chroot-base-dir"] == [str(tmp_path / "jail")]
    assert f["--cgroup-version"] == [str(version)]
    assert f["--parent-cgroup"] == ["agentbox"]
    mem = 1024 * 1024**2 + VMM_OVERHEAD
    if version == 2:
        assert f["--cgroup"] == [f"pids.max={VMM_PIDS_MAX}", f"memory.max={mem}",
                                 "memory.swap.max=0"]  # fmt: skip
    else:
        assert f["--cgroup"] == [f"pids.max={VMM_PIDS_MAX}", f"memory.limit_in_bytes={mem}"]
    assert {r.split("=")[0] for r in f["--resource-limit"]} == {"no-file", "fsize"}
    # The guest console goes to stdout (our log), so no --daemonize; the empty netns
    # comes from unshare, so no --netns handle to leak.
    assert "--daemonize" not in jailer and "--netns" not in jailer
    assert "--new-pid-ns" not in jailer
    assert firecracker == ["--config-file", "/config.json", "--no-api"]
    assert cgroup_dirs(spec.id, version)[0].parts[-2:] == ("agentbox", spec.id)


def test_the_unshare_prefix_really_isolates() -> None:
    """The wrapper part of the argv, run for real with a probe in the jailer's place."""
    if os.geteuid() != 0:
        pytest.skip("unshare --net/--pid needs root")
    argv = jailer_argv(
        Path("/j/jailer"), Path("/j/firecracker"), _spec_min(), chroot_base=Path("/")
    )
    unshare = argv[: argv.index("--") + 1 + len(HOLDER)]
    probe = (
        "echo $$; for n in net ipc uts pid; do readlink /proc/self/ns/$n; done;"
        " tail -n +3 /proc/self/net/dev | cut -d: -f1; ls /proc | grep -c '^[0-9]'"
    )
    out = subprocess.run([*unshare, "sh", "-c", probe], capture_output=True, text=True,
                         timeout=30, check=True).stdout.split()  # fmt: skip
    assert out[0] == "2", "the VMM is the holder's child in its own pid namespace"
    ours = [os.readlink(f"/proc/self/ns/{n}") for n in ("net", "ipc", "uts")]
    assert all(theirs != mine for theirs, mine in zip(out[1:4], ours, strict=True))
    assert out[5:-1] == ["lo"], "an empty network namespace"
    # /proc is this pid namespace's: the jailer's /proc/<its pid> is itself.
    assert int(out[-1]) <= 4, "only the namespace's own processes in /proc"


def _spec_min() -> FcSpec:
    p = Path("/nonexistent")
    return FcSpec("x", p, p, p, None, 1, 128, 165537, 165537)


# -- the jail
def test_place_files_puts_exactly_the_declared_files(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    chroot = chroot_dir(tmp_path / "jail", Path("/opt/firecracker"), spec.id)
    before = {p: p.stat() for p in (spec.kernel, spec.initramfs, spec.root_disk)}
    placed = place_files(chroot, spec)
    assert set(placed) == set(JAIL_FILES)
    assert sorted(p.name for p in chroot.rglob("*")) == sorted(JAIL_FILES)
    assert chroot == tmp_path / "jail" / "firecracker" / spec.id / "root"
    for name, src in (("vmlinux", spec.kernel), ("initramfs", spec.initramfs),
                      ("root.img", spec.root_disk)):  # fmt: skip
        st = (chroot / name).stat()
        assert st.st_ino == src.stat().st_ino, "a hard link, not a copy"
        # Never re-owned: the VMM reads the shared cached originals but cannot change them.
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o644)
        assert src.stat().st_mode == before[src].st_mode
    assert spec.data_disk is not None
    data = (chroot / "data.img").stat()
    assert data.st_ino == spec.data_disk.stat().st_ino
    assert (data.st_uid, data.st_gid, stat.S_IMODE(data.st_mode)) == (spec.uid, spec.uid, 0o600)
    assert json.loads((chroot / "config.json").read_text()) == vm_config(spec)
    assert stat.S_IMODE((chroot / "config.json").stat().st_mode) == 0o444
    for name in ("firecracker.log", "metrics.json"):
        assert (chroot / name).stat().st_uid == spec.uid
    assert not any(p.is_symlink() for p in chroot.rglob("*"))


def test_place_files_without_data_disk(tmp_path: Path) -> None:
    spec = _spec(tmp_path, data=False)
    chroot = tmp_path / "jail" / "root"
    place_files(chroot, spec)
    assert "data.img" not in {p.name for p in chroot.iterdir()}


def test_place_files_refuses_a_reused_jail(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    chroot = tmp_path / "jail" / "root"
    chroot.mkdir(parents=True)
    with pytest.raises(AgentboxError, match="already exists"):
        place_files(chroot, spec)


def test_place_files_refuses_a_writable_shared_file(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    spec.root_disk.chmod(0o666)
    with pytest.raises(AgentboxError, match="not group/world-writable"):
        place_files(tmp_path / "jail" / "root", spec)


# -- versions
@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Firecracker v1.10.1\n\nSupported snapshot data format versions: 4.0.0", (1, 10, 1)),
        ("Jailer v1.8.0", (1, 8, 0)),
        ("firecracker 1.10", None),
        ("", None),
        ("Firecracker v1.99999.0", None),
    ],
)
def test_parse_version(text: str, want: tuple[int, int, int] | None) -> None:
    assert parse_version(text) == want


def test_check_versions() -> None:
    assert check_versions("Firecracker v1.10.1", "Jailer v1.10.1") == (1, 10, 1)
    assert check_versions("Firecracker v1.8.0", "Jailer v1.8.0") == MIN_VERSION
    with pytest.raises(UnsupportedError, match=r"v1\.7\.0 is too old: v1\.8\.0") as ei:
        check_versions("Firecracker v1.7.0", "Jailer v1.7.0")
    assert "ACPI" in str(ei.value)
    with pytest.raises(UnsupportedError, match="does not match"):
        check_versions("Firecracker v1.10.1", "Jailer v1.9.0")
    with pytest.raises(UnsupportedError, match="cannot read a version"):
        check_versions("Segmentation fault", "Jailer v1.10.1")


# -- the backend's refusals, with stand-in binaries that only answer --version
def _install(
    tmp_path: Path, version: str, *, name: str = "firecracker", jailer: bool = True
) -> Path:
    d = tmp_path / "bin"
    d.mkdir(parents=True, exist_ok=True)
    fc = d / name
    fc.write_text(f"#!/bin/sh\necho 'Firecracker v{version}'\n")
    fc.chmod(0o755)
    if jailer:
        jl = d / "jailer"
        jl.write_text(f"#!/bin/sh\necho 'Jailer v{version}'\n")
        jl.chmod(0o755)
    return fc


def _settings(fc: Path | None) -> Settings:
    # The real cache dir: the KVM verdict and the kernel are cached there already.
    return Settings(cache_dir=Settings().cache_dir, firecracker_binary=fc)


def test_refusals_name_the_fix(tmp_path: Path) -> None:
    spec = SandboxSpec(name="fc", image="default")
    cases = [
        (None, "AGENTBOX_FIRECRACKER_BINARY"),
        (tmp_path / "nope" / "firecracker", "not executable"),
        (_install(tmp_path / "a", "1.10.1", jailer=False), "no jailer"),
        (_install(tmp_path / "b", "1.10.1", name="fc-bin"), "named \\*firecracker\\*"),
        (_install(tmp_path / "c", "1.7.1"), r"v1\.8\.0 or later"),
    ]
    for fc, match in cases:
        with pytest.raises(UnsupportedError, match=match):
            FirecrackerBackend(_settings(fc)).check(spec)
        fac = facility(_settings(fc))
        assert not fac.ok and fac.fix


def test_a_recent_binary_still_needs_a_kvm_that_boots_the_guest(tmp_path: Path) -> None:
    from agentbox.backends.microvm.kvm import probe_kvm

    settings = _settings(_install(tmp_path, "1.10.1"))
    assert firecracker_binaries(settings)[0].name == "firecracker"
    kvm = probe_kvm(settings)
    if kvm.ok:
        pytest.skip("this host's KVM boots the guest: the refusal cannot be shown here")
    with pytest.raises(UnsupportedError, match="Firecracker needs KVM") as ei:
        FirecrackerBackend(settings).check(SandboxSpec(name="fc", image="default"))
    assert ei.value.fix == kvm.fix
    fac = facility(settings)
    assert not fac.ok and "v1.10.1" in fac.detail and "KVM" in fac.detail


def test_declared_mounts_are_checked_as_in_qemu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentbox.backends.microvm.firecracker import _backend as mod
    from agentbox.core import host as _host

    if os.geteuid() != 0:
        pytest.skip("the jailer must run as root: check() refuses first")
    settings = _settings(_install(tmp_path, "1.10.1"))
    monkeypatch.setattr(mod, "probe_kvm", lambda s: _host.Facility("kvm", True, "test"))
    rootfs = tmp_path / "rootfs"
    (rootfs / "srv").mkdir(parents=True)
    backend = FirecrackerBackend(settings, rootfs=(rootfs, "hash"))
    src = tmp_path / "tools"
    src.mkdir()
    for target in ("/srv", "/home/agent/tools"):  # in the image; on the guest's tmpfs
        backend.check(SandboxSpec(name="fc", image="x", mounts=(BindMount(src, target),)))
    spec = SandboxSpec(name="fc", image="x", mounts=(BindMount(src, "/opt/x"),))
    with pytest.raises(UnsupportedError, match="mount target /opt/x"):
        backend.check(spec)


def test_mount_disks_are_read_only_drives_and_root_owned_in_the_jail(tmp_path: Path) -> None:
    spec = _spec(tmp_path, mounts=2)
    drives = {d["drive_id"]: d for d in vm_config(spec)["drives"]}
    for i in range(2):
        assert drives[f"m{i}"]["path_on_host"] == f"/m{i}.img"
        assert drives[f"m{i}"]["is_read_only"] is True
        assert drives[f"m{i}"]["is_root_device"] is False
    chroot = chroot_dir(tmp_path / "jail", Path("/opt/firecracker"), spec.id)
    placed = place_files(chroot, spec)
    assert set(placed) == set(JAIL_FILES) | {"m0.img", "m1.img"}
    for i in range(2):
        st = (chroot / f"m{i}.img").stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o444)
        assert (chroot / f"m{i}.img").read_bytes() == spec.mount_disks[i].read_bytes()


def test_the_vmm_never_runs_as_root() -> None:
    s = Settings()
    assert fc_uid(s, "strict") == vmm_uid(s, "strict") != 0
    assert fc_uid(s, "standard") != 0
    if os.getuid() != 0:
        assert fc_uid(s, "standard") == os.getuid()


def test_vm_ids_suit_the_jailer() -> None:
    ids = {_vm_id("task-" + "x" * 80), _vm_id("a_b.c/d"), _vm_id("")}
    for i in ids:
        assert 1 <= len(i) <= 64
        assert all(c.isascii() and (c.isalnum() or c == "-") for c in i)
    assert len({_vm_id("same") for _ in range(20)}) == 20


_SPAWNER = """
import sys, time
from agentbox.backends.microvm._jail import spawn
proc = spawn(sys.argv[1:], cgroup=None)
time.sleep(300)
"""


@pytest.mark.parametrize("holder", [True, False], ids=["with-holder", "control-without"])
def test_a_dead_host_side_takes_the_setuid_vmm_with_it(tmp_path: Path, holder: bool) -> None:
    """SIGKILL the process that started the VMM: a VMM that switched uid must die too.

    A real uid switch (``setpriv``, as the jailer does) stands in for the jailer and
    Firecracker; the control without the holder shows the switch really does
    clear the parent-death signal, so the test can tell the two apart.
    """
    if os.geteuid() != 0:
        pytest.skip("unshare --pid needs root")
    argv = jailer_argv(
        Path("/j/jailer"), Path("/j/firecracker"), _spec_min(), chroot_base=Path("/")
    )
    prefix = argv[: argv.index("--") + 1 + (len(HOLDER) if holder else 0)]
    marker = ["sleep", f"299.{os.getpid()}{int(holder)}"]  # unique among processes
    vmm = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", *marker]
    spawner = subprocess.Popen([sys.executable, "-c", _SPAWNER, *prefix, *vmm])

    def vmm_pids() -> list[int]:
        return [p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == marker]

    try:
        deadline = time.monotonic() + 30
        while not vmm_pids():
            assert time.monotonic() < deadline, "the stand-in VMM never started"
            time.sleep(0.05)
        assert psutil.Process(vmm_pids()[0]).uids().real == 65534
        spawner.kill()
        spawner.wait(10)
        deadline = time.monotonic() + (10 if holder else 3)
        while vmm_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        if holder:
            assert vmm_pids() == [], "the VMM outlived the process that started it"
        else:
            assert vmm_pids(), "control: without the holder the uid switch keeps it alive"
    finally:
        spawner.kill()
        for pid in vmm_pids():
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
