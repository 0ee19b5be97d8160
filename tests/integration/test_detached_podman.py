"""Detached podman sandboxes (issue 19 item 2, issue 15 item 1): real podman, conmon, git-free.

* launched from a child process that is then SIGKILLed together with the
  (emulated) service unit's whole cgroup, the sandbox runs on, and *this*
  process follows it to the end: the whole output, in order, stdout and stderr
  apart, the exit code, the workspace written back, and nothing left (container,
  conmon, disk, mount, log handle);
* its deadline holds with nobody following (conmon's ``--timeout``), and a
  follower that comes later reports ``timed_out``;
* ``adoptable`` refuses a hand-made container with our labels, another data
  dir's sandbox, and a name that does not exist;
* hostile output comes back byte for byte (a 10 MB line, invalid UTF-8, forged
  k8s-file prefixes); at the log cap only the last part is kept;
* one case on runsc.

Every sandbox a test launches is named in its ``cleanup`` list, which registers it
with the leak guard (``sandbox_factory``): after the test no process naming it,
container, cgroup, socket or env fd may remain, on top of this module's own checks
(log holders, disk files, mounts).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from agentbox.backends import Exited
from agentbox.backends.base import LABEL, OWNER_DATA_LABEL, SandboxSpec, data_dir_label
from agentbox.backends.podman import PodmanBackend
from agentbox.backends.podman import _detach as detach
from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.errors import SandboxError, SandboxGone
from mount_helpers import assert_no_mounts_under
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(os.geteuid() != 0, reason="workspace disks and cgroups need root"),
]

#: The hierarchies systemd tracks a unit by on a hybrid host (a restart kills what is in them).
UNIT_HIERARCHIES = [h for h in ("systemd", "unified") if Path(f"/sys/fs/cgroup/{h}").is_dir()]


def _spec(settings: Settings, image: str, ws: Path | None, name: str, **kw: object) -> SandboxSpec:
    return SandboxSpec(name=name, image=image, workspace=ws, **kw)  # type: ignore[arg-type]


def _follow(backend: PodmanBackend, name: str, log: Path) -> tuple[Exited, bytes, bytes]:
    out: list[bytes] = []
    err: list[bytes] = []
    ended = backend.follow(name, log=log, on_stdout=out.append, on_stderr=err.append, poll=0.05)
    return ended, b"".join(out), b"".join(err)


def _leftovers(settings: Settings, name: str, ws: Path | None, log: Path) -> list[str]:
    left = []
    if subprocess.run(["podman", "container", "exists", name], check=False).returncode == 0:
        left.append("the container")
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "conmon" in " ".join(cmd[:1]) and name in cmd:
            left.append(f"conmon {p.pid}")
        with contextlib.suppress(psutil.Error):
            if any(f.path == str(log) for f in p.open_files()):
                left.append(f"process {p.pid} holds the log")
    disks = settings.data_dir / "disks"
    if disks.is_dir():
        left += [f"disk file {f.name}" for f in disks.iterdir() if f.name.startswith(name)]
    if ws is not None and os.path.ismount(ws):
        left.append("the workspace disk is mounted")
    return left


def _assert_clean(settings: Settings, name: str, ws: Path | None, log: Path) -> None:
    end = time.monotonic() + 10
    while (left := _leftovers(settings, name, ws, log)) and time.monotonic() < end:
        time.sleep(0.2)
    assert not left, left


@pytest.fixture(autouse=True)
def _no_mount_left(sandbox_settings: Settings) -> Iterator[None]:
    """After each test no mount remains under its data dir (workspace disk, settle)."""
    yield
    assert_no_mounts_under(sandbox_settings.data_dir)


class _Tracked(list[str]):
    """Names to reap, each registered with the leak guard as it is added."""

    def __init__(self, tracker: SandboxTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def append(self, name: str) -> None:
        self.tracker.track(name)
        super().append(name)


@pytest.fixture
def cleanup(
    sandbox_settings: Settings,
    sandbox_factory: Callable[[PodmanBackend, Settings], SandboxTracker],
) -> Iterator[list[str]]:
    """Names to reap whatever the test's outcome; the guard checks them after the reap."""
    backend = PodmanBackend(sandbox_settings)
    names = _Tracked(sandbox_factory(backend, sandbox_settings))
    yield names
    for name in names:
        with contextlib.suppress(Exception):
            backend.reap(name)


