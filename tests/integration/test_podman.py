"""The podman backend: refusals before anything starts, the CLI, orphans.

Contract behaviour (run, exec, copy, posture, gateway) is in
test_backend_contract.py; cleanup after kills and deadlines in
test_podman_cleanup.py. Every sandbox the backend makes here goes through the leak
guard (``sandbox_factory``), refused ones included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from agentbox.backends.podman import PodmanBackend
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.errors import BoxfileError, ImageError, PathRefused, UnsupportedError
from agentbox.sandbox import spec_from_boxfile
from sandbox_leaks import SandboxTracker

pytestmark = pytest.mark.podman

AGENTBOX = str(Path(sys.executable).parent / "agentbox")
Factory = Callable[[PodmanBackend, Settings], SandboxTracker]


def _exists(name: str) -> bool:
    return subprocess.run(["podman", "container", "exists", name], check=False).returncode == 0


def _cli(settings: Settings, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ["PATH"],
        "AGENTBOX_DATA_DIR": str(settings.data_dir),
        # JSON: pydantic-settings decodes tuple fields as JSON before any validator runs.
        "AGENTBOX_MOUNT_ROOTS": ":".join(str(r) for r in settings.mount_roots),
        "AGENTBOX_CONFIG": "/nonexistent",
    }
    return subprocess.run(
        [AGENTBOX, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def _owned_by(pid: int) -> list[str]:
    out = subprocess.run(
        [
            "podman",
            "ps",
            "-a",
            "--filter",
            f"label=io.agentbox.owner-pid={pid}",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [c["Names"][0] for c in json.loads(out or "[]")]


# --- refusals: nothing starts ---------------------------------------------------------------


def test_missing_image_refused_before_anything(
    sandbox_settings: Settings, podman_boxes: SandboxTracker
) -> None:
    be = podman_boxes.backend
    spec = spec_from_boxfile(Boxfile(image="localhost/agentbox-no-such-image:1"), sandbox_settings)
    with pytest.raises(ImageError, match="not in podman's local storage"):
        be.check(spec)
    with pytest.raises(ImageError):
        podman_boxes.run(spec, ["true"])
    with pytest.raises(ImageError):
        podman_boxes.create(spec)
    assert not _exists(spec.name)


def test_default_image_missing_says_how_to_build_it(sandbox_settings: Settings) -> None:
    from agentbox.backends.oci import _args as _oci_args

    with pytest.raises(ImageError, match="agentbox image build"):
        _oci_args.image_facts("localhost/agentbox-default:latest-missing")
    s = sandbox_settings.model_copy(update={"image": "localhost/agentbox-default:nope"})
    spec = spec_from_boxfile(Boxfile(), s)
    with pytest.raises(ImageError):
        PodmanBackend(s).check(spec)


def test_unknown_and_unusable_runtimes_refused(
    sandbox_settings: Settings, default_image: str, podman_boxes: SandboxTracker
) -> None:
    spec = spec_from_boxfile(Boxfile(), sandbox_settings)
    with pytest.raises(UnsupportedError, match="unknown OCI runtime"):
        podman_boxes.run(spec.replace(runtime="kata"), ["true"])
    with pytest.raises(BoxfileError) as ei:
        Boxfile.from_dict({"runtime": "kata"})
    assert ei.value.key == "runtime"
    if not _host.podman_runtime("crun").ok:
        with pytest.raises(UnsupportedError, match="cgroups"):
            podman_boxes.run(spec.replace(runtime="crun"), ["true"])
    assert not _exists(spec.name)


def test_cli_mount_outside_roots_refused(sandbox_settings: Settings, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [AGENTBOX, "exec", "--mount", str(tmp_path), "--", "true"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            "PATH": os.environ["PATH"],
            "AGENTBOX_DATA_DIR": str(sandbox_settings.data_dir),
            "AGENTBOX_MOUNT_ROOTS": str(sandbox_settings.mount_roots[0]),
            "AGENTBOX_CONFIG": "/nonexistent",
        },
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert "mount root" in err and str(tmp_path) in err
    assert _owned_by(proc.pid) == []


@pytest.mark.parametrize(
    ("boxfile", "words"),
    [
        ('capabilities = ["CAP_NET_ADMIN"]', "capabilities cannot be granted"),
        ('network = "host"', "no network"),
        ('runtime = "kata"', "'runc', 'crun' or 'runsc'"),
    ],
)
def test_cli_boxfile_refusals(
    sandbox_settings: Settings,
    tmp_path: Path,
    boxfile: str,
    words: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # In-process (the subprocess path is covered above): refused while parsing.
    from agentbox.cli import main

    bf = tmp_path / "Boxfile"
    bf.write_text(boxfile + "\n")
    monkeypatch.setenv("AGENTBOX_DATA_DIR", str(sandbox_settings.data_dir))
    monkeypatch.setenv("AGENTBOX_CONFIG", "/nonexistent")
    monkeypatch.setattr(sys, "argv", ["agentbox", "exec", "--boxfile", str(bf), "--", "true"])
    with pytest.raises(SystemExit) as ei:
        main()
    assert ei.value.code != 0
    assert words in capsys.readouterr().err


def test_spec_refuses_mount_outside_roots(sandbox_settings: Settings, tmp_path: Path) -> None:
    box = Boxfile.from_dict({"mounts": [{"source": str(tmp_path), "target": "/opt/x"}]})
    with pytest.raises(PathRefused):
        spec_from_boxfile(box, sandbox_settings)


# --- the CLI ---------------------------------------------------------------------------------


def test_cli_exec_streams_and_exits_with_the_code(
    sandbox_settings: Settings, default_image: str
) -> None:
    res = _cli(sandbox_settings, "exec", "--", "sh", "-c", "echo out; echo err >&2; exit 42")
    assert (res.returncode, res.stdout, res.stderr) == (42, "out\n", "err\n")


def test_cli_exec_declared_mount_is_read_only(
    sandbox_settings: Settings, default_image: str
) -> None:
    venv = sandbox_settings.mount_roots[0] / "venv"
    venv.mkdir()
    venv.chmod(0o755)
    (venv / "marker").write_text("from host\n")
    (venv / "marker").chmod(0o644)
    script = f"cat {venv}/marker; touch {venv}/new && echo WROTE; true"
    res = _cli(sandbox_settings, "exec", "--mount", str(venv), "--", "sh", "-c", script)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "from host\n"
    assert "Read-only file system" in res.stderr
    assert not (venv / "new").exists()


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_cli_smoke_passes(sandbox_settings: Settings, default_image: str, runtime: str) -> None:
    if not _host.podman_runtime(runtime).ok:
        pytest.skip(f"{runtime}: {_host.podman_runtime(runtime).detail}")
    res = _cli(sandbox_settings, "smoke", "--runtime", runtime, "--json")
    data = json.loads(res.stdout)
    failed = [c for c in data["checks"] if not c["ok"]]
    assert res.returncode == 0 and data["ok"], failed
    names = {c["name"] for c in data["checks"]}
    for must in (
        "CapEff",
        "NoNewPrivs",
        "network interfaces",
        "mounts",
        "DNS fails",
        "HTTPS fails",
    ):
        assert must in names


# --- orphans ---------------------------------------------------------------------------------

ORPHAN = r"""
import os, sys
from agentbox.backends.podman import PodmanBackend
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.sandbox import spec_from_boxfile
s = Settings()
box = PodmanBackend(s).create(spec_from_boxfile(Boxfile(), s, name=sys.argv[1]))
os._exit(0)  # the owner dies without destroying its sandbox
"""


def test_cleanup_orphans_removes_sandboxes_whose_owner_died(
    sandbox_settings: Settings, default_image: str, podman_boxes: SandboxTracker
) -> None:
    name = f"agentbox-orphan-{os.getpid()}"
    podman_boxes.track(name)  # made by the owner process below
    env = {"PATH": os.environ["PATH"], "AGENTBOX_DATA_DIR": str(sandbox_settings.data_dir)}
    subprocess.run([sys.executable, "-c", ORPHAN, name], check=True, env=env, timeout=120)
    assert _exists(name)
    mine = podman_boxes.create(spec_from_boxfile(Boxfile(), sandbox_settings))  # a live owner: kept
    try:
        removed = podman_boxes.backend.cleanup_orphans()
        assert name in removed
        assert mine.name not in removed
        assert not _exists(name)
        assert _exists(mine.name)
    finally:
        mine.destroy()
    assert not _exists(mine.name)


# --- posture can fail ------------------------------------------------------------------------


def test_posture_sees_a_deliberately_weakened_sandbox(
    sandbox_settings: Settings, default_image: str, sandbox_factory: Factory
) -> None:
    """Positive control: the posture checks fire on a sandbox weakened through the
    escape suite's ``unsafe_extra_args`` (never reachable from a Boxfile)."""
    weak = PodmanBackend(
        sandbox_settings,
        unsafe_extra_args=("--security-opt", "seccomp=unconfined", "--cap-add", "SYS_ADMIN"),
    )
    with sandbox_factory(weak, sandbox_settings).create(
        spec_from_boxfile(Boxfile(), sandbox_settings)
    ) as box:
        posture = box.posture()
    failed = {(c.where, c.name) for c in posture.checks if not c.ok}
    assert not posture.ok
    assert {
        ("inside", "Seccomp"),
        ("inside", "CapBnd"),
        ("host", "Seccomp (every thread)"),
        ("host", "CapBnd (every thread)"),
        ("host", "CapAdd"),
    } <= failed, failed


