"""The resource sampler's parsers and file handling (pure: fixture text, tmp dirs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from agentbox.observe.resources import (
    Cgroup,
    Sampler,
    Usage,
    VmProcess,
    conmon_child,
    conmon_cid,
    conmon_name,
    final_resources,
    mount_source,
    parse_int,
    parse_io_written,
    parse_keyed,
    parse_proc_cgroup,
    parse_sectors_written,
    parse_status_kb,
    read_resources,
    resources_words,
    write_resources,
    written_by,
)

V1_PROC_CGROUP = """\
12:pids:/libpod_parent/libpod-abc
11:cpu,cpuacct:/libpod_parent/libpod-abc
9:memory:/libpod_parent/libpod-abc
1:name=systemd:/libpod_parent/libpod-abc
0::/libpod_parent/libpod-abc
"""

V2_PROC_CGROUP = "0::/machine.slice/libpod-abc.scope/container\n"

CPU_STAT_V2 = """\
usage_usec 3210000
user_usec 3000000
system_usec 210000
nr_periods 0
"""

MEMORY_STAT_V1 = """\
cache 52428800
rss 104857600
total_cache 52428800
total_rss 110000000
"""

BLOCK_STAT = (
    "   21408      582   156347    12539    75570   106481 177405205   112290        0"
    "    75184   174525        0        0        0        0    16295    49695\n"
)

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
98 22 7:3 / /var/lib/agentbox/tasks/t1/workspace rw,nosuid,nodev - ext4 /dev/loop3 rw
99 22 7:4 / /var/lib/agentbox/tasks/t\\0402/workspace rw - ext4 /dev/loop4 rw
100 98 0:50 / /var/lib/agentbox/tasks/t1/workspace rw - tmpfs evil rw
"""


def test_parse_int_takes_one_counter_and_refuses_the_rest() -> None:
    assert parse_int("104857600\n") == 104857600
    assert parse_int("max\n") is None
    assert parse_int("-1") is None
    assert parse_int("12 13") is None
    assert parse_int("") is None
    assert parse_int("9" * 40) is None


def test_parse_keyed_reads_stat_files_and_skips_junk() -> None:
    assert parse_keyed(CPU_STAT_V2)["usage_usec"] == 3210000
    got = parse_keyed(MEMORY_STAT_V1 + "garbage line here\nrss -5\n")
    assert got["total_rss"] == 110000000 and got["rss"] == 104857600


def test_proc_cgroup_v1_gives_each_controller_v2_the_unified_one() -> None:
    v1 = parse_proc_cgroup(V1_PROC_CGROUP)
    assert v1["cpuacct"] == v1["cpu"] == v1["memory"] == v1["pids"] == "/libpod_parent/libpod-abc"
    assert v1["0"] == "/libpod_parent/libpod-abc"
    assert parse_proc_cgroup(V2_PROC_CGROUP) == {"0": "/machine.slice/libpod-abc.scope/container"}
    assert parse_proc_cgroup("nonsense\n3:cpu:relative\n") == {}


def test_cgroup_dirs_from_paths(tmp_path: Path) -> None:
    cg = Cgroup.from_paths(parse_proc_cgroup(V1_PROC_CGROUP), tmp_path)
    assert cg is not None and not cg.v2
    assert cg.cpu == tmp_path / "cpuacct/libpod_parent/libpod-abc"
    assert cg.memory == tmp_path / "memory/libpod_parent/libpod-abc"
    assert cg.pids == tmp_path / "pids/libpod_parent/libpod-abc"
    # a path that climbs out of the hierarchy is not followed
    climbing = Cgroup.from_paths({"memory": "/../../etc"}, tmp_path)
    assert climbing is None
    (tmp_path / "machine.slice/x").mkdir(parents=True)
    (tmp_path / "machine.slice/x/cgroup.controllers").write_text("cpu memory pids\n")
    v2 = Cgroup.from_paths({"0": "/machine.slice/x"}, tmp_path)
    assert v2 is not None and v2.v2 and v2.cpu == tmp_path / "machine.slice/x"