@pytest.fixture
def unit_cgroup() -> Iterator[str]:
    """An emulated service unit: a cgroup in the hierarchies systemd tracks units by."""
    if not UNIT_HIERARCHIES:
        pytest.skip("no name=systemd or unified cgroup hierarchy to emulate a unit in")
    name = f"agentbox-test-unit-{os.getpid()}"
    for h in UNIT_HIERARCHIES:
        (Path("/sys/fs/cgroup") / h / name).mkdir()
    yield name
    for h in UNIT_HIERARCHIES:
        d = Path("/sys/fs/cgroup") / h / name
        with contextlib.suppress(OSError):  # a test that failed early left its launcher
            for pid in (d / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for _ in range(50):
            with contextlib.suppress(OSError):
                d.rmdir()
                break
            time.sleep(0.1)


_LAUNCHER = """
import json, os, signal, sys
from pathlib import Path
from agentbox.backends.base import SandboxSpec
from agentbox.backends.podman import PodmanBackend
from agentbox.config import Settings
a = json.loads(sys.argv[1])
for h in a["unit_hierarchies"]:
    Path(f"/sys/fs/cgroup/{h}/{a['unit']}/cgroup.procs").write_text(str(os.getpid()))
settings = Settings(data_dir=Path(a["data_dir"]), repos_root=Path(a["repos_root"]),
                    mount_roots=tuple(Path(p) for p in a["mount_roots"]))
if a.get("no_second_line"):  # only what launch does before conmon exists
    import agentbox.backends.podman._detach as d
    d.place_conmon = lambda pid: []
spec = SandboxSpec(name=a["name"], image=a["image"], workspace=Path(a["ws"]), deadline=120)
PodmanBackend(settings).launch(spec, a["argv"], log=Path(a["log"]))
print("launched", flush=True)
signal.pause()  # the launcher lives on until it is killed
"""


_FOLLOWER = """
import json, sys
from pathlib import Path
from agentbox.backends.podman import PodmanBackend
from agentbox.config import Settings
a = json.loads(sys.argv[1])
settings = Settings(data_dir=Path(a["data_dir"]), repos_root=Path(a["repos_root"]),
                    mount_roots=tuple(Path(p) for p in a["mount_roots"]))
def out(b):
    sys.stdout.buffer.write(b)
    sys.stdout.flush()
PodmanBackend(settings).follow(a["name"], log=Path(a["log"]), on_stdout=out, on_stderr=None)
"""


def test_a_sandbox_outlives_its_launcher_and_its_unit_and_is_followed_elsewhere(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    unit_cgroup: str,
    cleanup: list[str],
) -> None:
    ws = make_workspace()
    name = f"det-{os.getpid()}"
    cleanup.append(name)
    log = sandbox_settings.data_dir / "sandbox.log"
    script = (
        "for i in 1 2 3 4 5 6 7 8; do echo tick $i; echo $i >> /workspace/progress; "
        "sleep 0.4; done; echo bye >&2; exit 5"
    )
    args = {
        "data_dir": str(sandbox_settings.data_dir),
        "repos_root": str(sandbox_settings.repos_root),
        "mount_roots": [str(p) for p in sandbox_settings.mount_roots],
        "name": name,
        "image": default_image,
        "ws": str(ws),
        "log": str(log),
        "argv": ["sh", "-c", script],
        "unit": unit_cgroup,
        "unit_hierarchies": UNIT_HIERARCHIES,
    }
    child = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, json.dumps(args)], stdout=subprocess.PIPE
    )
    assert child.stdout is not None
    assert child.stdout.readline() == b"launched\n", "the launcher child failed"
    info = detach.inspect(name)
    assert info is not None
    conmon = detach.conmon_of(info)
    assert conmon is not None
    # conmon is nothing of the launcher's: not its child, group, session or unit cgroup.
    assert conmon.ppid() == 1
    assert os.getsid(conmon.pid) != os.getsid(child.pid)
    assert os.getpgid(conmon.pid) != os.getpgid(child.pid)
    for h in UNIT_HIERARCHIES:
        procs = (Path("/sys/fs/cgroup") / h / unit_cgroup / "cgroup.procs").read_text().split()
        assert str(conmon.pid) not in procs, f"conmon is in the unit's {h} cgroup"
    # `systemctl restart` of the unit: every process in its cgroup is SIGKILLed.
    for h in UNIT_HIERARCHIES:
        for pid in (Path("/sys/fs/cgroup") / h / unit_cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    child.wait(10)
    child.stdout.close()
    # The sandbox runs on with no launcher: its progress keeps growing.
    progress = ws / "progress"
    end = time.monotonic() + 30
    while (
        time.monotonic() < end
        and len(progress.read_text().split() if progress.exists() else []) < 3
    ):
        time.sleep(0.1)
    assert len(progress.read_text().split()) >= 3

    # A first new launcher starts following, and is SIGKILLed mid-follow.
    follower = subprocess.Popen(
        [sys.executable, "-c", _FOLLOWER, json.dumps(args)], stdout=subprocess.PIPE
    )
    assert follower.stdout is not None
    assert follower.stdout.readline().startswith(b"tick 1")
    follower.kill()
    follower.wait(10)
    follower.stdout.close()

    backend = PodmanBackend(sandbox_settings)  # the next launcher, in another process
    assert backend.adoptable(name, labels={LABEL: "1"})
    ended, out, err = _follow(backend, name, log)
    assert ended == Exited(5, False)
    assert out == b"".join(b"tick %d\n" % i for i in range(1, 9))
    assert err == b"bye\n"
    assert progress.read_text().split() == [str(i) for i in range(1, 9)]  # copied back
    _assert_clean(sandbox_settings, name, ws, log)
    # A follower after the end (the first died before returning) replays the same end.
    assert _follow(backend, name, log) == (ended, out, err)


def test_the_deadline_holds_with_nobody_following(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    cleanup: list[str],
) -> None:
    ws = make_workspace()
    name = f"det-dl-{os.getpid()}"
    cleanup.append(name)
    log = sandbox_settings.data_dir / "deadline.log"
    backend = PodmanBackend(sandbox_settings)
    spec = _spec(sandbox_settings, default_image, ws, name, deadline=1.0)
    backend.launch(spec, ["sh", "-c", "echo started; exec sleep 600"], log=log)
    info = detach.inspect(name)
    conmon = detach.conmon_of(info or {})
    assert conmon is not None
    # Nobody follows: conmon's own --timeout (deadline + grace) kills it.
    conmon.wait(60)
    state = (detach.inspect(name) or {}).get("State", {})
    assert state.get("Running") is False  # conmon's timeout leaves ExitCode -1
    ended, out, _ = _follow(PodmanBackend(sandbox_settings), name, log)
    assert ended == Exited(137, True)
    assert out == b"started\n"
    _assert_clean(sandbox_settings, name, ws, log)


def test_adoptable_refuses_what_is_not_ours(
    sandbox_settings: Settings,
    settings_factory: Callable[[], Settings],
    default_image: str,
    cleanup: list[str],
) -> None:
    backend = PodmanBackend(sandbox_settings)
    assert not backend.adoptable("det-no-such-sandbox", labels={})
    with pytest.raises(SandboxGone):
        backend.follow(
            "det-no-such-sandbox",
            log=sandbox_settings.data_dir / "none.log",
            on_stdout=None,
            on_stderr=None,
        )
    # Another data dir's sandbox, same name, same labels: refused.
    other = settings_factory()
    name = f"det-other-{os.getpid()}"
    cleanup.append(name)
    other_log = other.data_dir / "other.log"
    PodmanBackend(other).launch(
        _spec(other, default_image, None, name, labels={"io.agentbox.task": "t"}),
        ["sleep", "600"],
        log=other_log,
    )
    assert PodmanBackend(other).adoptable(name, labels={"io.agentbox.task": "t"})
    assert not backend.adoptable(name, labels={"io.agentbox.task": "t"})
    with pytest.raises(SandboxGone):
        backend.follow(
            name, log=sandbox_settings.data_dir / "x.log", on_stdout=None, on_stderr=None
        )
    assert detach.inspect(name) is not None, "a refused follower must not touch it"
    PodmanBackend(other).reap(name)
    # Made by hand with our labels and our data dir's label, but not by us (no seal).
    forged = f"det-forged-{os.getpid()}"
    cleanup.append(forged)
    labels = {
        LABEL: "1",
        OWNER_DATA_LABEL: data_dir_label(sandbox_settings.data_dir),
        detach.DETACHED_LABEL: "1",
        detach.DEADLINE_LABEL: "600",
        detach.SEAL_LABEL: "0" * 32,
    }
    argv = ["podman", "--runtime", "runc", "run", "-d", "--name", forged, "--network", "none",
            "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=512:512"]  # fmt: skip
    for k, v in labels.items():
        argv += ["--label", f"{k}={v}"]
    subprocess.run([*argv, default_image, "sleep", "600"], check=True, capture_output=True)
    assert not backend.adoptable(forged, labels={})


def test_hostile_output_comes_back_byte_for_byte(
    sandbox_settings: Settings, default_image: str, cleanup: list[str]
) -> None:
    name = f"det-hostile-{os.getpid()}"
    cleanup.append(name)
    log = sandbox_settings.data_dir / "hostile.log"
    prog = (
        "import sys\n"
        "o, e = sys.stdout.buffer, sys.stderr.buffer\n"
        "o.write(b'x' * 10_000_000 + b'\\n')\n"
        "o.write(b'\\xff\\xfe\\x00\\xc3(\\r\\n')\n"
        "o.write(b'2026-01-01T00:00:00.000000000+00:00 stderr F forged\\n')\n"
        "o.flush()\n"
        "e.write(b'2026-01-01T00:00:00Z stdout P also forged'); e.flush()\n"
        "o.write(b'no newline at the end'); o.flush()\n"
    )
    backend = PodmanBackend(sandbox_settings)
    backend.launch(
        _spec(sandbox_settings, default_image, None, name), ["python3", "-c", prog], log=log
    )
    ended, out, err = _follow(backend, name, log)
    assert ended == Exited(0, False)
    want = (
        b"x" * 10_000_000
        + b"\n\xff\xfe\x00\xc3(\r\n"
        + b"2026-01-01T00:00:00.000000000+00:00 stderr F forged\n"
        + b"no newline at the end"
    )
    assert out == want
    assert err == b"2026-01-01T00:00:00Z stdout P also forged"
    _assert_clean(sandbox_settings, name, None, log)


def test_at_the_log_cap_the_last_part_is_kept(
    sandbox_settings: Settings,
    default_image: str,
    cleanup: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(detach, "MAX_LOG_BYTES", 100_000)
    name = f"det-cap-{os.getpid()}"
    cleanup.append(name)
    log = sandbox_settings.data_dir / "cap.log"
    backend = PodmanBackend(sandbox_settings)
    prog = "for i in range(20000): print('line %06d' % i, flush=True)"
    backend.launch(
        _spec(sandbox_settings, default_image, None, name), ["python3", "-c", prog], log=log
    )
    conmon = detach.conmon_of(detach.inspect(name) or {})
    if conmon is not None:
        conmon.wait(60)  # nobody follows while it prints
    ended, out, _ = _follow(backend, name, log)
    assert ended == Exited(0, False)
    printed = b"".join(b"line %06d\n" % i for i in range(20000))
    assert out and len(out) < 100_000 < len(printed)
    assert printed.endswith(out) and out.startswith(b"line ")


@pytest.mark.skipif(not _host.podman_runtime("runsc").ok, reason="runsc unusable here")
def test_runsc_launch_and_follow(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    cleanup: list[str],
) -> None:
    ws = make_workspace()
    name = f"det-runsc-{os.getpid()}"
    cleanup.append(name)
    log = sandbox_settings.data_dir / "runsc.log"
    backend = PodmanBackend(sandbox_settings)
    spec = _spec(sandbox_settings, default_image, ws, name, runtime="runsc")
    script = "uname -r; echo done > /workspace/out.txt; echo oops >&2; exit 3"
    backend.launch(spec, ["sh", "-c", script], log=log)
    assert backend.adoptable(name, labels={})
    ended, out, err = _follow(backend, name, log)
    assert ended == Exited(3, False)
    assert out.strip() == b"4.4.0"  # gVisor's kernel, not the host's
    assert err == b"oops\n"
    assert (ws / "out.txt").read_text() == "done\n"
    _assert_clean(sandbox_settings, name, ws, log)


def test_a_cancel_kills_and_the_follower_still_reports_and_removes(
    sandbox_settings: Settings, default_image: str, cleanup: list[str]
) -> None:
    name = f"det-cancel-{os.getpid()}"
    cleanup.append(name)
    log = sandbox_settings.data_dir / "cancel.log"
    backend = PodmanBackend(sandbox_settings)
    backend.launch(
        _spec(sandbox_settings, default_image, None, name),
        ["sh", "-c", "echo up; exec sleep 600"],
        log=log,
    )
    # Launched twice (a confused caller): refused, and the first one is left untouched.
    with pytest.raises(SandboxError):
        backend.launch(_spec(sandbox_settings, default_image, None, name), ["true"], log=log)
    assert backend.adoptable(name, labels={})
    PodmanBackend(sandbox_settings).kill(name)  # a cancel, from any process
    ended, out, _ = _follow(backend, name, log)
    assert ended == Exited(137, False)
    assert out == b"up\n"
    _assert_clean(sandbox_settings, name, None, log)


def test_an_orphan_sweep_never_settles_the_disk_of_a_running_detached_sandbox(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    cleanup: list[str],
) -> None:
    """The launcher died between mounting the disk and handing it to conmon: its
    record names a dead owner, yet the container runs; a sweep must leave it be."""
    ws = make_workspace()
    name = f"det-sweep-{os.getpid()}"
    cleanup.append(name)
    log = sandbox_settings.data_dir / "sweep.log"
    backend = PodmanBackend(sandbox_settings)
    script = "sleep 2; echo late > /workspace/late.txt"
    backend.launch(_spec(sandbox_settings, default_image, ws, name), ["sh", "-c", script], log=log)
    record = sandbox_settings.data_dir / "disks" / f"{name}.json"
    dead = subprocess.Popen(["true"])
    dead.wait()
    rec = json.loads(record.read_text())
    record.write_text(json.dumps({**rec, "pid": dead.pid, "start": "1"}))
    assert name not in backend.cleanup_orphans()
    assert os.path.ismount(ws), "the sweep settled the disk under a running sandbox"
    assert _follow(backend, name, log)[0] == Exited(0, False)
    assert (ws / "late.txt").read_text() == "late\n"
    _assert_clean(sandbox_settings, name, ws, log)


def test_a_launched_sandbox_has_the_posture_of_any_other(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    cleanup: list[str],
) -> None:
    """Same hardening as run/create: the posture checks (inside probes and the host's
    view) pass on a detached sandbox."""
    from agentbox.backends.podman import PodmanSandbox

    ws = make_workspace()
    name = f"det-posture-{os.getpid()}"
    cleanup.append(name)
    log = sandbox_settings.data_dir / "posture.log"
    backend = PodmanBackend(sandbox_settings)
    spec = _spec(sandbox_settings, default_image, ws, name)
    backend.launch(spec, ["sleep", "600"], log=log)
    posture = PodmanSandbox(backend, spec, name).posture()
    assert posture.ok, [c for c in posture.checks if not c.ok]
    backend.kill(name)
    assert _follow(backend, name, log)[0] == Exited(137, False)
    _assert_clean(sandbox_settings, name, ws, log)
    # Positive control: a deliberately weakened detached sandbox is seen as such.
    weak = PodmanBackend(sandbox_settings, unsafe_extra_args=("--cap-add", "SYS_ADMIN"))
    weak_name = f"{name}-weak"
    cleanup.append(weak_name)
    weak_spec = _spec(sandbox_settings, default_image, None, weak_name)
    weak.launch(weak_spec, ["sleep", "600"], log=log)
    posture = PodmanSandbox(weak, weak_spec, weak_name).posture()
    assert not posture.ok
    weak.kill(weak_name)
    weak.follow(weak_name, log=log, on_stdout=None, on_stderr=None)


def _launch_in_unit(
    settings: Settings, image: str, ws: Path, name: str, unit: str, argv: list[str], **kw: object
) -> subprocess.Popen[bytes]:
    """A launcher child in the emulated unit ``unit`` launches ``name``; returns the child."""
    args = {
        "data_dir": str(settings.data_dir),
        "repos_root": str(settings.repos_root),
        "mount_roots": [str(p) for p in settings.mount_roots],
        "name": name,
        "image": image,
        "ws": str(ws),
        "log": str(settings.data_dir / "sandbox.log"),
        "argv": argv,
        "unit": unit,
        "unit_hierarchies": UNIT_HIERARCHIES,
        **kw,
    }
    child = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, json.dumps(args)], stdout=subprocess.PIPE
    )
    assert child.stdout is not None
    assert child.stdout.readline() == b"launched\n", "the launcher child failed"
    return child


