"""End to end (issue 12): a Python project's dependencies, installed by ``[setup]`` through
the egress proxy from the registry this host's pip uses, then the real Claude Code
(driven by a replay script) runs ``.venv/bin/pytest`` in the agent phase with no network.

The repo commits its Boxfile at ``.agentbox/Boxfile.toml`` (no ``--boxfile``): it is read
from the commit. Three tasks on the same launcher:

- ``cold``: a miss: setup runs, its proxy log names the registry, the environment is
  frozen; the agent's tests pass; the agent cannot reach the registry; the branch holds
  only the agent's file, never ``.venv``;
- ``warm`` (after ``cold``): a hit: no setup, no proxy, the same tests pass;
- ``changed``: ``requirements.txt`` changed in a new commit: a miss again;
- ``netallow``: ``[network] allow`` naming the index's host (within the host's
  ``egress_allow_cap``): another environment (a miss: setup's egress rules are part of
  the key, issue 33 §2), and the agent phase reaches the host through its own proxy, and
  the report's ``egress`` part says so.

The default image has ``venv`` but no ``ensurepip`` (Debian ships it in python3-venv), so
the test builds the image the how-to describes: a Containerfile ``FROM agentbox-base``
adding ``python3-venv`` (docs/how-to/give-the-agent-dependencies.md).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path

import pytest

from agentbox.boxfile import loads_boxfile
from agentbox.config import Settings
from agentbox.env import EnvStore
from env_helpers import PY_TEST_FILE, EnvLab, EnvRun, pip_index
from git_helpers import git

pytestmark = [pytest.mark.podman, pytest.mark.claude, pytest.mark.slow]

NONCE = secrets.token_hex(4)
IMAGE = f"localhost/agentbox-test-pyvenv:{NONCE}"

SCRIPT = """\
name: env-python
turns:
  - text: "Running the project's tests with its own environment."
    tool_use:
      - name: Bash
        input:
          command: ".venv/bin/pytest -q -p no:cacheprovider 2>&1; echo PYTEST-EXIT=$?"
          description: "Run the tests"
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

#: Try the registry from the agent phase; print whether it answered and how many proxy variables
#: the agent has (the markers are built at run time, so the command text never matches them).
REGISTRY_CMD = (
    "python3 -c 'import urllib.request as u; u.urlopen(\"__INDEX__\", timeout=5)' "
    ">/dev/null 2>&1 && R=REACHED || R=UNREACHABLE; "
    "printf 'REGISTRY-%s proxy-vars=%s\\n' $R $(env | grep -ci _proxy=)"
)

BOXFILE = f"""\
image = "{IMAGE}"

[setup]
run = ["python3 -m venv .venv", ".venv/bin/pip install -q -r requirements.txt"]
inputs = ["requirements.txt"]
network = "registries"
deadline = 600
"""


def _addresses(host: str) -> tuple[str, ...]:
    """``host``'s addresses as /32 (/128) ranges: a Boxfile's name may resolve there (on this
    network the index resolves to a reserved address, as company mirrors do)."""
    import socket

    infos = socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
    return tuple(sorted({f"{i[4][0]}/{32 if i[0] == socket.AF_INET else 128}" for i in infos}))


#: The documented way: a Containerfile FROM agentbox-base adding Debian's python3-venv
#: (venv + ensurepip + pip), built and hardened by ``agentbox image build``.
CONTAINERFILE = (
    "FROM localhost/agentbox-base\n"
    "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "
    "--no-install-recommends python3-venv\n"
)


def _make_repo(lab: EnvLab, name: str, requirements: str = "attrs\npytest\n") -> Path:
    return lab.repo(name, {
        "requirements.txt": requirements, "test_point.py": PY_TEST_FILE,
        ".gitignore": ".venv/\n", ".agentbox/Boxfile.toml": BOXFILE,
    })  # fmt: skip


@pytest.fixture(scope="module")
def runs(env_lab: Callable[..., EnvLab]) -> tuple[Settings, dict[str, EnvRun]]:
    index, index_host = pip_index()
    command = json.dumps(REGISTRY_CMD.replace("__INDEX__", index))  # a JSON string is YAML
    lab = env_lab(
        "env", SCRIPT.replace("__REGISTRY_CMD__", command), max_tasks=2,
        egress_allow_cap=(index_host,), egress_trusted_ranges=_addresses(index_host),
    )  # fmt: skip
    lab.image(CONTAINERFILE, IMAGE)
    out: dict[str, EnvRun] = {}
    repo = _make_repo(lab, "proj")
    out["cold"] = lab.run("env-cold", repo)
    warm = lab.submit("env-warm", repo, 600.0)
    other = _make_repo(lab, "proj2", "attrs\npytest\n# pinned later\n")
    changed = lab.submit("env-changed", other, 600.0)
    out["warm"] = lab.finish(warm, repo, 900)
    # The CLI's --boxfile: the committed one plus [network] allow for the agent phase.
    netbox = loads_boxfile(
        BOXFILE + f'\n[network]\nallow = ["{index_host}"]\n', path=Path("netallow.toml")
    )
    netallow = lab.submit("env-netallow", repo, 600.0, boxfile=netbox)
    out["changed"] = lab.finish(changed, other, 900)
    out["netallow"] = lab.finish(netallow, repo, 900)
    return lab.settings, out


