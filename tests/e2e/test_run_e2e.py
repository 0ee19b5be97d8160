"""End to end: the real Claude Code binary in the hardened podman sandbox, through the
task's own gateway, driven by replay scripts; the result is a branch in a real repo.

One launcher runs every task of this module at once (it is also the concurrency
test): a task that edits files, one that creates files and runs the repo's tests
(the built-in ``replay-demo``), one that overruns its budget, one that hits its
deadline, one that plants the git-attack corpus in its workspace, and one whose
agent only answers in text (no changes: no branch).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.gateway import DEMO_SCRIPT, read_usage
from agentbox.launcher import Launcher, TaskInfo, TaskRequest, TaskResult
from git_helpers import git

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "demo" / "sample-repo"
EDIT_SCRIPT = ROOT / "demo" / "replay-edit.yaml"
NONCE = secrets.token_hex(6)
#: Host path every planted hook/filter/pager would touch if it ever ran on the host.
SENTINEL = f"/tmp/agentbox-sentinel-{NONCE}"

BUDGET_SCRIPT = """\
name: budget
turns:
  - text: "Writing the first part."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/partial.txt", content: "written before the budget ran out\\n"}
    usage: {input_tokens: 960000, output_tokens: 10}
  - text: "Writing the second part."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/never.txt", content: "never\\n"}
  - text: "Done."
"""

NOCHANGE_SCRIPT = """\
name: nochange
turns:
  - text: "The code already does what you ask; there is nothing to change."
"""

DEADLINE_S = 45.0

DEADLINE_SCRIPT = """\
name: deadline
turns:
  - text: "First a file, then a long command."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/partial.txt", content: "written before the deadline\\n"}
  - tool_use:
      - name: Bash
        input:
          command: "python3 -c 'import time; time.sleep(300)'"
          description: "Wait a long time"
          timeout: 600000
  - text: "Done."
"""

# Every command runs INSIDE the sandbox (Claude Code's Bash tool). Each planted
# trap would touch SENTINEL-<what> if git or a tool on the host ever ran it.
ATTACK_COMMANDS = r"""
set -u
S=__SENTINEL__
cd /workspace
for h in pre-commit post-commit post-checkout post-index-change reference-transaction \
         pre-auto-gc post-merge fsmonitor-watchman pre-push; do
  printf '#!/bin/sh\ntouch %s-hook-%s\n' "$S" "$h" > .git/hooks/$h; chmod +x .git/hooks/$h
done
mkdir -p evilhooks && cp .git/hooks/pre-commit evilhooks/pre-commit
git config core.hooksPath /workspace/evilhooks
git config core.fsmonitor "touch $S-fsmonitor; false"
git config filter.evil.clean "touch $S-clean; cat"
git config filter.evil.smudge "touch $S-smudge; cat"
git config filter.evil.process "touch $S-process"
git config diff.external "touch $S-diffext"
git config diff.evil.textconv "touch $S-textconv; cat"
git config core.pager "touch $S-pager; cat"
git config include.path /etc/agentbox-evil.inc
git config core.sshCommand "touch $S-ssh"
printf '* filter=evil diff=evil\n' > .gitattributes
mkdir -p .git/objects/info && echo /var/lib/agentbox > .git/objects/info/alternates
ln -s /etc/shadow shadow-link
ln -s / root-link
ln -s ../../../../../../etc/passwd climb-link
echo payload > normal.txt
ln normal.txt hardlink.txt
mkfifo fifo
mknod dev-null c 1 3 2>/dev/null || echo "mknod refused (no CAP_MKNOD)"
cp /bin/true setuid-true && chmod 4755 setuid-true || true
mkdir embedded && git -C embedded init -q && echo x > embedded/x && \
  git -C embedded add x && git -C embedded -c user.name=a -c user.email=a@b commit -qm x
mkdir gitfile && printf 'gitdir: /etc\n' > gitfile/.git
touch "$(printf 'new\nline')" "$(printf 'ctrl\001char')"
truncate -s 64G huge.sparse
git status >/dev/null 2>&1 || true
git -c user.name=a -c user.email=a@b commit -q --allow-empty -m x >/dev/null 2>&1 || true
echo "inside: $(ls /tmp | grep agentbox-sentinel | tr '\n' ' ')"
echo planted
"""

ATTACK_SCRIPT_TEMPLATE = """\
name: attack
turns:
  - text: "Planting."
    tool_use:
      - name: Bash
        input:
          command: {command}
          description: "Plant the git attack corpus"
  - match: "planted"
    text: "Planted everything."
