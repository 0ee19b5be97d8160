"""End to end (issue 12) on the other sandboxes: the Python scenario of
tests/e2e/test_env_python.py on **qemu** (the frozen environment as a copy-on-write
disk, setup's egress socket served by the guest agent) and on **podman + runsc**
(gVisor's gofer opening the environment's overlay as another uid).

Per backend, two tasks on one launcher: ``cold`` (a miss: setup installs attrs and
pytest from the registry this host's pip uses, through the proxy; the real Claude Code,
driven by a replay script, runs ``.venv/bin/pytest`` with no network; the branch holds
only the agent's file) and ``warm`` (a hit: no setup, no proxy, the same tests pass).
QEMU runs under TCG here (~20x slower): one task and one cache hit, marked ``slow``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.env import EnvStore
from agentbox.launcher import Launcher, TaskInfo, TaskRequest, TaskResult
from git_helpers import git

pytestmark = [
    pytest.mark.podman,  # the image is built in podman's storage on every backend
    pytest.mark.claude,
    pytest.mark.slow,
    # Two tasks per backend in one fixture; under TCG a pip install alone takes minutes.
    pytest.mark.timeout(3600),
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

NONCE = secrets.token_hex(4)

SCRIPT = """\
name: env-backends
turns:
  - text: "Running the project's tests with its own environment."
    tool_use:
      - name: Bash
        input:
          command: ".venv/bin/pytest -q -p no:cacheprovider 2>&1; echo PYTEST-EXIT=$?"
          description: "Run the tests"
          timeout: 600000
  - text: "Can I reach the package index from here?"
    tool_use:
      - name: Bash
        input:
          command: __REGISTRY_CMD__
          description: "Try the registry"
  - text: "Writing down what I saw."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/NOTES.md", content: "the tests ran\\n"}
  - text: "Done: the tests ran with the project's dependencies."
"""

REGISTRY_CMD = (
    "python3 -c 'import urllib.request as u; u.urlopen(\"__INDEX__\", timeout=5)' "
    ">/dev/null 2>&1 && R=REACHED || R=UNREACHABLE; printf 'REGISTRY-%s\\n' $R"
)

TEST_FILE = """\
import attrs


@attrs.define
class Point:
    x: int
    y: int


def test_point():
    assert Point(1, 2).x == 1


def test_attrs_is_installed():
    assert attrs.__version__
