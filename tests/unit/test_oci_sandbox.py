"""The part of a container sandbox podman and docker share (``backends/oci/_sandbox.py``),
in milliseconds: a subclass whose "engine" runs real processes on the host.

Only the engine's half is replaced (``_run``, ``_pack``, ``_init_pid``, ``_remove``);
the exec wrapper and its ``timed_out`` rule, copy in and out (the tar streams, the
``data`` filter, the size bound), host pids and the verified teardown are the code
both real backends run (their own paths: tests/integration/test_podman.py,
test_docker_backend.py, test_backend_contract.py).
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath

import pytest

from agentbox.backends.base import SandboxSpec
from agentbox.backends.oci import _sandbox as _oci_sandbox
from agentbox.backends.oci._cli import Capture
from agentbox.backends.oci._sandbox import OciSandbox, Ran
from agentbox.errors import ConfigError, SandboxError


class HostSandbox(OciSandbox):
    """An "engine" that runs each command as a plain child process of the test."""

    engine = "host"

    def __init__(self, spec: SandboxSpec) -> None:
        super().__init__(spec, spec.name)
        self.removed = 0
        self.argvs: list[list[str]] = []

    def _run(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None,
        stdin: bytes | None,
        out: Capture,
        err: Capture,
        timeout: float | None,
    ) -> Ran:
        self.argvs.append(argv)
        try:
            res = subprocess.run(argv, input=stdin or b"", capture_output=True,
                                 env={**os.environ, **(env or {})}, timeout=timeout,
                                 check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            return None
        out(res.stdout)
        err(res.stderr)
        return res.returncode, False

    def _pack(self, src: PurePosixPath, sink: Callable[[bytes], None]) -> None:
        res = subprocess.run(["tar", "-c", "-C", str(src.parent), "-f", "-", "--", src.name],
                             capture_output=True, check=False)  # fmt: skip
        if res.returncode != 0:
            raise SandboxError(f"copy_out of {src} failed", sandbox=self.name)
        sink(res.stdout)

    def _init_pid(self) -> int:
        return os.getpid()

    def _on_deadline(self) -> None:
        self.destroy()

    def _remove(self) -> None:
        self.removed += 1

    def leftovers(self) -> list[str]:
        return []


@pytest.fixture
def box() -> HostSandbox:
    return HostSandbox(SandboxSpec(name="oci-unit", image="none", workdir="/"))


def test_exec_wraps_in_timeout_and_says_when_it_fired(box: HostSandbox) -> None:
    res = box.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (res.exit_code, res.stdout, res.stderr, res.timed_out) == (3, b"out\n", b"err\n", False)
    res = box.exec(["sleep", "30"], timeout=0.2)
    assert box.argvs[-1][:3] == ["timeout", "--kill-after=2", "0.2"]
    assert res.exit_code == 124 and res.timed_out
    # An exit code of 124 that the command chose itself is no timeout.
    assert not box.exec(["sh", "-c", "exit 124"], timeout=30).timed_out
    with pytest.raises(ConfigError):
        box.exec([])


def test_copy_in_and_out_round_trip(box: HostSandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello")
    inside = tmp_path / "inside"
    inside.mkdir()
    box.copy_in(src, str(inside / "tree"))
    assert (inside / "tree" / "a.txt").read_text() == "hello"
    box.copy_out(str(inside / "tree"), tmp_path / "back")
    assert (tmp_path / "back" / "a.txt").read_text() == "hello"
    with pytest.raises(ConfigError):
        box.copy_out(str(inside / "tree"), tmp_path / "back")  # exists
    with pytest.raises(ConfigError):
        box.copy_in(src, "relative/path")
    with pytest.raises(ConfigError):
        box.copy_out("/tmp/../etc", tmp_path / "x")


def test_copy_out_skips_links_that_leave_the_destination(box: HostSandbox, tmp_path: Path) -> None:
    tree = tmp_path / "inside" / "tree"
    tree.mkdir(parents=True)
    (tree / "ok").write_text("fine")
    (tree / "out").symlink_to("/etc/passwd")
    (tree / "up").symlink_to("../../../../../../etc/passwd")
    box.copy_out(str(tree), tmp_path / "back")
    assert (tmp_path / "back" / "ok").read_text() == "fine"
    assert not (tmp_path / "back" / "out").is_symlink()
    assert not (tmp_path / "back" / "up").is_symlink()


def test_copy_out_is_bounded(
    box: HostSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_oci_sandbox, "MAX_COPY_OUT", 4096)
    tree = tmp_path / "inside" / "big"
    tree.mkdir(parents=True)
    (tree / "blob").write_bytes(os.urandom(64 * 1024))
    with pytest.raises(SandboxError, match="more than 4096 bytes"):
        box.copy_out(str(tree), tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_host_pids_and_a_teardown_that_runs_once(box: HostSandbox) -> None:
    assert os.getpid() in box.host_pids()
    settled: list[bool] = []

    class Disk:
        def __enter__(self) -> Disk:
            return self

        def __exit__(self, *exc: object) -> None:
            settled.append(True)

    box._disk = Disk()
    box.destroy()
    box.destroy()
    assert (box.removed, settled) == (1, [True])


def test_a_tar_with_an_absolute_name_is_refused_entry_by_entry(
    box: HostSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that packs a hostile archive (absolute name, ``..``) writes nothing outside."""
    victim = tmp_path / "victim"

    def hostile(src: PurePosixPath, sink: Callable[[bytes], None]) -> None:
        path = tmp_path / "hostile.tar"
        with tarfile.open(path, "w") as tar:
            for name in (str(victim), f"{src.name}/../../victim2", f"{src.name}/fine"):
                info = tarfile.TarInfo(name)
                info.size = 2
                tar.addfile(info, fileobj=io.BytesIO(b"hi"))
        sink(path.read_bytes())

    monkeypatch.setattr(box, "_pack", hostile)
    box.copy_out("/somewhere/tree", tmp_path / "back")
    assert (tmp_path / "back" / "fine").read_bytes() == b"hi"
    assert not victim.exists() and not (tmp_path / "victim2").exists()
