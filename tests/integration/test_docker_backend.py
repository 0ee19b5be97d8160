"""The docker backend's own promises (issue 17), on a real Engine.

* Only our calls reach ``docker.sock``: the Engine endpoints a sandbox's whole life
  uses are exactly create, start, wait, exec (create/start/inspect), inspect, kill
  and remove; any other request is refused before it is sent.
* The seed's agent-container list, read back from ``docker inspect``.
* uid 64000 owns nothing on the host: under userns-remap it is host uid
  ``subid_base + 64000``, the one the workspaces are given to.
* Orphans (owner gone) are removed by label; a live owner's sandbox is left alone.

Every sandbox goes through ``sandbox_factory``: none may leave a container,
process, cgroup or socket behind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends import get_backend
from agentbox.backends.base import SandboxSpec
from agentbox.backends.docker import LIFE, DockerBackend
from agentbox.backends.docker._client import endpoint_of
from agentbox.config import Settings
from agentbox.errors import SandboxError
from sandbox_leaks import SandboxTracker

pytestmark = pytest.mark.docker


@pytest.fixture
def backend(
    settings_factory: Callable[[], Settings], default_image: str
) -> Iterator[DockerBackend]:
    be = get_backend("docker", settings_factory())
    assert isinstance(be, DockerBackend)
    yield be
    be.client.close()  # its pooled connection to docker.sock


@pytest.fixture
def boxes(
    backend: DockerBackend, sandbox_factory: Callable[[DockerBackend, Settings], SandboxTracker]
) -> SandboxTracker:
    return sandbox_factory(backend, backend.settings)


def _spec(be: DockerBackend, name: str, **kw: object) -> SandboxSpec:
    return SandboxSpec(name=name, image=be.settings.image, **kw)  # type: ignore[arg-type]


def test_endpoint_names() -> None:
    assert endpoint_of("post", "http+docker://localhost/v1.41/containers/create?name=x") == (
        "POST /containers/create"
    )
    assert endpoint_of("DELETE", "http+docker://localhost/v1.41/containers/abc?force=1") == (
        "DELETE /containers/{id}"
    )
    assert endpoint_of("GET", "http+docker://localhost/v1.41/containers/json?all=1") == (
        "GET /containers/json"
    )
    assert endpoint_of("POST", "http+docker://localhost/v1.41/exec/e1/start") == (
        "POST /exec/{id}/start"
    )


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_a_sandbox_life_uses_exactly_the_minimal_endpoints(
    backend: DockerBackend,
    boxes: SandboxTracker,
    workspace_factory: Callable[[Settings], Path],
    runtime: str,
) -> None:
    backend.facts()  # set-up calls (info, version) before we start counting
    spec = _spec(backend, f"d1-life-{runtime}-{os.getpid()}", runtime=runtime,
                 workspace=workspace_factory(backend.settings))  # fmt: skip
    from agentbox.backends.docker._image import ensure_image

    ensure_image(backend.client, backend.settings, spec.image)
    start = len(backend.client.endpoints)
    box = boxes.create(spec)
    try:
        assert box.exec(["sh", "-c", "cat; echo out; echo err >&2"], stdin=b"in\n").exit_code == 0
        box.stop(timeout=1)
    finally:
        box.destroy()
    used = set(backend.client.endpoints[start:])
    assert used == LIFE, f"extra: {used - LIFE}, unused: {LIFE - used}"


def test_a_call_outside_the_allow_list_never_reaches_the_socket(backend: DockerBackend) -> None:
    before = list(backend.client.endpoints)
    with pytest.raises(SandboxError, match="refused Engine call GET /images/json"):
        backend.client.api.images()
    with pytest.raises(
        SandboxError, match=re.escape("refused Engine call POST /containers/{id}/update")
    ):
        backend.client.api.update_container("x", mem_limit="1g")
    assert backend.client.endpoints == before  # nothing sent


def test_inspect_shows_the_seeds_container_list(
    backend: DockerBackend,
    boxes: SandboxTracker,
    workspace_factory: Callable[[Settings], Path],
    tmp_path: Path,
) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    from agentbox.backends.base import BindMount

    spec = _spec(backend, f"d1-inspect-{os.getpid()}",
                 workspace=workspace_factory(backend.settings),
                 mounts=(BindMount(ro, "/mnt/ro"),))  # fmt: skip
    with boxes.create(spec) as box:
        info = box.inspect()
        hc = info["HostConfig"]
        assert hc["NetworkMode"] == "none"
        assert hc["ReadonlyRootfs"] is True
        assert hc["CapDrop"] == ["ALL"]
        assert not hc["CapAdd"]
        assert "no-new-privileges" in hc["SecurityOpt"]
        assert hc["IpcMode"] == "private"
        assert info["Config"]["Entrypoint"] == ["/usr/bin/tini", "--"]
        assert hc["PidsLimit"] == 512
        assert hc["Memory"] == hc["MemorySwap"] == 8 * 1024**3
        assert {u["Name"]: u["Hard"] for u in hc["Ulimits"]}["nofile"] == 4096
        assert info["Config"]["User"] == "64000:64000"
        assert sorted(m["Destination"] for m in info["Mounts"]) == ["/mnt/ro", "/workspace"]
        assert {m["Destination"]: m["RW"] for m in info["Mounts"]} == {
            "/mnt/ro": False, "/workspace": True}  # fmt: skip
        assert info["Config"]["Labels"]["io.agentbox.sandbox"] == "1"
        # Inside: only lo, uid 64000, no capabilities.
        res = box.exec(["sh", "-c", "id -u; grep -E '^(CapEff|NoNewPrivs|Seccomp):' "
                        "/proc/self/status; ls /sys/class/net"])  # fmt: skip
        out = res.stdout.decode().split()
        assert out[0] == "64000"
        assert out[1:7] == ["CapEff:", "0000000000000000", "NoNewPrivs:", "1", "Seccomp:", "2"]
        assert out[7:] == ["lo"]


def test_uid_64000_owns_nothing_on_the_host(
    backend: DockerBackend, boxes: SandboxTracker, workspace_factory: Callable[[Settings], Path]
) -> None:
    facts = backend.facts()
    ws = workspace_factory(backend.settings)
    spec = _spec(backend, f"d1-uid-{os.getpid()}", workspace=ws)
    with boxes.create(spec) as box:
        assert box.exec(["touch", "/workspace/made"]).exit_code == 0
        owner = (ws / "made").stat().st_uid
        pids = box.host_pids()
        uids = {int(Path(f"/proc/{p}/status").read_text().split("Uid:")[1].split()[0])
                for p in pids if Path(f"/proc/{p}/status").exists()}  # fmt: skip
    assert owner == facts.host_uid(64000) == backend.settings.sandbox_host_uid
    # the sleep and its init run as the sandbox's host uid, never as root
    assert uids and 0 not in uids, uids


_OWNER = """
import os, sys
from agentbox.backends import get_backend
from agentbox.backends.base import SandboxSpec
from agentbox.config import Settings
s = Settings()
get_backend("docker", s).create(SandboxSpec(name=sys.argv[1], image=s.image))
os._exit(0)  # the owner dies holding it: no destroy
"""


def test_orphans_are_removed_and_live_ones_kept(
    backend: DockerBackend, boxes: SandboxTracker
) -> None:
    name = f"d1-orphan-{os.getpid()}"
    boxes.track(name)  # made by the owner process below
    env = {**os.environ, "AGENTBOX_DATA_DIR": str(backend.settings.data_dir)}
    subprocess.run([sys.executable, "-c", _OWNER, name], check=True, env=env, timeout=300)
    live = _spec(backend, f"d1-live-{os.getpid()}")
    try:
        with boxes.create(live) as keep:
            removed = backend.cleanup_orphans()
            assert name in removed
            assert keep.name not in removed
            assert keep.exec(["true"]).exit_code == 0
        assert name not in [n for c in backend.list_sandboxes() for n in c["Names"]]
    finally:
        backend.kill(name)


def test_posture_catches_a_weakened_container(
    settings_factory: Callable[[], Settings],
    default_image: str,
    sandbox_factory: Callable[[DockerBackend, Settings], SandboxTracker],
) -> None:
    """The control: the same backend with the Engine's default seccomp profile and a
    capability back must fail those posture rows (the checks can fail)."""
    be = DockerBackend(settings_factory(),
                       unsafe_host_config={"SecurityOpt": ["no-new-privileges"],
                                           "CapAdd": ["CHOWN"]})  # fmt: skip
    with sandbox_factory(be, be.settings).create(_spec(be, f"d1-weak-{os.getpid()}")) as box:
        posture = box.posture()
    bad = {c.name for c in posture.checks if not c.ok}
    assert {"seccomp profile (agentbox's)", "CapAdd"} <= bad, bad
    assert not posture.ok
