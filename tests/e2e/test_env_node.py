"""End to end (issue 12): a Node project on podman (runc and runsc) and docker.

The image is built as the how-to says: a Containerfile ``FROM localhost/agentbox-base``
adding Debian's ``nodejs`` and ``npm`` (``agentbox image build --containerfile``).
``npm ci`` runs in ``[setup]`` through the egress proxy from the registry this host's npm
uses; the real Claude Code (replay script) runs ``npm test`` in the agent phase with no
network; ``node_modules`` never reaches the branch.

One task per sandbox kind (podman runc and runsc, docker), all submitted at once;
each repo's ``package.json`` names its kind, so each key differs and each setup really
runs (a miss) in its own sandbox kind.

Not on qemu: under TCG its npm task was most of this module's time (its fixture waits for
every kind), and what qemu has of its own is covered elsewhere: a Containerfile's image
with Debian's Node.js as the VM's root disk
(``integration/test_image_containerfile.py::test_nodejs_image_runs_on_qemu``), and
setup's egress through the guest agent and the frozen environment as a copy-on-write disk
(``test_env_backends.py[qemu]``). npm's proxy settings are the same code on every backend.
Profiled (runc alone, busy host): ``npm ci`` itself takes 10 s; building the image
(Debian's ``npm`` brings some 300 packages) is most of the fixture.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

import pytest

from env_helpers import BACKEND_HEADS, EnvLab, EnvRun, require_backend
from git_helpers import git

pytestmark = [
    pytest.mark.podman,  # the image is built in podman's storage on every backend
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.timeout(3600),
]

NONCE = secrets.token_hex(4)
KINDS = ("runc", "runsc", "docker")
#: Debian's Node.js and npm on the base image (docs/how-to/give-the-agent-dependencies.md).
CONTAINERFILE = (
    "FROM localhost/agentbox-base\n"
    "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y"
    " --no-install-recommends nodejs npm\n"
)
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
SCRIPT = """\
name: env-node
turns:
  - text: "Running the project's tests."
    tool_use:
      - name: Bash
        input:
          command: "npm test 2>&1; echo NPM-EXIT=$?"
          description: "Run npm test"
          timeout: 600000
  - text: "Noting it."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/NOTES.md", content: "npm test ran\\n"}
  - text: "Done."
"""


def _package(kind: str) -> str:
    return json.dumps({
        "name": "nodeproj", "version": "1.0.0", "private": True,
        "description": f"{kind} {NONCE}",  # a key of its own per sandbox kind
        "scripts": {"test": "node test.js"}, "dependencies": {"is-number": "7.0.0"},
    })  # fmt: skip


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, env_lab: Callable[..., EnvLab]) -> dict[str, EnvRun | str]:
    """Each selected kind's finished task (``-k runsc`` runs that one), or why it was skipped."""
    selected = [
        k for k in KINDS
        if any(getattr(i, "callspec", None) and i.callspec.params.get("kind") == k
               and i.module is request.module for i in request.session.items)
    ]  # fmt: skip
    lab = env_lab("env-node", SCRIPT, max_tasks=len(selected))
    image = lab.image(CONTAINERFILE, f"localhost/agentbox-test-node:{NONCE}")
    out: dict[str, EnvRun | str] = {}
    pending = {}
    for kind in selected:
        try:
            require_backend(kind)
        except pytest.skip.Exception as exc:
            out[kind] = str(exc)
            continue
        boxfile = f'image = "{image}"\n{BACKEND_HEADS[kind]}' + (
            '[setup]\nrun = ["npm ci --no-audit --no-fund"]\n'
            'inputs = ["package.json", "package-lock.json"]\n'
            'network = "registries"\ndeadline = 2400\n'
        )
        repo = lab.repo(f"node-{kind}", {
            "package.json": _package(kind), "test.js": TEST_JS, ".gitignore": "node_modules/\n",
            "package-lock.json": LOCK.replace("__INTEGRITY__", INTEGRITY),
            ".agentbox/Boxfile.toml": boxfile,
        })  # fmt: skip
        pending[kind] = (lab.submit(f"env-node-{kind}", repo, 2400.0), repo)
    for kind, (task_id, repo) in pending.items():
        out[kind] = lab.finish(task_id, repo, timeout=3000)
    return out


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=[pytest.mark.docker] if k == "docker" else []) for k in KINDS]
)
def test_npm_ci_in_setup_then_npm_test_by_the_agent(
    runs: dict[str, EnvRun | str], kind: str
) -> None:
    run = runs[kind]
    if isinstance(run, str):
        pytest.skip(run)
    assert run.info.status == "done", (kind, run.info.error, run.setup)
    setup = run.result.report["setup"]
    assert setup["cache"] == "miss" and setup["exit_code"] == 0, setup
    assert setup["roots"] == ["node_modules"], setup
    assert setup["egress"]["allowed"] >= 1 and setup["egress"]["bytes_down"] > 1000, setup
    log = run.agent_log()
    assert "node tests: 2 passed" in log and "NPM-EXIT=0" in log, log[-3000:]
    files = git(run.repo, "ls-tree", "-r", "--name-only", run.result.branch).split()
    assert "NOTES.md" in files and not any(f.startswith("node_modules") for f in files)
    assert "node_modules" not in run.result.diff
    assert run.result.report["diffstat"]["files_changed"] == 1
