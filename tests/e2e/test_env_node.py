"""End to end (issue 12): a Node project. ``npm ci`` in ``[setup]`` through the egress proxy
from the registry this host's npm uses; the real Claude Code (replay script) runs ``npm test``
in the agent phase with no network; ``node_modules`` never reaches the branch.

The image adds Node.js and npm to the default image. Issue 12 asks for an image built from a
Containerfile with Debian's ``nodejs``; that build path (``agentbox image build
--containerfile``) is another helper's, so this test copies the host's own ``node`` binary and
npm into a derived image instead: what setup and the agent see is the same.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.config import DEFAULT_IMAGE, Settings
from agentbox.env import EnvStore
from agentbox.launcher import Launcher, TaskInfo, TaskRequest, TaskResult
from git_helpers import git

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
]

NONCE = secrets.token_hex(4)
IMAGE = f"localhost/agentbox-test-node:{NONCE}"
NODE = Path("/usr/bin/node")
NPM = Path("/usr/lib/node_modules/npm")

PACKAGE = """\
{"name": "nodeproj", "version": "1.0.0", "private": true,
 "scripts": {"test": "node test.js"}, "dependencies": {"is-number": "7.0.0"}}
"""
LOCK = """\
{
  "name": "nodeproj",
  "version": "1.0.0",
  "lockfileVersion": 3,
  "requires": true,
  "packages": {
    "": {"name": "nodeproj", "version": "1.0.0", "dependencies": {"is-number": "7.0.0"}},
    "node_modules/is-number": {
      "version": "7.0.0",
      "integrity": "__INTEGRITY__",
      "license": "MIT",
      "engines": {"node": ">=0.12.0"}
    }
  }
}
"""
INTEGRITY = (
    "sha512-41Cifkg6e8TylSpdtTpeLVMqvSBEVzTttHvERD741+pnZ8ANv0004M"
    "RL43QKPDlK9cGvNp6NZWZUBlbGXYxxng=="
)
TEST_JS = """\
const isNumber = require("is-number");
if (!isNumber(5) || isNumber("x")) { console.error("is-number broken"); process.exit(1); }
console.log("node tests: " + ["ok", "ok"].length + " passed");
"""
BOXFILE = f"""\
image = "{IMAGE}"

[setup]
run = ["npm ci --no-audit --no-fund"]
inputs = ["package.json", "package-lock.json"]
network = "registries"
deadline = 600
"""
SCRIPT = """\
name: env-node
turns:
  - text: "Running the project's tests."
    tool_use:
      - name: Bash
        input:
          command: "npm test 2>&1; echo NPM-EXIT=$?"
          description: "Run npm test"
  - text: "Noting it."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/NOTES.md", content: "npm test ran\\n"}
  - text: "Done."
"""


def _build_image(ctx: Path) -> None:
    if not NODE.is_file() or not (NPM / "bin" / "npm-cli.js").is_file():
        pytest.skip("the host has no node and npm to add to the test image")
    ctx.mkdir()
    shutil.copy(NODE, ctx / "node")
    shutil.copytree(NPM, ctx / "npm", symlinks=True)
    launcher = ctx / "npm-launcher"
    launcher.write_text(
        '#!/bin/sh\nexec /usr/bin/node /usr/lib/node_modules/npm/bin/npm-cli.js "$@"\n'
    )
    launcher.chmod(0o755)
    # No RUN step: podman build's own container cannot start on this host's hybrid cgroups.
    (ctx / "Containerfile").write_text(
        f"FROM {DEFAULT_IMAGE}\nUSER 0\n"
        "COPY node /usr/bin/node\nCOPY npm/ /usr/lib/node_modules/npm/\n"
        "COPY npm-launcher /usr/bin/npm\nUSER 64000\n"
    )
    subprocess.run(["podman", "build", "-q", "-t", IMAGE, str(ctx)], check=True)


@pytest.fixture(scope="module")
def run() -> Iterator[tuple[Settings, TaskInfo, TaskResult, Path]]:
    from agentbox.image import build_default

    build_default(Settings())
    base = Path(tempfile.mkdtemp(prefix="agentbox-env-node-", dir="/var/tmp"))
    base.chmod(0o711)
    key = None
    try:
        _build_image(base / "ctx")
        (base / "script.yaml").write_text(SCRIPT)
        (base / "models.toml").write_text(
            f'[models.replay-node]\nkind = "replay"\nupstream = "{base / "script.yaml"}"\n'
        )
        for sub in ("data", "repos"):
            (base / sub).mkdir()
        settings = Settings(
            data_dir=base / "data", repos_root=base / "repos", models_file=base / "models.toml"
        )
        repo = settings.repos_root / "nodeproj"
        (repo / ".agentbox").mkdir(parents=True)
        (repo / "package.json").write_text(PACKAGE)
        (repo / "package-lock.json").write_text(LOCK.replace("__INTEGRITY__", INTEGRITY))
        (repo / "test.js").write_text(TEST_JS)
        (repo / ".gitignore").write_text("node_modules/\n")
        (repo / ".agentbox" / "Boxfile.toml").write_text(BOXFILE)
        git(repo, "init", "-q", "-b", "main")
        git(repo, "add", "-A")
        git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "node")
        launcher = Launcher(settings)
        try:
            req = TaskRequest(
                repo=str(repo), task="run npm test", model="replay-node", deadline=600.0,
                task_id=f"env-node-{NONCE}",
            )  # fmt: skip
            info = launcher.wait(launcher.submit(req).id, timeout=900)
            res = launcher.result(info.id)
        finally:
            launcher.close()
        key = (res.report.get("setup") or {}).get("key")
        yield settings, info, res, settings.data_dir / "tasks" / info.id
    finally:
        if key:
            EnvStore(Settings()).remove(key, force=True)
        subprocess.run(["podman", "rmi", "-f", IMAGE], check=False, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def test_npm_ci_in_setup_then_npm_test_by_the_agent(
    run: tuple[Settings, TaskInfo, TaskResult, Path],
) -> None:
    _, info, res, task_dir = run
    assert info.status == "done", (info.error, res.report.get("setup"))
    setup = res.report["setup"]
    assert setup["cache"] == "miss" and setup["roots"] == ["node_modules"]
    assert setup["egress"]["allowed"] >= 1
    log = (task_dir / "logs" / "agent.jsonl").read_text(errors="replace")
    assert "node tests: 2 passed" in log and "NPM-EXIT=0" in log
    assert "node_modules" not in res.diff
    assert res.report["diffstat"]["files_changed"] == 1