def test_conmon_is_born_outside_the_callers_unit(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    unit_cgroup: str,
    cleanup: list[str],
) -> None:
    """No window: with the after-the-fact move (place_conmon) disabled, conmon is still
    in none of the unit's cgroups (a launcher killed right after ``podman run -d``
    returned, before any move, leaves nothing for the next unit kill)."""
    name = f"det-born-{os.getpid()}"
    cleanup.append(name)
    child = _launch_in_unit(
        sandbox_settings,
        default_image,
        make_workspace(),
        name,
        unit_cgroup,
        ["sleep", "30"],
        no_second_line=True,
    )
    try:
        info = detach.inspect(name)
        assert info is not None
        conmon = detach.conmon_of(info)
        assert conmon is not None
        for h in UNIT_HIERARCHIES:
            procs = (Path("/sys/fs/cgroup") / h / unit_cgroup / "cgroup.procs").read_text()
            assert str(conmon.pid) not in procs.split(), f"conmon was born in the unit's {h} cgroup"
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()  # type: ignore[union-attr]
    PodmanBackend(sandbox_settings).reap(name)


def test_follow_returns_when_conmon_dies(
    sandbox_settings: Settings,
    default_image: str,
    make_workspace: Callable[[], Path],
    cleanup: list[str],
) -> None:
    """conmon SIGKILLed under a running sandbox (podman still says it runs): follow does
    not wait for ever; the orphaned sandbox is killed, reported, and nothing is left."""
    ws = make_workspace()
    name = f"det-noconmon-{os.getpid()}"
    cleanup.append(name)
    log = sandbox_settings.data_dir / "sandbox.log"
    backend = PodmanBackend(sandbox_settings)
    spec = _spec(sandbox_settings, default_image, ws, name, deadline=600)
    backend.launch(spec, ["sh", "-c", "echo up; exec sleep 600"], log=log)
    # Its output in the log first: conmon killed before the sandbox's shell ran has nothing
    # to hand on (a busy host is slow to get there).
    end = time.monotonic() + 120
    while b"up" not in (log.read_bytes() if log.exists() else b""):
        assert time.monotonic() < end, "the sandbox's first output never reached its log"
        time.sleep(0.1)
    info = detach.inspect(name)
    assert info is not None
    conmon = detach.conmon_of(info)
    assert conmon is not None
    conmon.kill()
    conmon.wait(10)
    box: dict[str, object] = {}
    t = threading.Thread(target=lambda: box.update(r=_follow(backend, name, log)), daemon=True)
    t.start()
    t.join(120)  # the harness's bound; the fix returns at once
    assert not t.is_alive(), "follow hung on a sandbox whose conmon is dead"
    ended, out, _ = box["r"]  # type: ignore[misc]
    assert out == b"up\n"
    assert ended.exit_code != 0 and not ended.timed_out
    _assert_clean(sandbox_settings, name, ws, log)