def test_cgroup_v1_files_read_as_figures(tmp_path: Path) -> None:
    cg = Cgroup.from_paths(parse_proc_cgroup(V1_PROC_CGROUP), tmp_path)
    assert cg is not None and cg.cpu and cg.memory and cg.pids
    for d in (cg.cpu, cg.memory, cg.pids):
        d.mkdir(parents=True)
    assert cg.cpu_ns() is None and cg.memory_peak() is None  # not there (yet, or any more)
    (cg.cpu / "cpuacct.usage").write_text("3500000000\n")
    (cg.memory / "memory.max_usage_in_bytes").write_text("157286400\n")
    (cg.memory / "memory.stat").write_text(MEMORY_STAT_V1)
    (cg.pids / "cgroup.procs").write_text("1\n7\n12\n")
    (cg.pids / "pids.current").write_text("9\n")
    assert cg.cpu_ns() == 3_500_000_000
    assert cg.memory_peak() == 157286400 and cg.memory_anon() == 110000000
    assert cg.processes() == {1, 7, 12}
    assert cg.tasks_peak() == 9
    (cg.pids / "pids.peak").write_text("14\n")
    assert cg.tasks_peak() == 14  # the kernel's own peak where it keeps one
    # a link planted where a counter file is expected is not followed
    (cg.cpu / "cpuacct.usage").unlink()
    (cg.cpu / "cpuacct.usage").symlink_to(cg.memory / "memory.max_usage_in_bytes")
    assert cg.cpu_ns() is None


