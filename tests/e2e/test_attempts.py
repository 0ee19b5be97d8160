"""Best-of-N end to end: ``agentbox run --attempts 3 --json`` with the real Claude Code in
podman, each attempt through its own gateway, driven by one replay script whose attempts
differ: the agent echoes ``$AGENTBOX_ATTEMPT`` (set by the launcher in each attempt's
sandbox) and the script branches on it: attempt 1 writes a wrong fix (its tests fail),
attempt 2 the right fix, attempt 3 the right fix with more lines. The pick is attempt 2
(tests passed, then the smallest diff), published as ``agentbox/<group>``; every attempt
also exists as ``agentbox/<group>-aK``. Then ``show GROUP`` and ``publish GROUP --pick 3``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbox.config import Settings
from git_helpers import git

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

MODULE = "def double(x: int) -> int:\n    return x * 3\n"
TESTS = (
    "import unittest\n\nfrom mathx import double\n\n\n"
    "class T(unittest.TestCase):\n    def test_double(self) -> None:\n"
    "        self.assertEqual(double(2), 4)\n        self.assertEqual(double(5), 10)\n"
)

SCRIPT = r"""
name: attempts
turns:
  - text: "Which attempt am I, and what does the module say?"
    tool_use:
      - name: Bash
        input: {command: "echo attempt-number-$AGENTBOX_ATTEMPT", description: "Attempt"}
      - name: Read
        input: {file_path: "{{cwd}}/mathx.py"}
  - branches:
      - match: "attempt-number-1\\b"
        text: "Fixing it (wrongly)."
        tool_use:
          - name: Edit
            input: {file_path: "{{cwd}}/mathx.py", old_string: "x * 3", new_string: "x + 2"}
      - match: "attempt-number-2\\b"
        text: "Fixing it."
        tool_use:
          - name: Edit
            input: {file_path: "{{cwd}}/mathx.py", old_string: "x * 3", new_string: "x * 2"}
      - match: "attempt-number-3\\b"
        text: "Fixing it, with a docstring."
        tool_use:
          - name: Edit
            input:
              file_path: "{{cwd}}/mathx.py"
              old_string: "    return x * 3\n"
              new_string: "    \"\"\"Twice x.\n\n    Doubles it.\n    \"\"\"\n    return x * 2\n"
  - text: "Running the tests."
    tool_use:
      - name: Bash
        input: {command: "cd {{cwd}} && python3 -m unittest -v 2>&1", description: "Tests"}
  - text: "Done."