"""

#: What the Boxfile says besides [setup], per backend under test.
BACKENDS = {
    "qemu": 'backend = "qemu"\n[resources]\ncpus = 2\nmemory = "2GiB"\n',
    "runsc": 'backend = "podman"\nruntime = "runsc"\n',
}


@dataclass
class Run:
    info: TaskInfo
    result: TaskResult
    repo: Path
    task_dir: Path

    def agent_log(self) -> str:
        return (self.task_dir / "logs" / "agent.jsonl").read_text(errors="replace")


def _pip_index() -> str:
    from agentbox.egress import host_registries

    pip = [(sch, h, p) for src, sch, h, p in host_registries() if src == "pip"]
    if not pip:
        pytest.skip("this host's pip names no http(s) index")
    sch, h, p = pip[0]
    return f"{sch}://{h}:{p}/simple/attrs/"


def _facility(name: str) -> None:
    if name == "qemu":
        from agentbox import _host

        if not _host.qemu(Settings().qemu_binary).ok:
            pytest.skip("no usable qemu here")
    elif shutil.which("runsc") is None:
        pytest.skip("runsc (gVisor) is not installed")


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def runs(request: pytest.FixtureRequest) -> Iterator[tuple[str, Settings, dict[str, Run]]]:
    from agentbox.image import build_default

    name: str = request.param
    _facility(name)
    build_default(Settings())
    base = Path(tempfile.mkdtemp(prefix=f"agentbox-env-{name}-", dir="/var/tmp"))
    base.chmod(0o711)
    index = _pip_index()
    command = json.dumps(REGISTRY_CMD.replace("__INDEX__", index))
    (base / "script.yaml").write_text(SCRIPT.replace("__REGISTRY_CMD__", command))
    (base / "models.toml").write_text(
        f'[models.replay-envb]\nkind = "replay"\nupstream = "{base / "script.yaml"}"\n'
    )
    (base / "data").mkdir()
    (base / "repos").mkdir()
    settings = Settings(
        data_dir=base / "data", repos_root=base / "repos", models_file=base / "models.toml"
    )
    repo = settings.repos_root / "proj"
    repo.mkdir()
    (repo / "requirements.txt").write_text(f"attrs\npytest\n# {name} {NONCE}\n")
    (repo / "test_point.py").write_text(TEST_FILE)
    (repo / ".gitignore").write_text(".venv/\n")
    (repo / ".agentbox").mkdir()
    (repo / ".agentbox" / "Boxfile.toml").write_text(
        f"{BACKENDS[name]}\n[setup]\n"
        # --no-compile: byte-compiling every installed file is most of pip's time under TCG.
        'run = ["python3 -m venv .venv",'
        ' ".venv/bin/pip install -q --no-compile -r requirements.txt"]\n'
        'inputs = ["requirements.txt"]\nnetwork = "registries"\ndeadline = 2400\n'
    )
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "a project")
    launcher = Launcher(settings, max_tasks=1)
    out: dict[str, Run] = {}
    keys: set[str] = set()
    try:
        for task in ("cold", "warm"):
            req = TaskRequest(
                repo=str(repo), task=f"env {task}: run the tests", model="replay-envb",
                deadline=2400.0, task_id=f"envb-{name}-{task}-{NONCE}",
            )  # fmt: skip
            task_id = launcher.submit(req).id
            info = launcher.wait(task_id, timeout=3000)
            run = Run(info, launcher.result(task_id), repo, settings.data_dir / "tasks" / task_id)
            out[task] = run
            if key := (run.result.report.get("setup") or {}).get("key"):
                keys.add(key)
        yield name, settings, out
    finally:
        launcher.close()
        store = EnvStore(settings)
        for key in keys:
            store.remove(key, force=True)
        if not os.environ.get("E2E_KEEP_DIRS"):
            shutil.rmtree(base, ignore_errors=True)


def test_cold_task_sets_up_and_the_agent_runs_the_tests(
    runs: tuple[str, Settings, dict[str, Run]],
) -> None:
    name, _, out = runs
    run = out["cold"]
    assert run.info.status == "done", (name, run.info.error, run.result.report.get("setup"))
    setup = run.result.report["setup"]
    assert setup["cache"] == "miss" and setup["exit_code"] == 0, setup
    assert setup["roots"] == [".venv"] and setup["files"] > 100
    egress = setup["egress"]
    assert egress["allowed"] >= 1 and egress["bytes_down"] > 100_000, egress
    log = run.agent_log()
    assert "2 passed" in log and "PYTEST-EXIT=0" in log, log[-3000:]
    assert "REGISTRY-UNREACHABLE" in log and "REGISTRY-REACHED" not in log
    files = git(run.repo, "ls-tree", "-r", "--name-only", run.result.branch).split()
    assert "NOTES.md" in files and not any(f.startswith(".venv") for f in files)
    assert run.result.report["diffstat"]["files_changed"] == 1


def test_second_task_is_a_cache_hit(runs: tuple[str, Settings, dict[str, Run]]) -> None:
    name, settings, out = runs
    cold, warm = out["cold"], out["warm"]
    assert warm.info.status == "done", (name, warm.info.error)
    setup = warm.result.report["setup"]
    assert setup["cache"] == "hit" and setup["ran"] is False and setup["egress"] is None
    assert setup["key"] == cold.result.report["setup"]["key"]
    assert not (warm.task_dir / "logs" / "setup.log").exists()
    assert "2 passed" in warm.agent_log()
    info = EnvStore(settings).get(setup["key"])
    assert info is not None and info.uses >= 2
