"""A microVM's /workspace holds at most its disk limit (issue 11 item 6).

The ``/data`` disk's ext4 is made at the sandbox's ``[resources] disk`` (and
``inodes``) and padded to the fixed device size snapshots expect. Before the
fix every ``/data`` was an 8 GiB filesystem whatever the Boxfile said.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from agentbox.backends.base import SandboxSpec
from agentbox.backends.microvm.qemu import QemuBackend
from agentbox.boxfile import Resources
from agentbox.config import Settings
from sandbox_leaks import SandboxTracker

pytestmark = pytest.mark.qemu

MiB = 1024**2


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> QemuBackend:
    from agentbox.image import build_default

    info = build_default(Settings())
    assert info.rootfs is not None and info.hash is not None
    settings = Settings(data_dir=tmp_path_factory.mktemp("qemu-disk-data"))
    return QemuBackend(settings, rootfs=(info.rootfs, info.hash))


def test_writing_past_the_limit_fails_in_the_guest(
    backend: QemuBackend,
    tmp_path: Path,
    sandbox_factory: Callable[[QemuBackend, Settings], SandboxTracker],
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "keep.txt").write_text("from the host\n")
    res_limits = Resources(memory="1GiB", cpus=1, disk="128MiB", inodes=4096)
    spec = SandboxSpec(name="disk-limit", image="default", resources=res_limits, workspace=ws)
    flood = (
        "import os\nn = 0\ntry:\n for i in range(10000):\n"
        "  open(f'/workspace/f{i}', 'w').close(); n += 1\n"
        "except OSError as e:\n print('files', n, e.errno)\n"
    )
    script = (
        "echo partial > /workspace/partial.txt; "
        "fallocate -l 1G /workspace/big; echo fallocate=$?; "
        f'python3 -c "{flood}"; '
        "df -k /workspace | tail -1"
    )
    res = sandbox_factory(backend, backend.settings).run(spec, ["sh", "-c", script])
    out, err = res.stdout.decode(), res.stderr.decode()
    assert "fallocate=1" in out and "No space left on device" in err, (out, err)
    files_line = next(ln for ln in out.splitlines() if ln.startswith("files"))
    assert int(files_line.split()[1]) < 4096 and files_line.split()[2] == "28"
    assert int(out.strip().splitlines()[-1].split()[1]) * 1024 <= 128 * MiB
    # What the agent wrote is synced back for collection.
    assert (ws / "partial.txt").read_text() == "partial\n"
    assert (ws / "keep.txt").read_text() == "from the host\n"