"""


@pytest.fixture(scope="module")
def lab() -> Iterator[tuple[Path, dict[str, str]]]:
    from agentbox.image import build_default

    build_default(Settings())
    base = Path(tempfile.mkdtemp(prefix="agentbox-e2e-attempts-", dir="/var/tmp"))
    base.chmod(0o711)
    for sub in ("data", "repos"):
        (base / sub).mkdir()
    (base / "script.yaml").write_text(SCRIPT)
    (base / "models.toml").write_text(
        f'[models.replay-attempts]\nkind = "replay"\nupstream = "{base / "script.yaml"}"\n'
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
        "COLUMNS": "200",
    }
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    try:
        yield base, env
    finally:
        if not os.environ.get("E2E_KEEP_DIRS"):
            shutil.rmtree(base, ignore_errors=True)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentbox", *args],
        env=env, capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip


def _json(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"not JSON (rc {r.returncode}):\n{r.stdout}\n{r.stderr}") from None
    assert isinstance(doc, dict)
    return doc


def test_best_of_three_picks_the_passing_attempt(lab: tuple[Path, dict[str, str]]) -> None:
    base, env = lab
    repo = base / "repos" / "proj"
    repo.mkdir()
    (repo / "mathx.py").write_text(MODULE)
    (repo / "test_mathx.py").write_text(TESTS)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "bug")
    task = "Fix double(): its tests must pass."
    r = _cli(env, "run", "--repo", str(repo), "--model", "replay-attempts", "--attempts", "3",
             "--budget", "3000000", "--id", "bo3", "--json", task)  # fmt: skip
    doc = _json(r)
    assert r.returncode == 0, (doc, r.stderr[-3000:])
    assert doc["group"] == "bo3" and [a["id"] for a in doc["attempts"]] == [
        "bo3-a1",
        "bo3-a2",
        "bo3-a3",
    ]
    by = {a["attempt"]: a for a in doc["attempts"]}
    assert all(a["status"] == "done" for a in by.values()), doc
    # Each attempt ran its tests in its own sandbox: 1 failed, 2 and 3 passed.
    assert [by[k]["tests_passed"] for k in (1, 2, 3)] == [False, True, True], doc
    assert by[1]["test_exit"] != 0 and "unittest" in by[1]["test_command"]
    assert by[3]["diff_lines"] > by[2]["diff_lines"]
    assert all(by[k]["tokens"]["input"] > 0 for k in (1, 2, 3))
    # The pick: tests passed, then the smallest diff.
    assert doc["pick"] == 2 and doc["pick_id"] == "bo3-a2" and doc["branch"] == "agentbox/bo3"
    for k in (1, 2, 3):
        assert by[k]["branch"] == f"agentbox/bo3-a{k}"
    picked = git(repo, "rev-parse", "agentbox/bo3").strip()
    assert picked == git(repo, "rev-parse", "agentbox/bo3-a2").strip()
    assert "x * 2" in git(repo, "show", "agentbox/bo3:mathx.py")
    assert "x + 2" in git(repo, "show", "agentbox/bo3-a1:mathx.py")
    # Split budget: each attempt had a third of the group's.
    tasks = _json(_cli(env, "show", "bo3-a1", "--json", "--no-diff"))
    assert tasks["task"]["budget"] == 1_000_000 and tasks["task"]["group"] == "bo3"

    # show GROUP: the comparison table.
    shown = _cli(env, "show", "bo3")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert any("bo3-a1" in ln and "FAIL" in ln for ln in lines), shown.stdout
    assert any("bo3-a2" in ln and "pass" in ln for ln in lines), shown.stdout
    assert "pick: attempt 2" in shown.stdout

    # publish GROUP --pick 3 moves agentbox/bo3 (a ref agentbox wrote) to attempt 3.
    moved = _json(_cli(env, "publish", "bo3", "--pick", "3", "--json"))
    assert moved == {"group": "bo3", "pick": 3, "id": "bo3-a3", "branch": "agentbox/bo3"}
    assert git(repo, "rev-parse", "agentbox/bo3") == git(repo, "rev-parse", "agentbox/bo3-a3")
    assert "Twice x" in git(repo, "show", "agentbox/bo3:mathx.py")
    # Nothing of the attempts is left running.
    left = subprocess.run(
        ["podman", "ps", "-a", "--filter", "name=bo3-a", "--format", "{{.Names}}"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    assert left == "", left


BOXFILE = """\
[setup]
run = ["mkdir -p toolchain && echo built > toolchain/marker"]
"""


def test_a_group_sets_up_once(lab: tuple[Path, dict[str, str]]) -> None:
    """Two attempts with a [setup]: the first builds and freezes the environment, the
    second reuses it (the group's setups run one at a time; without that both miss)."""
    base, env = lab
    repo = base / "repos" / "withsetup"
    repo.mkdir()
    (repo / "mathx.py").write_text(MODULE)
    (repo / "test_mathx.py").write_text(TESTS)
    (repo / ".gitignore").write_text("toolchain/\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "bug")
    (base / "Boxfile.toml").write_text(BOXFILE)
    r = _cli(env, "run", "--repo", str(repo), "--model", "replay-attempts", "--attempts", "2",
             "--boxfile", str(base / "Boxfile.toml"), "--id", "su2", "--json",
             "Fix double().")  # fmt: skip
    doc = _json(r)
    assert doc["pick"] == 2, (doc, r.stderr[-3000:])
    caches, keys = [], set()
    for k in (1, 2):
        shown = _json(_cli(env, "show", f"su2-a{k}", "--json", "--no-diff"))
        setup = shown["result"]["report"]["setup"]
        caches.append(setup["cache"])
        keys.add(setup["key"])
    from agentbox.env import EnvStore

    store = EnvStore(Settings())  # the host's cache: remove this test's environment only
    for key in keys:
        store.remove(key, force=True)
    assert sorted(caches) == ["hit", "miss"], caches
    assert len(keys) == 1, keys


def test_a_detached_group_is_picked_by_the_service(lab: tuple[Path, dict[str, str]]) -> None:
    """``run --attempts 2 --detach``: the launcher service runs the group and, when the
    last attempt ends, publishes the pick as agentbox/GROUP by itself."""
    import time

    base, env = lab
    repo = base / "repos" / "detached"
    repo.mkdir()
    (repo / "mathx.py").write_text(MODULE)
    (repo / "test_mathx.py").write_text(TESTS)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "bug")
    try:
        r = _cli(env, "run", "--repo", str(repo), "--model", "replay-attempts", "--attempts",
                 "2", "--detach", "--id", "dg2", "--json", "Fix double().")  # fmt: skip
        assert _json(r) == {"group": "dg2", "attempts": ["dg2-a1", "dg2-a2"]}, r.stderr
        waited = _cli(env, "wait", "dg2-a1", "dg2-a2")
        assert waited.returncode == 0, waited.stdout + waited.stderr
        view: dict[str, Any] = {}
        for _ in range(120):  # the pick is published just after the last attempt ends
            view = _json(_cli(env, "show", "dg2", "--json"))
            if view.get("branch"):
                break
            time.sleep(0.5)
        assert view["pick"] == 2 and view["branch"] == "agentbox/dg2", view
        assert git(repo, "rev-parse", "agentbox/dg2") == git(repo, "rev-parse", "agentbox/dg2-a2")
    finally:
        _cli(env, "launcher", "stop")


#: Every turn of SHARED_SCRIPT declares this many input tokens (below the gateway's
#: estimate of a Claude Code request, ~50 KB of body: the ledger's invariant holds).
SHARED_TURN_INPUT = 30_000
SHARED_SCRIPT = f"""
name: greedy
turns:
  - text: "Looking."
    usage: {{input_tokens: {SHARED_TURN_INPUT}, output_tokens: 20}}
    tool_use:
      - name: Read
        input: {{file_path: "{{{{cwd}}}}/mathx.py"}}
  - text: "Fixing it."
    usage: {{input_tokens: {SHARED_TURN_INPUT}, output_tokens: 20}}
    tool_use:
      - name: Edit
        input: {{file_path: "{{{{cwd}}}}/mathx.py", old_string: "x * 3", new_string: "x * 2"}}
  - text: "Running the tests."
    usage: {{input_tokens: {SHARED_TURN_INPUT}, output_tokens: 20}}
    tool_use:
      - name: Bash
        input: {{command: "cd {{{{cwd}}}} && python3 -m unittest -v 2>&1", description: "Tests"}}
  - text: "Done."
    usage: {{input_tokens: {SHARED_TURN_INPUT}, output_tokens: 20}}
"""


def test_a_shared_budget_is_never_passed_by_the_group(lab: tuple[Path, dict[str, str]]) -> None:
    """``--budget-split shared``: two attempts that each want ~120k tokens (240k together)
    draw from one 180k budget. Each gateway is given the whole 180k and charges the
    group's ledger under its lock: the attempts' totals together stay within 180k, and
    the gateways refused what would have passed it."""
    from agentbox.core.paths import TaskPaths
    from agentbox.gateway import read_usage

    base, env = lab
    (base / "greedy.yaml").write_text(SHARED_SCRIPT)
    models = base / "models-greedy.toml"
    models.write_text(f'[models.greedy]\nkind = "replay"\nupstream = "{base / "greedy.yaml"}"\n')
    repo = base / "repos" / "shared"
    repo.mkdir()
    (repo / "mathx.py").write_text(MODULE)
    (repo / "test_mathx.py").write_text(TESTS)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "bug")
    budget = 180_000
    wanted = 2 * 4 * SHARED_TURN_INPUT
    assert wanted > budget  # the two attempts would overspend
    r = _cli({**env, "AGENTBOX_MODELS_FILE": str(models)}, "run", "--repo", str(repo),
             "--model", "greedy", "--attempts", "2", "--budget-split", "shared", "--budget",
             str(budget), "--id", "sh2", "--json", "Fix double().")  # fmt: skip
    doc = _json(r)
    assert doc["budget_split"] == "shared", (doc, r.stderr[-3000:])
    data = Path(env["AGENTBOX_DATA_DIR"])
    totals, refused = [], 0
    for k in (1, 2):
        shown = _json(_cli(env, "show", f"sh2-a{k}", "--json", "--no-diff"))
        assert shown["task"]["budget"] == budget  # each gateway had the group's budget
        usage = read_usage(TaskPaths(data, f"sh2-a{k}").usage_file)
        assert usage.reserved == 0
        totals.append(usage.weighted_total)
        refused += sum(usage.refusals.get(w, 0) for w in ("over_budget", "budget_exhausted"))
    print(f"shared budget {budget}: attempts charged {totals}, {refused} refused")
    assert sum(totals) <= budget, totals
    assert doc["group_spent"] is not None and abs(doc["group_spent"] - sum(totals)) < 1, doc
    assert sum(totals) > 0, totals
    shown = _cli(env, "show", "sh2")
    assert "budget shared by the attempts" in shown.stdout, shown.stdout
    assert refused >= 1, totals  # and what would have passed it was refused
