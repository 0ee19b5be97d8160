"""End to end (issue 12) on the other sandboxes: the Python scenario of
tests/e2e/test_env_python.py on **qemu** (the frozen environment as a copy-on-write
disk, setup's egress socket served by the guest agent) and on **podman + runsc**
(gVisor's gofer opening the environment's overlay as another uid).

Per backend, two tasks on one launcher (qemu: the first only): ``cold`` (a miss: setup
installs attrs and pytest from the registry this host's pip uses, through the proxy; the
real Claude Code, driven by a replay script, runs ``.venv/bin/pytest`` with no network;
the branch holds only the agent's file) and ``warm`` (a hit: no setup, no proxy, the same
tests pass).

QEMU runs under TCG here (~20x slower), so its setup keeps only what is qemu's own: the
download goes out through setup's egress socket, which the guest agent serves; what
setup made is frozen and comes back to both tasks as a copy-on-write disk in the guest;
and the agent in the guest runs the tests from it with no network. It fetches the five
pinned wheels the tests need and unpacks them into a ``--without-pip`` venv (a small
script, :data:`FETCH`) instead of running ensurepip and pip's resolver under TCG: pip
itself, the cache logic and the proxy's rules are the same code on every backend and
run for real on podman (``runsc`` here, runc in ``test_env_python.py``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

import pytest

from agentbox.config import Settings
from agentbox.env import EnvStore
from env_helpers import BACKEND_HEADS, PY_TEST_FILE, EnvLab, EnvRun, pip_index, require_backend
from git_helpers import git

pytestmark = [
    pytest.mark.podman,  # the image is built in podman's storage on every backend
    pytest.mark.claude,
    pytest.mark.slow,
    # Two tasks per backend in one fixture; under TCG a pip install alone takes minutes.
    pytest.mark.timeout(3600),
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


#: QEMU's setup: the pinned wheels of attrs and pytest (and pytest's dependencies on
#: Python 3.11), fetched from the index through setup's proxy and unpacked into the venv,
#: with a ``.venv/bin/pytest`` that runs them.
FETCH = """\
import io, re, sys, urllib.parse, urllib.request, zipfile
from pathlib import Path

WHEELS = ["attrs-25.3.0", "pytest-8.3.5", "pluggy-1.5.0", "iniconfig-2.0.0", "packaging-24.2"]
site = next(Path(".venv/lib").glob("python3*/site-packages"))
for wheel in WHEELS:
    page_url = urllib.parse.urljoin(sys.argv[1], wheel.split("-")[0] + "/")
    page = urllib.request.urlopen(page_url, timeout=300).read().decode()
    href = re.search(r'href="([^"#]*' + re.escape(wheel) + r'-py3-none-any[.]whl)', page)
    data = urllib.request.urlopen(urllib.parse.urljoin(page_url, href[1]), timeout=300).read()
    zipfile.ZipFile(io.BytesIO(data)).extractall(site)
    print("installed", wheel, len(data))
pytest = Path(".venv/bin/pytest")
pytest.write_text('#!/bin/sh\\nexec "$(dirname "$0")/python" -m pytest "$@"\\n')
pytest.chmod(0o755)
"""


@pytest.fixture(scope="module", params=["qemu", "runsc"])
def runs(
    request: pytest.FixtureRequest, env_lab: Callable[..., EnvLab]
) -> tuple[str, Settings, dict[str, EnvRun]]:
    name: str = request.param
    require_backend(name)
    index, _ = pip_index()
    command = json.dumps(REGISTRY_CMD.replace("__INDEX__", index))
    lab = env_lab(f"envb-{name}", SCRIPT.replace("__REGISTRY_CMD__", command))
    files = {"requirements.txt": f"attrs\npytest\n# {name} {NONCE}\n"}
    if name == "qemu":
        files["fetch_wheels.py"] = FETCH
        run = (
            '["python3 -m venv --without-pip .venv",'
            f' "python3 fetch_wheels.py {index.removesuffix("attrs/")}"]'
        )
    else:
        run = (
            '["python3 -m venv .venv", ".venv/bin/pip install -q --no-compile -r requirements.txt"]'
        )
    boxfile = (
        f"{BACKEND_HEADS[name]}\n[setup]\nrun = {run}\n"
        f"inputs = {json.dumps(sorted(files))}\n"
        'network = "registries"\ndeadline = 2400\n'
    )
    repo = lab.repo("proj", {
        **files, "test_point.py": PY_TEST_FILE,
        ".gitignore": ".venv/\n", ".agentbox/Boxfile.toml": boxfile,
    })  # fmt: skip
    # qemu runs the cold task only: what a hit adds (the store's lookup, no setup) is the
    # same code on every backend, and the frozen environment already comes back to the
    # cold task's agent as a copy-on-write disk; a second VM under TCG is two minutes.
    tasks = ("cold",) if name == "qemu" else ("cold", "warm")
    out = {task: lab.run(f"envb-{name}-{task}", repo, 2400.0) for task in tasks}
    return name, lab.settings, out


def test_cold_task_sets_up_and_the_agent_runs_the_tests(
    runs: tuple[str, Settings, dict[str, EnvRun]],
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


def test_second_task_is_a_cache_hit(runs: tuple[str, Settings, dict[str, EnvRun]]) -> None:
    name, settings, out = runs
    if "warm" not in out:
        pytest.skip(f"{name}: the hit path is podman's (runsc here, runc in test_env_python)")
    cold, warm = out["cold"], out["warm"]
    assert warm.info.status == "done", (name, warm.info.error)
    setup = warm.result.report["setup"]
    assert setup["cache"] == "hit" and setup["ran"] is False and setup["egress"] is None
    assert setup["key"] == cold.result.report["setup"]["key"]
    assert not (warm.task_dir / "logs" / "setup.log").exists()
    assert "2 passed" in warm.agent_log()
    info = EnvStore(settings).get(setup["key"])
    assert info is not None and info.uses >= 2