# --- limits ------------------------------------------------------------------------------------


def test_busy_sandboxes_do_not_share_one_process_budget(
    sandbox_settings: Settings, default_image: str, podman_boxes: SandboxTracker
) -> None:
    """Two sandboxes each using most of their pids limit both get it.

    Every sandbox runs as the same host uid (subid_base + 64000), and
    ``--ulimit nproc`` equals the pids limit. That would starve a second busy
    sandbox if RLIMIT_NPROC were counted per host uid, as before Linux 5.14;
    since then it is counted per user namespace (ucounts), and each podman
    sandbox has its own. This fails on a host where that no longer holds.
    """
    pids = 64
    spec = spec_from_boxfile(Boxfile(), sandbox_settings)
    spec = spec.replace(resources=spec.resources.model_copy(update={"pids": pids}))
    start = (
        "for i in $(seq 40); do sleep 300 & done 2>/dev/null;"
        " sleep 0.5; echo $(ls /proc | grep -c '^[0-9]')"
    )
    counts = []
    a = podman_boxes.create(spec.replace(name=spec.name + "-a"))
    try:
        b = podman_boxes.create(spec.replace(name=spec.name + "-b"))
        try:
            for box in (a, b):  # 40 each: 80 in all, more than one sandbox's limit of 64
                res = box.exec(["sh", "-c", start], timeout=60)
                counts.append(int(res.stdout.split()[-1]) if res.stdout.split() else 0)
        finally:
            b.destroy()
    finally:
        a.destroy()
    assert min(counts) >= 40, f"processes per sandbox {counts}: one budget shared?"
