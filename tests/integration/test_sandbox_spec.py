"""From Boxfile + Settings to a SandboxSpec, and from a spec to podman's command line."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import psutil
import pytest

from agentbox.backends import get_backend
from agentbox.backends.base import GATEWAY_PORT, LABEL, SandboxSpec
from agentbox.backends.oci._args import (
    ImageFacts,
    _searchable_by,
    check_spec,
    entry_argv,
    run_args,
)
from agentbox.boxfile import Boxfile
from agentbox.config import DEFAULT_IMAGE, Settings
from agentbox.errors import ConfigError, PathRefused, UnsupportedError
from agentbox.sandbox import spec_from_boxfile

TINI = ImageFacts("img", "sha256:abc", ("/usr/bin/tini", "--"))


def _spec(settings: Settings, **box: object) -> SandboxSpec:
    return spec_from_boxfile(Boxfile.from_dict(dict(box)), settings)


def test_defaults(settings: Settings) -> None:
    spec = _spec(settings)
    assert spec.image == DEFAULT_IMAGE
    assert spec.runtime == "runc"
    assert spec.uid == 64000
    assert spec.labels[LABEL] == "1"
    assert spec.env["HOME"] == "/home/agent"
    assert spec.name.startswith("agentbox-")


def test_runtime_and_image_from_settings_unless_the_boxfile_says(settings: Settings) -> None:
    s = settings.model_copy(update={"runtime": "runsc", "image": "localhost/other:1"})
    assert _spec(s).runtime == "runsc"
    assert _spec(s).image == "localhost/other:1"
    assert _spec(s, runtime="runc", image="localhost/mine:2").runtime == "runc"
    assert _spec(s, runtime="runc", image="localhost/mine:2").image == "localhost/mine:2"


def test_cpus_and_memory_are_clamped_to_the_host(settings: Settings) -> None:
    spec = _spec(settings, resources={"cpus": 256, "memory": "100TiB"})
    assert spec.resources.cpus == float(os.cpu_count() or 1)
    assert spec.resources.memory == psutil.virtual_memory().total
    small = _spec(settings, resources={"cpus": 0.5, "memory": "256MiB"})
    assert (small.resources.cpus, small.resources.memory) == (0.5, 256 * 1024**2)


def test_env_passes_only_allow_listed_names(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.setenv("SECRETLESS_BUT_UNLISTED", "x")
    spec = spec_from_boxfile(
        Boxfile.from_dict({"env": {"allow": ["LANG", "TZ"], "set": {"A": "1"}}}),
        settings,
        extra_env={"ANTHROPIC_BASE_URL": f"http://127.0.0.1:{GATEWAY_PORT}"},
    )
    assert spec.env["LANG"] == "C.UTF-8"
    assert "TZ" not in spec.env  # allowed but unset on the host
    assert "SECRETLESS_BUT_UNLISTED" not in spec.env
    assert spec.env["A"] == "1"
    assert spec.env["ANTHROPIC_BASE_URL"].startswith("http://127.0.0.1:")


def test_env_values_with_newlines_are_refused(settings: Settings) -> None:
    with pytest.raises(ConfigError, match="newline"):
        spec_from_boxfile(Boxfile(), settings, extra_env={"X": "a\nY=b"})


def test_mounts_are_resolved_inside_the_roots(settings: Settings) -> None:
    root = settings.mount_roots[0]
    (root / "venv").mkdir()
    spec = _spec(settings, mounts=[{"source": str(root / "venv"), "target": "/opt/venv"}])
    assert spec.mounts[0].source == (root / "venv").resolve()
    assert spec.mounts[0].read_only


def test_mount_outside_roots_refused(settings: Settings, tmp_path: Path) -> None:
    with pytest.raises(PathRefused, match="mount root"):
        _spec(settings, mounts=[{"source": str(tmp_path), "target": "/opt/x"}])


def test_mount_with_a_comma_refused(settings: Settings) -> None:
    bad = settings.mount_roots[0] / "a,b"
    bad.mkdir()
    with pytest.raises(PathRefused, match="','"):
        _spec(settings, mounts=[{"source": str(bad), "target": "/opt/x"}])


def test_workspace_must_be_an_existing_dir(settings: Settings, tmp_path: Path) -> None:
    with pytest.raises(PathRefused, match="not an existing directory"):
        spec_from_boxfile(Boxfile(), settings, workspace=tmp_path / "missing")
    with pytest.raises(PathRefused, match="absolute"):
        spec_from_boxfile(Boxfile(), settings, workspace=Path("rel"))


def test_bad_names_refused(settings: Settings) -> None:
    with pytest.raises(ConfigError):
        spec_from_boxfile(Boxfile(), settings, name="../etc")


def test_run_args_carry_every_hardening_flag(settings: Settings, tmp_path: Path) -> None:
    ws, gw = tmp_path / "ws", tmp_path / "gw"
    ws.mkdir()
    gw.mkdir()
    spec = spec_from_boxfile(
        Boxfile.from_dict({"resources": {"cpus": 1}}), settings, workspace=ws, gateway_dir=gw
    )
    args = run_args(spec, settings, TINI, detach=False, env_file=tmp_path / "env")
    joined = " ".join(args)
    for flag in (
        "--network none",
        "--read-only ",
        "--read-only-tmpfs=false",
        "--cap-drop ALL",
        "--security-opt no-new-privileges",
        "--ipc private",
        "--uidmap 0:100000:65536",
        "--gidmap 0:100000:65536",
        "--user 64000:64000",
        "--pids-limit 512",
        f"--memory {8 * 1024**3}",
        f"--memory-swap {8 * 1024**3}",
        "--cpus 1",
        "--ulimit nofile=4096:4096",
        "--ulimit nproc=512:512",
        "--tmpfs /tmp:rw,nosuid,nodev,mode=1777",
        "--tmpfs /home/agent:rw,nosuid,nodev,mode=1777",
        "--pull never",
        f"-v {ws.resolve()}:/workspace:rw,nosuid,nodev",
        f"-v {gw.resolve()}:/run/agentbox/gw:rw,nosuid,nodev,noexec",
        f"--label {LABEL}=1",
        "--timeout ",
    ):
        assert flag in joined, flag
    assert "--privileged" not in joined and "--cap-add" not in joined
    assert args[:3] == ["podman", "--runtime", "runc"]
    assert "--init" not in args  # tini is the image's entrypoint
    no_tini = ImageFacts("img", "sha256:abc", ("/docker-entrypoint.sh",))
    args2 = run_args(spec, settings, no_tini, detach=True, env_file=tmp_path / "env")
    assert "--init" in args2 and "-d" in args2 and "--rm" not in args2


def test_runsc_gets_network_off_at_runsc_level(settings: Settings, tmp_path: Path) -> None:
    gw = tmp_path / "gw"
    gw.mkdir()
    spec = spec_from_boxfile(Boxfile(runtime="runsc"), settings, gateway_dir=gw)
    args = run_args(spec, settings, TINI, detach=False, env_file=tmp_path / "env")
    assert "network=none" in args
    assert "host-uds=open" in args  # only because there is a gateway
    spec2 = spec_from_boxfile(Boxfile(runtime="runsc"), settings)
    assert "host-uds=open" not in run_args(spec2, settings, TINI, detach=False, env_file=gw)


def test_unsafe_extra_args_only_through_the_constructor_argument(
    settings: Settings, tmp_path: Path
) -> None:
    spec = _spec(settings)
    args = run_args(
        spec,
        settings,
        TINI,
        detach=False,
        env_file=tmp_path / "env",
        unsafe_extra_args=("--cap-add", "SYS_ADMIN"),
    )
    assert args[-3:-1] == ["--cap-add", "SYS_ADMIN"]
    assert "unsafe" not in Boxfile.model_fields


def test_entry_argv_puts_the_relay_first_only_with_a_gateway(
    settings: Settings, tmp_path: Path
) -> None:
    assert entry_argv(_spec(settings), ["true"]) == ["true"]
    spec = spec_from_boxfile(Boxfile(), settings, gateway_dir=tmp_path)
    argv = entry_argv(spec, ["claude", "-p", "hi"])
    # sh starts the relay's C twin where the image has it, else relay.py (its $0)
    assert argv[:2] == ["/bin/sh", "-c"] and argv[3] == "/opt/agentbox/relay.py"
    assert argv[-4:] == ["--", "claude", "-p", "hi"]


def test_unknown_runtime_refused_before_anything(settings: Settings) -> None:
    spec = _spec(settings).replace(runtime="kata")
    with pytest.raises(UnsupportedError, match="unknown OCI runtime 'kata'"):
        check_spec(spec, with_image=False)


def test_crun_refused_with_the_cgroups_reason(settings: Settings) -> None:
    from agentbox.core import host as _host

    fac = _host.podman_runtime("crun")
    if fac.ok:
        pytest.skip("crun is usable on this host")
    with pytest.raises(UnsupportedError) as ei:
        check_spec(_spec(settings, runtime="crun"), with_image=False)
    assert fac.detail in str(ei.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_runsc_needs_mount_sources_the_gofer_can_reach() -> None:
    top = Path(tempfile.mkdtemp(dir="/var/tmp"))  # /var/tmp is 1777: the chain is ours
    try:
        top.chmod(0o711)
        ws = top / "ws"
        ws.mkdir()
        ws.chmod(0o700)
        # Owned by an unmapped id (root) and closed: the gofer (host uid 100000) cannot enter.
        assert _searchable_by(ws, 100000) == ws
        # Owned by mapped ids (the sandbox's 164000): the gofer's DAC override applies.
        os.chown(ws, 164000, 164000)
        assert _searchable_by(ws, 100000) is None
        top.chmod(0o700)
        assert _searchable_by(ws, 100000) == top
    finally:
        shutil.rmtree(top)


def test_get_backend(settings: Settings) -> None:
    assert get_backend("podman", settings).name == "podman"
    with pytest.raises(UnsupportedError, match="unknown backend"):
        get_backend("lxc", settings)