def test_cold_task_runs_setup_through_the_proxy_and_the_agent_runs_the_tests(
    runs: tuple[Settings, dict[str, EnvRun]],
) -> None:
    run = runs[1]["cold"]
    assert run.info.status == "done", (run.info.error, run.result.report.get("setup"))
    setup = run.result.report["setup"]
    assert setup["cache"] == "miss" and setup["ran"] is True and setup["exit_code"] == 0
    assert setup["roots"] == [".venv"] and setup["files"] > 100 and setup["size"] > 1_000_000
    # The setup's only way out was the proxy, and it logged the registry it used.
    egress = setup["egress"]
    assert egress["allowed"] >= 1 and egress["bytes_down"] > 100_000
    assert any(h["allowed"] for h in egress["hosts"])
    log = run.agent_log()
    assert "2 passed" in log and "PYTEST-EXIT=0" in log
    # The agent phase had no [network]: no proxy variables, no way to the registry.
    assert "REGISTRY-UNREACHABLE proxy-vars=0" in log and "REGISTRY-REACHED" not in log
    assert "egress" not in run.result.report
    # The branch holds the agent's change only: never the environment.
    files = git(run.repo, "ls-tree", "-r", "--name-only", run.result.branch).split()
    assert "NOTES.md" in files
    assert not any(f.startswith(".venv") for f in files)
    assert ".venv" not in run.result.diff
    assert run.result.report["diffstat"]["files_changed"] == 1


def test_second_task_is_a_cache_hit_with_no_setup_and_no_proxy(
    runs: tuple[Settings, dict[str, EnvRun]],
) -> None:
    cold, warm = runs[1]["cold"], runs[1]["warm"]
    assert warm.info.status == "done", warm.info.error
    setup = warm.result.report["setup"]
    assert setup["cache"] == "hit" and setup["ran"] is False
    assert setup["key"] == cold.result.report["setup"]["key"]
    assert setup["egress"] is None
    assert not (warm.task_dir / "logs" / "egress-setup.jsonl").exists()
    assert not (warm.task_dir / "logs" / "setup.log").exists()
    log = warm.agent_log()
    assert "2 passed" in log and "REGISTRY-UNREACHABLE" in log
    # Its overlay is gone with the task; the frozen environment is intact.
    assert not (warm.task_dir / "env").exists()
    store = EnvStore(runs[0])
    info = store.get(setup["key"])
    assert info is not None and info.uses >= 2
    assert (store.tree(setup["key"]) / ".venv" / "bin" / "pytest").is_file()


def test_changing_requirements_is_a_miss(runs: tuple[Settings, dict[str, EnvRun]]) -> None:
    cold, changed = runs[1]["cold"], runs[1]["changed"]
    assert changed.info.status == "done", changed.info.error
    setup = changed.result.report["setup"]
    assert setup["cache"] == "miss" and setup["ran"] is True
    assert setup["key"] != cold.result.report["setup"]["key"]
    assert "2 passed" in changed.agent_log()


def test_report_json_carries_the_setup_part(runs: tuple[Settings, dict[str, EnvRun]]) -> None:
    run = runs[1]["cold"]
    data = json.loads((run.task_dir / "report.json").read_text())
    assert data["setup"]["cache"] == "miss"
    assert "+ .venv/bin/pip install" in data["setup"]["output_tail"]


def test_network_allow_gives_the_agent_phase_that_host_through_its_proxy(
    runs: tuple[Settings, dict[str, EnvRun]],
) -> None:
    run = runs[1]["netallow"]
    assert run.info.status == "done", run.info.error
    # Setup too saw the allowed host: another key (issue 33 §2), setup ran again.
    assert run.result.report["setup"]["cache"] == "miss"
    log = run.agent_log()
    assert "2 passed" in log
    assert "REGISTRY-REACHED proxy-vars=" in log and "REGISTRY-UNREACHABLE" not in log
    egress = run.result.report["egress"]
    assert egress["allowed"] >= 1 and egress["denied"] == 0
    assert [h["host"] for h in egress["hosts"]] == [runs[0].egress_allow_cap[0]]
    assert (run.task_dir / "logs" / "egress-agent.jsonl").is_file()
    # What it used (issue 30 §3): its egress is both proxies' bytes; its sandbox ran
    # attached (agent egress) and was sampled all the same.
    setup_egress = run.result.report["setup"]["egress"]
    used = run.result.report["resources"]
    assert used["egress_bytes"] == (
        egress["bytes_up"] + egress["bytes_down"]
        + setup_egress["bytes_up"] + setup_egress["bytes_down"]
    ) > 0, used  # fmt: skip
    assert used["samples"] > 0 and used["cpu_s"] > 0 and used["memory_peak_bytes"] > 0, used