"""


def _yaml_str(s: str) -> str:
    import json

    return json.dumps(s)  # a JSON string is a valid YAML scalar


@dataclass
class Run:
    info: TaskInfo
    result: TaskResult
    repo: Path


def _make_repo(path: Path) -> Path:
    shutil.copytree(SAMPLE, path)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "sample")
    return path


@pytest.fixture(scope="module")
def e2e() -> Iterator[tuple[Settings, dict[str, Run]]]:
    from agentbox.image import build_default

    build_default(Settings())
    base = Path(tempfile.mkdtemp(prefix="agentbox-e2e-", dir="/var/tmp"))
    base.chmod(0o711)
    scripts = base / "scripts"
    scripts.mkdir()
    (scripts / "budget.yaml").write_text(BUDGET_SCRIPT)
    (scripts / "deadline.yaml").write_text(DEADLINE_SCRIPT)
    (scripts / "nochange.yaml").write_text(NOCHANGE_SCRIPT)
    (scripts / "attack.yaml").write_text(
        ATTACK_SCRIPT_TEMPLATE.format(
            command=_yaml_str(ATTACK_COMMANDS.replace("__SENTINEL__", SENTINEL))
        )
    )
    (base / "models.toml").write_text(
        f"""
[models.replay-demo]
kind = "replay"
upstream = "{DEMO_SCRIPT}"
[models.replay-edit]
kind = "replay"
upstream = "{EDIT_SCRIPT}"
[models.replay-edit.price]
input = 3.0
output = 15.0
cache_write = 3.75
cache_read = 0.3
[models.replay-budget]
kind = "replay"
upstream = "scripts/budget.yaml"
[models.replay-deadline]
kind = "replay"
upstream = "scripts/deadline.yaml"
[models.replay-attack]
kind = "replay"
upstream = "scripts/attack.yaml"
[models.replay-nochange]
kind = "replay"
upstream = "scripts/nochange.yaml"
"""
    )
    (base / "data").mkdir()
    (base / "repos").mkdir()
    settings = Settings(
        data_dir=base / "data", repos_root=base / "repos", models_file=base / "models.toml"
    )
    plan: dict[str, tuple[str, dict[str, Any]]] = {
        "edit": ("replay-edit", {}),
        "create": ("replay-demo", {}),
        # 960k charged by the first turn: the ~40k left cannot hold the next call's input
        # estimate plus 2,048 output tokens, so it is refused, not clamped.
        "budget": ("replay-budget", {"budget": 1_000_000}),
        # Long enough for Claude Code to start and write partial.txt with seven tasks
        # starting at once on a loaded 2-core host (20 s was not: init came at 20 s).
        "deadline": ("replay-deadline", {"deadline": DEADLINE_S}),
        "attack": ("replay-attack", {}),
        "cancel": ("replay-deadline", {}),
        "nochange": ("replay-nochange", {}),
    }
    launcher = Launcher(settings, max_tasks=len(plan))
    runs: dict[str, Run] = {}
    env_files.clear()
    env_before = _env_traces(None)
    try:
        ids = {}
        for name, (model, extra) in plan.items():
            repo = _make_repo(settings.repos_root / name)
            dirty = name == "budget"  # this one also carries uncommitted work in
            if dirty:
                (repo / "README.md").write_text("uncommitted edit\n")
                (repo / "dirty.txt").write_text("untracked file\n")
            req = TaskRequest(
                repo=str(repo), task=f"e2e {name}: do the scripted work", model=model,
                deadline=extra.get("deadline", 300.0), budget=extra.get("budget"),
                task_id=f"e2e-{name}-{NONCE}", include_uncommitted=dirty,
            )  # fmt: skip
            # One task goes through a Boxfile (the CLI's --boxfile): smaller limits, a set var.
            box = (
                Boxfile.from_dict(
                    {"resources": {"cpus": 1, "memory": "1GiB"}, "env": {"set": {"E2E": "1"}}}
                )
                if name == "create"
                else None
            )
            ids[name] = (launcher.submit(req, boxfile=box).id, repo)
        # Cancel one task once its agent wrote a file and is in its long command.
        cancel_id = ids["cancel"][0]
        usage = settings.data_dir / "tasks" / cancel_id / "usage.json"
        for _ in range(600):
            # While sandboxes run: their environments (one-time tokens) are never on disk.
            env_files.update(_env_traces(settings.data_dir))
            with contextlib.suppress(Exception):
                if read_usage(usage).requests >= 2:
                    break
            time.sleep(0.5)
        time.sleep(1.0)
        launcher.cancel(cancel_id)
        for name, (task_id, repo) in ids.items():
            info = launcher.wait(task_id, timeout=600)
            runs[name] = Run(info, launcher.result(task_id), repo)
        env_files.update(_env_traces(settings.data_dir))
        yield settings, runs
    finally:
        launcher.close()
        env_files.difference_update(env_before)
        for p in Path("/tmp").glob(f"agentbox-sentinel-{NONCE}*"):
            p.unlink()
        if not os.environ.get("E2E_KEEP_DIRS"):
            shutil.rmtree(base, ignore_errors=True)


#: Every ``agentbox-env*`` path seen while the module's tasks ran (it must stay empty).
env_files: set[Path] = set()


def _env_traces(data_dir: Path | None) -> set[Path]:
    found = set(Path(tempfile.gettempdir()).glob("agentbox-env*"))
    if data_dir is not None:
        # os.walk skips what vanishes under it; the agents' workspaces are theirs, not ours.
        for top, dirs, files in os.walk(data_dir):
            dirs[:] = [d for d in dirs if d not in ("workspace", "shadow.git")]
            found |= {Path(top, n) for n in dirs + files if n.startswith("agentbox-env")}
    return found


def _files(run: Run) -> list[str]:
    return git(run.repo, "ls-tree", "-r", "--name-only", "-z", run.result.branch).split("\0")


def test_a_task_that_edits_files(e2e: tuple[Settings, dict[str, Run]]) -> None:
    run = e2e[1]["edit"]
    assert run.info.status == "done", run.info.error
    assert run.info.exit_code == 0
    assert run.result.branch == run.info.branch == f"agentbox/{run.info.id}"
    core = git(run.repo, "show", f"{run.result.branch}:calc/core.py")
    assert "def multiply(a: float, b: float) -> float:" in core
    assert "test_multiply" in git(run.repo, "show", f"{run.result.branch}:tests/test_core.py")
    assert "+def multiply" in run.result.diff
    # The agent's tests ran inside the sandbox and passed (its last message says so).
    assert "passes" in run.result.report["final_message"]
    # The parent is the base commit; the user's checkout is untouched.
    assert (
        git(run.repo, "rev-parse", f"{run.result.branch}^").strip()
        == git(run.repo, "rev-parse", "main").strip()
    )
    assert git(run.repo, "status", "--porcelain") == ""
    # Tokens come from the gateway's usage file.
    assert run.info.tokens.input > 0 and run.info.tokens.output > 0
    assert run.result.report["tokens"]["input"] == run.info.tokens.input
    # Issue 27: a model registered with prices costs its metered tokens times them.
    t = run.info.tokens
    want = (t.input * 3 + t.output * 15 + t.cache_creation * 3.75 + t.cache_read * 0.3) / 1e6
    assert t.cost_usd == pytest.approx(want) and want > 0
    assert run.result.report["cost_usd"] == pytest.approx(want)
    assert run.result.report["model_scripted"] is True  # a replay model, said so
    assert "scripted" in run.result.report["model_note"]


def test_a_task_that_creates_files_and_runs_the_tests(e2e: tuple[Settings, dict[str, Run]]) -> None:
    settings, runs = e2e
    run = runs["create"]
    assert run.info.status == "done", run.info.error
    files = _files(run)
    assert "textutil.py" in files and "test_textutil.py" in files
    assert not any("__pycache__" in f for f in files)
    assert run.result.report["diffstat"]["files_changed"] == 2
    # The agent ran the tests in the sandbox: the test output is in its log.
    log = (settings.data_dir / "tasks" / run.info.id / "logs" / "agent.jsonl").read_text()
    assert "Ran 2 tests" in log and "OK" in log


def test_a_task_that_overruns_its_budget(e2e: tuple[Settings, dict[str, Run]]) -> None:
    run = e2e[1]["budget"]
    assert run.info.status == "failed"
    assert "budget exhausted" in (run.info.error or "")
    usage = run.result.report["usage"]
    assert usage["exhausted"] is True
    assert sum(usage["refusals"].values()) >= 1  # the gateway answered 403
    assert run.result.report["refused"]
    # The partial result is kept: the first file was collected, the second never written.
    files = _files(run)
    assert "partial.txt" in files and "never.txt" not in files
    # include_uncommitted: the user's uncommitted work was in the workspace and is in
    # the result; the user's own checkout still has it uncommitted.
    assert "dirty.txt" in files
    assert git(run.repo, "show", f"{run.result.branch}:README.md") == "uncommitted edit\n"
    assert sorted(git(run.repo, "status", "--porcelain").split("\n")) == [
        "",
        " M README.md",
        "?? dirty.txt",
    ]


def test_a_task_that_hits_its_deadline(e2e: tuple[Settings, dict[str, Run]]) -> None:
    run = e2e[1]["deadline"]
    assert run.info.status == "timed_out", run.info.error
    assert run.info.finished_at is not None and run.info.started_at is not None
    assert run.info.finished_at - run.info.started_at < DEADLINE_S + 60.0
    assert "partial.txt" in _files(run)
    # Removed after the task ended, off its path (backends/podman/_removals.py): a bound
    # for a hang, not a speed target.
    end = time.monotonic() + 60
    while True:
        out = subprocess.run(
            ["podman", "ps", "-a", "--filter", f"name=agentbox-task-{run.info.id}", "-q"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        if not out.strip() or time.monotonic() > end:
            break
        time.sleep(0.5)
    assert out.strip() == ""


def test_the_git_attack_corpus_through_a_real_sandbox(e2e: tuple[Settings, dict[str, Run]]) -> None:
    settings, runs = e2e
    run = runs["attack"]
    assert run.info.status == "done", run.info.error
    log = (settings.data_dir / "tasks" / run.info.id / "logs" / "agent.jsonl").read_text()
    assert "planted" in log
    # Positive control: the planted config is live: git inside the sandbox ran the
    # fsmonitor and the filter process (they touched the sentinel in the sandbox's
    # own /tmp, a tmpfs), so the same traps would fire if git on the host read them.
    assert f"agentbox-sentinel-{NONCE}-fsmonitor" in log
    assert f"agentbox-sentinel-{NONCE}-process" in log
    notes = {s["path"] for s in run.result.report["notes"]}
    assert "setuid-true" in notes
    branch = run.result.branch
    files = _files(run)
    # The agent's .git is never collected; links are links, never their targets.
    assert not any(f == ".git" or f.startswith(".git/") for f in files)
    tree = git(run.repo, "ls-tree", "-r", branch)
    for link in ("shadow-link", "root-link", "climb-link"):
        assert "120000 blob" in next(line for line in tree.splitlines() if line.endswith(link))
    assert git(run.repo, "cat-file", "-p", f"{branch}:shadow-link") == "/etc/shadow"
    assert "root:" not in run.result.diff
    # FIFOs and the huge sparse file are skipped and reported; setuid bits dropped.
    skipped = {s["path"] for s in run.result.report["skipped"]}
    assert "fifo" in skipped and "fifo" not in files
    assert "huge.sparse" in skipped and "huge.sparse" not in files
    assert "100755 blob" in next(ln for ln in tree.splitlines() if ln.endswith("setuid-true"))
    # Git work on the host after publishing runs none of the planted commands.
    git(run.repo, "diff", "main", branch)
    git(run.repo, "log", "-p", "-1", branch)
    git(run.repo, "fsck", "--no-dangling")
    assert list(Path("/tmp").glob(f"agentbox-sentinel-{NONCE}*")) == []
    # The user's repo config was not touched by the agent's config.
    assert "evil" not in (run.repo / ".git" / "config").read_text()


def test_a_task_cancelled_while_running(e2e: tuple[Settings, dict[str, Run]]) -> None:
    run = e2e[1]["cancel"]
    assert run.info.status == "cancelled", run.info.error
    assert run.info.finished_at is not None and run.info.started_at is not None
    assert run.info.finished_at - run.info.started_at < 120
    # What the agent wrote before the cancel is collected and published.
    assert "partial.txt" in _files(run)


def test_a_task_that_changes_nothing_publishes_no_branch(
    e2e: tuple[Settings, dict[str, Run]],
) -> None:
    settings, runs = e2e
    run = runs["nochange"]
    assert run.info.status == "done", run.info.error
    assert run.info.exit_code == 0
    assert run.info.changed is False and run.result.changed is False
    assert run.info.branch is None and run.result.branch == "" and run.result.commit == ""
    assert run.result.diff == ""
    report = run.result.report
    assert report["changed"] is False and report["branch"] is None and report["commit"] is None
    assert report["diffstat"]["files_changed"] == 0
    assert "nothing to change" in report["final_message"]
    # A model registered without prices: its cost is unknown, never $0.
    assert report["cost_usd"] is None and run.info.tokens.cost_usd is None
    # No branch in the user's repo, and nothing else there changed.
    assert git(run.repo, "for-each-ref", "--format=%(refname)") == "refs/heads/main\n"
    assert git(run.repo, "status", "--porcelain") == ""
    # The CLI says it plainly, for `show` and in the task list.
    env = {"PATH": os.environ["PATH"], "AGENTBOX_DATA_DIR": str(settings.data_dir),
           "AGENTBOX_CONFIG": "/nonexistent", "COLUMNS": "200"}  # fmt: skip
    cli = [sys.executable, "-m", "agentbox"]
    shown = subprocess.run([*cli, "show", run.info.id], capture_output=True, text=True,
                           env=env, timeout=120, check=True).stdout  # fmt: skip
    assert "no changes: the agent left every file as it was, so no branch was made" in shown
    assert "(no changes)" in shown  # the diff
    listed = subprocess.run([*cli, "tasks"], capture_output=True, text=True, env=env,
                            timeout=120, check=True).stdout  # fmt: skip
    assert "(no changes)" in next(ln for ln in listed.splitlines() if run.info.id in ln)


def test_no_environment_file_appeared_on_disk(e2e: tuple[Settings, dict[str, Run]]) -> None:
    """Sandboxes get their environment (the one-time gateway token) from a memfd only."""
    assert env_files == set()