def test_cgroup_v2_files(tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir()
    (d / "cgroup.controllers").write_text("cpu memory pids\n")
    (d / "cpu.stat").write_text(CPU_STAT_V2)
    (d / "memory.peak").write_text("200000000\n")
    (d / "memory.stat").write_text("anon 120000000\nfile 5\n")
    cg = Cgroup.from_paths({"0": "/s"}, tmp_path)
    assert cg is not None
    assert cg.cpu_ns() == 3_210_000_000
    assert cg.memory_peak() == 200000000 and cg.memory_anon() == 120000000


def test_block_stat_field_7_is_sectors_written() -> None:
    assert parse_sectors_written(BLOCK_STAT) == 177405205
    assert parse_sectors_written("1 2 3") is None
    assert parse_sectors_written("1 2 3 4 5 6 x") is None


def test_mount_source_is_the_mount_on_top() -> None:
    ws = "/var/lib/agentbox/tasks/t1/workspace"
    assert mount_source(MOUNTINFO, ws) == "evil"  # the last mount there is the one seen
    assert mount_source(MOUNTINFO, "/var/lib/agentbox/tasks/t 2/workspace") == "/dev/loop4"
    assert mount_source(MOUNTINFO, "/nowhere") is None


def test_sampler_without_a_sandbox_samples_nothing_and_writes_the_file(tmp_path: Path) -> None:
    s = Sampler(tmp_path, "fake", "agentbox-nothing", tmp_path / "workspace").start()
    used = s.stop()
    assert used.cpu_s is None and used.samples == 0 and used.live is False
    assert read_resources(tmp_path) == used.as_json()


def test_a_readopting_sampler_starts_from_the_dead_launchers_figures(tmp_path: Path) -> None:
    write_resources(
        tmp_path,
        {
            "cpu_s": 2.5,
            "memory_peak_bytes": 100,
            "disk_written_bytes": 4096,
            "disk_device_written_bytes": 8192,
            "live": True,
        },
    )
    s = Sampler(tmp_path, "fake", "x", tmp_path / "workspace").start()
    used = s.stop()
    assert used.cpu_s == 2.5 and used.memory_peak_bytes == 100
    assert used.disk_written_bytes == 4096 and used.disk_device_written_bytes == 8192
    assert used.notes


def test_final_resources_adds_egress_from_the_reports_summaries(tmp_path: Path) -> None:
    write_resources(tmp_path, {"cpu_s": 1.0, "live": True})
    report = {
        "egress": {"bytes_up": 100, "bytes_down": 900},
        "setup": {"egress": {"bytes_up": 5, "bytes_down": True}},  # a bool is no count
    }
    got = final_resources(tmp_path, report)
    assert got["egress_bytes"] == 1005 and got["live"] is False and got["cpu_s"] == 1.0
    assert json.loads((tmp_path / "resources.json").read_text()) == got
    none = final_resources(tmp_path / "missing", {})
    assert none["egress_bytes"] == 0 and none["cpu_s"] is None


def test_resources_file_read_defensively(tmp_path: Path) -> None:
    (tmp_path / "resources.json").write_text("[1, 2]")
    assert read_resources(tmp_path) is None
    (tmp_path / "resources.json").write_text("{not json")
    assert read_resources(tmp_path) is None


def test_resources_words() -> None:
    words = resources_words(
        {
            "cpu_s": 3.21,
            "memory_peak_bytes": 157_286_400,
            "disk_written_bytes": 52_428_800,
            "disk_peak_bytes": 60_000_000,
            "processes_peak": 4,
            "egress_bytes": 0,
            "live": True,
        }
    )
    assert words == (
        "cpu 3.2 s · memory peak 157.3 MB · disk written 52.4 MB (used at most 60.0 MB) · "
        "processes at once 4 · egress 0 B (live)"
    )
    assert resources_words({}) is None and resources_words(None) is None


def test_status_kb_fields() -> None:
    status = "Name:\tqemu-system-x86\nVmPeak:\t 2000 kB\nVmHWM:\t  153600 kB\nVmRSS:\t 1 kB\n"
    assert parse_status_kb(status, "VmHWM") == 153600 * 1024
    assert parse_status_kb(status, "VmSwap") is None
    assert parse_status_kb("VmHWM:\tlots kB\n", "VmHWM") is None


def test_a_vm_process_is_sampled_by_its_own_figures(tmp_path: Path) -> None:
    me = psutil.Process()
    vm = VmProcess(me.pid, me.create_time())
    used = Usage()
    sum(i * i for i in range(200_000))  # some CPU of its own
    assert vm.sample(used)
    assert used.cpu_s is not None and used.cpu_s > 0
    assert used.memory_peak_bytes is not None and used.memory_peak_bytes > 1_000_000
    assert used.disk_written_bytes is not None and used.samples == 1
    # a pid whose start time is not the recorded one (reused) is not sampled
    assert not VmProcess(me.pid, me.create_time() - 100).sample(Usage())
    # the record must name a live QEMU: this process is none
    (tmp_path / "microvm-detached").mkdir()
    record = {"vm": ["vm-x", me.pid, me.create_time()]}
    (tmp_path / "microvm-detached" / "agentbox-x.json").write_text(json.dumps(record))
    assert VmProcess.of_record(tmp_path, "agentbox-x", "qemu") is None
    got = VmProcess.of_record(tmp_path, "agentbox-x")  # no VMM name to check: pid and start
    assert got is not None and got.pid == me.pid
    (tmp_path / "microvm-detached" / "agentbox-y.json").write_text('{"vm": "junk"}')
    assert VmProcess.of_record(tmp_path, "agentbox-y") is None
    assert VmProcess.of_record(tmp_path, "agentbox-none") is None


PROC_IO = """\
rchar: 6976
wchar: 52428800
syscr: 10
syscw: 50
read_bytes: 0
write_bytes: 52428800
cancelled_write_bytes: 4096
"""


def test_proc_io_write_bytes(tmp_path: Path) -> None:
    assert parse_io_written(PROC_IO) == 52428800
    assert parse_io_written("write_bytes: lots\n") is None
    assert parse_io_written("") is None
    # the live processes' figures are summed; a pid that is gone counts nothing
    mine = parse_io_written(Path("/proc/self/io").read_text()) or 0
    assert written_by({os.getpid(), 999_999_999}) >= mine


def test_conmon_name_forms() -> None:
    assert conmon_name(["conmon", "--api-version", "1", "-n", "box-a", "-c", "x"]) == "box-a"
    assert conmon_name(["conmon", "--name", "box-b"]) == "box-b"
    assert conmon_name(["conmon", "--name=box-c"]) == "box-c"
    assert conmon_name(["conmon", "-c", "x"]) is None
    assert conmon_name(["conmon", "-n"]) is None


def _fake_proc(root: Path, pid: int, *, comm: str, argv: list[str], exe: Path, cgroup: str,
               children: str = "") -> None:  # fmt: skip
    base = root / str(pid)
    (base / "task" / str(pid)).mkdir(parents=True)
    (base / "comm").write_text(comm + "\n")
    (base / "cmdline").write_text("\0".join(argv) + "\0")
    (base / "cgroup").write_text(cgroup)
    (base / "task" / str(pid) / "children").write_text(children)
    (base / "exe").symlink_to(exe)


def test_conmon_child_is_the_init_of_that_containers_root_conmon(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    bins = tmp_path / "bin"
    bins.mkdir()
    conmon = bins / "conmon"
    conmon.write_bytes(b"\x7fELF")
    conmon.chmod(0o755)
    argv = ["/usr/bin/conmon", "-c", "abc", "-n", "box-a", "-r", "/usr/sbin/runc"]
    _fake_proc(proc, 100, comm="conmon", argv=argv, exe=conmon, cgroup="4:memory:/\n",
               children="101 ")  # fmt: skip
    # The runtime still creating the init: conmon's own cgroup, not the container's yet.
    _fake_proc(proc, 101, comm="runc", argv=["runc"], exe=conmon, cgroup="4:memory:/\n")
    me = os.geteuid()  # root's conmon on a host; here, files this user owns stand in
    assert conmon_child("box-a", proc, owner=me) is None
    (proc / "101" / "cgroup").write_text("4:memory:/libpod_parent/libpod-abc\n")
    assert conmon_child("box-a", proc, owner=me) == 101
    assert conmon_child("box-b", proc, owner=me) is None  # another container's name
    # Not the owner's (a sandbox's process named conmon runs as a mapped uid), or its
    # binary writable by others: not podman's conmon.
    assert conmon_child("box-a", proc, owner=me + 1) is None
    conmon.chmod(0o777)
    assert conmon_child("box-a", proc, owner=me) is None


def test_conmon_cid_forms() -> None:
    assert conmon_cid(["conmon", "--api-version", "1", "-c", "abc", "-n", "box"]) == "abc"
    assert conmon_cid(["conmon", "--cid", "def"]) == "def"
    assert conmon_cid(["conmon", "--cid=0a1"]) == "0a1"
    assert conmon_cid(["conmon", "-n", "box"]) is None
    assert conmon_cid(["conmon", "-c"]) is None


def test_a_claimed_pool_sandbox_is_found_by_its_id_without_podman(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool sandbox's conmon keeps the slot name it was started under; claimed, it was
    renamed to the task's sandbox name: its init is found through the container id its
    claim record names, in /proc, and no ``podman inspect`` runs."""
    from agentbox.core import proc as _proc
    from agentbox.observe import resources

    cid = "ab" * 32
    proc, bins = tmp_path / "proc", tmp_path / "bin"
    bins.mkdir()
    conmon = bins / "conmon"
    conmon.write_bytes(b"\x7fELF")
    conmon.chmod(0o755)
    argv = ["/usr/bin/conmon", "-c", cid, "-u", cid, "-n", "agentbox-pool-3", "-r", "runc"]
    _fake_proc(proc, 100, comm="conmon", argv=argv, exe=conmon, cgroup="0::/machine.slice\n",
               children="101 ")  # fmt: skip
    _fake_proc(proc, 101, comm="tini", argv=["tini"], exe=conmon, cgroup="0::/libpod-ab\n")
    me = os.geteuid()
    real = resources.conmon_child
    monkeypatch.setattr(
        resources,
        "conmon_child",
        lambda name, *, cid=None: real(name, proc, owner=me, cid=cid),
    )
    found: list[int] = []
    monkeypatch.setattr(resources.Cgroup, "of_pid", classmethod(lambda cls, pid: found.append(pid)))

    def no_podman(*_: object, **__: object) -> None:
        raise AssertionError("podman inspect was run")

    monkeypatch.setattr(_proc, "run", no_podman)
    data = tmp_path / "data"
    task_root = data / "tasks" / "t-1"
    task_root.mkdir(parents=True)
    claims = data / "pool" / "claims"
    claims.mkdir(parents=True)
    record = claims / "agentbox-t-1.json"
    record.write_text(json.dumps({"id": cid, "slot": "agentbox-pool-3"}))
    record.chmod(0o600)
    sampler = resources.Sampler(task_root, "podman", "agentbox-t-1", task_root / "workspace")
    sampler._find()
    assert found == [101]
    # No record (not a claimed sandbox): not found in /proc, then the engine is asked.
    record.unlink()
    with pytest.raises(AssertionError, match="podman inspect was run"):
        sampler._find()
