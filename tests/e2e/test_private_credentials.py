"""End to end: a team's repo whose dependencies come from a private index and whose remote is a
private smart-HTTP git server, run by the real Claude Code (a replay script) in podman.

The servers are real (tests/private_servers.py: pypiserver, git http-backend behind nginx,
TLS from a test CA, basic auth, in a network namespace). The host's pip names the index
with its credential (``PIP_INDEX_URL`` with ``user:pass@`` in the launcher's environment:
root's own configuration); the remote's credential is an ``agentbox secret`` named by the
Boxfile's ``[git] secret``. Then:

- setup installs ``corp-util`` from the private index: the proxy injected the credential;
- the agent fetches the remote's new commit (a colleague pushed it after the task's base)
  and rebases on it; its ``git push`` is refused, logged with the rule's message, and the
  remote has no new branch;
- the agent dumps what it can see from inside (environment, /proc, git and npm config,
  the CA dir, its home, /tmp, .git) into the workspace: the values are not there;
- the values appear nowhere in the task directory (transcript, logs, report, ledger,
  egress logs), the result branch, ``agentbox show --json`` or the launcher's answers.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.launcher.pushapi import PushRequest
from agentbox.secrets import SecretStore
from env_helpers import EnvLab, commit
from git_helpers import git
from private_servers import GIT_HOST, NPM_HOST, NPM_PACKAGE, PYPI_HOST, missing, private_servers

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(bool(missing()), reason=f"needs {missing()}"),
]

IMAGE = "localhost/agentbox-test-pyvenv:brokered"
OWNER = 64434  # the repo's owner when the result is pushed (a bare uid)
CONTAINERFILE = (
    "FROM localhost/agentbox-base\n"
    "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "
    "--no-install-recommends python3-venv\n"
)
BOXFILE = f"""\
image = "{IMAGE}"

[setup]
run = ["python3 -m venv .venv", ".venv/bin/pip install -q -r requirements.txt"]
inputs = ["requirements.txt"]
network = "registries"
deadline = 600

[git]
fetch = true
secret = "CORP_GIT_TOKEN"
user = "corpdev"
"""
TEST_FILE = "import corp_util\n\n\ndef test_value():\n    assert corp_util.VALUE == 42\n"

#: What the agent dumps from inside: everything a credential could have been left in.
DUMP = (
    "{ env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; git config --list --show-origin; "
    "cat .git/config; cat /run/agentbox/ca/npmrc 2>/dev/null; "
    "find /run/agentbox $HOME /tmp /workspace/.git /etc -xdev -type f -size -2M "
    "2>/dev/null | xargs cat 2>/dev/null; } > INSIDE-DUMP.txt 2>&1; "
    "grep -c GIT_CONFIG_VALUE_0 INSIDE-DUMP.txt"
)
SCRIPT = """\
name: brokered
turns:
  - text: "Running the tests with the project's environment."
    tool_use:
      - name: Bash
        input:
          command: "cd {{cwd}} && .venv/bin/python -c 'import test_corp; test_corp.test_value()' 2>&1; echo TEST-EXIT=$?"
          description: "Run the test"
  - text: "Writing my change, then fetching the remote and rebasing on it."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/NOTES.md", content: "the tests ran\\n"}
  - tool_use:
      - name: Bash
        input:
          command: "cd {{cwd}} && git add -A && git -c user.name=a -c user.email=a@b commit -qm notes && git fetch origin 2>&1 && git -c user.name=a -c user.email=a@b rebase origin/main 2>&1; echo REBASE-EXIT=$?; git log --format=%s -3"
          description: "Fetch and rebase"
  - text: "Trying to push."
    tool_use:
      - name: Bash
        input:
          command: "cd {{cwd}} && git push origin HEAD:refs/heads/agent-push 2>&1; echo PUSH-EXIT=$?"
          description: "Push"
  - text: "Looking at what I can see."
    tool_use:
      - name: Bash
        input:
          command: __DUMP__
          description: "Dump"
  - text: "Done: tests ran, rebased on the remote's main; the push was refused."
"""  # noqa: E501


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    with private_servers(tmp_path_factory.mktemp("corp") / "srv") as srv:
        yield srv


def _grep(secrets: list[str], root: Path) -> list[str]:
    hits = []
    for f in root.rglob("*"):
        if f.is_file() and not f.is_symlink():
            try:
                data = f.read_bytes()
            except OSError:
                continue
            hits += [f"{f}: {s[:4]}…" for s in secrets if s.encode() in data]
    return hits


def test_private_index_git_fetch_and_the_secret_nowhere(
    env_lab: Callable[..., EnvLab], servers: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = servers
    secrets: list[str] = srv.secrets()  # type: ignore[attr-defined]
    basic = base64.b64encode(f"{srv.user}:{srv.password}".encode()).decode()  # type: ignore[attr-defined]
    secrets.append(basic)
    # Root's own pip configuration names the private index with its credential.
    monkeypatch.setenv(
        "PIP_INDEX_URL",
        f"https://{srv.user}:{srv.password}@{PYPI_HOST}/simple/",  # type: ignore[attr-defined]
    )
    lab = env_lab(
        "brokered", SCRIPT.replace("__DUMP__", json.dumps(DUMP)),
        egress_hosts=dict(srv.addresses),  # type: ignore[attr-defined]
        egress_upstream_ca=(srv.ca_path,),  # type: ignore[attr-defined]
    )  # fmt: skip
    lab.image(CONTAINERFILE, IMAGE)
    SecretStore(lab.settings).set("CORP_GIT_TOKEN", srv.password, owner_uid=0)  # type: ignore[attr-defined]
    # The team's repo: the remote holds its history; a colleague pushes after our base.
    repo = lab.settings.repos_root / "proj"
    git(lab.settings.repos_root, "clone", "-q", str(srv.git_dir), str(repo))  # type: ignore[attr-defined]
    (repo / "test_corp.py").write_text(TEST_FILE)
    (repo / ".gitignore").write_text(".venv/\n")
    (repo / ".agentbox").mkdir()
    (repo / ".agentbox" / "Boxfile.toml").write_text(BOXFILE)
    commit(repo, "tests and Boxfile")
    git(repo, "push", "-q", str(srv.git_dir), "main")  # type: ignore[attr-defined]
    git(repo, "remote", "set-url", "origin", srv.git_url)  # type: ignore[attr-defined]
    colleague = lab.base / "colleague"
    git(lab.base, "clone", "-q", str(srv.git_dir), str(colleague))  # type: ignore[attr-defined]
    (colleague / "CHANGES.md").write_text("a colleague's change\n")
    commit(colleague, "a colleague's change")
    git(colleague, "push", "-q", "origin", "main")

    run = lab.run("brokered", repo, 900.0)
    assert run.info.status == "done", (run.info, run.setup)
    assert run.setup.get("cache") == "miss" and run.setup.get("exit_code") == 0, run.setup
    logs = run.task_dir / "logs"
    setup_log = [json.loads(x) for x in (logs / "egress-setup.jsonl").read_text().splitlines()]
    assert any(x["host"] == PYPI_HOST and x.get("injected") for x in setup_log), setup_log
    agent_log = run.agent_log()
    assert "TEST-EXIT=0" in agent_log
    assert "REBASE-EXIT=0" in agent_log and "a colleague's change" in agent_log
    assert "PUSH-EXIT=0" not in agent_log and "PUSH-EXIT=" in agent_log
    egress = [json.loads(x) for x in (logs / "egress-agent.jsonl").read_text().splitlines()]
    fetched = [x for x in egress if x["path"].endswith("/git-upload-pack")]
    assert fetched and all(x["decision"] == "allowed" and x["injected"] for x in fetched)
    refused = [x for x in egress if x["decision"] == "denied"]
    assert refused and all("agentbox publish ID --push" in x["reason"] for x in refused)
    assert all(x["host"] == GIT_HOST for x in egress)
    heads = subprocess.run(
        ["git", "-C", str(srv.git_dir), "for-each-ref", "--format=%(refname)"],  # type: ignore[attr-defined]
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "agent-push" not in heads
    # What the agent saw from inside, collected on its branch.
    branch = f"agentbox/{run.info.id}"
    dump = subprocess.run(
        ["git", "-C", str(repo), "show", f"{branch}:INSIDE-DUMP.txt"],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    # The dump saw the agent's environment (and the remote named without a credential).
    assert b"GIT_CONFIG_VALUE_0=https://git.corp.example/proj.git\n" in dump
    assert b"ANTHROPIC_BASE_URL=http://127.0.0.1:" in dump
    for s in secrets:
        assert s.encode() not in dump, "a credential is visible inside the sandbox"
    # Nowhere on the host side either.
    assert _grep(secrets, run.task_dir) == []
    assert _grep(secrets, lab.settings.data_dir / "tasks") == []
    everything = subprocess.run(
        ["git", "-C", str(repo), "log", "-p", "--all"], capture_output=True, check=True
    ).stdout.decode(errors="replace")
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "agentbox"), "show", run.info.id, "--json"],
        env={**os.environ, "AGENTBOX_DATA_DIR": str(lab.settings.data_dir),
             "AGENTBOX_REPOS_ROOT": str(lab.settings.repos_root),
             "AGENTBOX_MODELS_FILE": str(lab.settings.models_file)},
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.info.id in shown.stdout, shown.stderr
    answers = (
        everything, shown.stdout, shown.stderr,
        lab.launcher.result(run.info.id).model_dump_json(),
        lab.launcher.get(run.info.id).model_dump_json(),
    )  # fmt: skip
    for text in answers:
        for s in secrets:
            assert s not in text
    # Publish from the host, with the owner's own git credentials (this repo's config says
    # where the server is and which CA signs it, as a company's DNS and CA bundle would).
    # agentbox pushes only as the repo's owner, never as root: the repo becomes a user's.
    creds = lab.base / "git-credentials"
    creds.write_text(f"https://{srv.user}:{srv.password}@{GIT_HOST}\n")  # type: ignore[attr-defined]
    creds.chmod(0o600)
    ca = lab.base / "corp-ca.pem"
    ca.write_bytes(srv.ca_path.read_bytes())  # type: ignore[attr-defined]
    ca.chmod(0o644)
    git(repo, "config", "http.curloptResolve", f"{GIT_HOST}:443:{srv.addresses[GIT_HOST]}")  # type: ignore[attr-defined]
    git(repo, "config", "http.sslCAInfo", str(ca))
    git(repo, "config", "credential.helper", f"store --file={creds}")
    subprocess.run(["chown", "-R", f"{OWNER}:{OWNER}", str(repo), str(creds)], check=True)
    pushed = lab.launcher.push(run.info.id, PushRequest(remote="origin"))
    assert pushed.pushed and pushed.branch == branch
    heads = subprocess.run(
        ["git", "-C", str(srv.git_dir), "for-each-ref", "--format=%(refname) %(objectname)"],  # type: ignore[attr-defined]
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert f"refs/heads/{branch} {pushed.commit}" in heads
    for s in secrets:
        assert s not in pushed.model_dump_json()


NODE_IMAGE = "localhost/agentbox-test-node:brokered"
NODE_CONTAINERFILE = (
    "FROM localhost/agentbox-base\n"
    "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y"
    " --no-install-recommends nodejs npm\n"
)
NODE_BOXFILE = f"""\
image = "{NODE_IMAGE}"

[setup]
run = [
  "npm install --no-audit --no-fund --no-save {NPM_PACKAGE}",
  "node -e \\"console.log('GREETING', require('{NPM_PACKAGE}')())\\"",
]
inputs = ["package.json"]
network = "registries"
deadline = 600
"""
DONE_SCRIPT = """\
name: brokered-npm
turns:
  - text: "Nothing to do: the environment is ready."
"""


def test_private_npm_registry_in_setup(
    env_lab: Callable[..., EnvLab], servers: object, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:  # fmt: skip
    srv = servers
    secrets: list[str] = srv.secrets()  # type: ignore[attr-defined]
    assert srv.npm_token in secrets  # type: ignore[attr-defined]
    # Root's own npm configuration: a scoped registry and its token.
    npmrc = tmp_path / "npmrc"
    npmrc.write_text(
        f"@corp:registry=https://{NPM_HOST}/\n//{NPM_HOST}/:_authToken={srv.npm_token}\n"  # type: ignore[attr-defined]
    )
    monkeypatch.setenv("NPM_CONFIG_USERCONFIG", str(npmrc))
    lab = env_lab(
        "brokered-npm", DONE_SCRIPT,
        egress_hosts=dict(srv.addresses),  # type: ignore[attr-defined]
        egress_upstream_ca=(srv.ca_path,),  # type: ignore[attr-defined]
    )  # fmt: skip
    lab.image(NODE_CONTAINERFILE, NODE_IMAGE)
    repo = lab.repo("web", {
        "package.json": '{"name": "web", "version": "1.0.0", "private": true}\n',
        ".gitignore": "node_modules/\n", ".agentbox/Boxfile.toml": NODE_BOXFILE,
    })  # fmt: skip
    run = lab.run("brokered-npm", repo, 900.0)
    assert run.info.status == "done", (run.info, run.setup)
    assert run.setup.get("exit_code") == 0, run.setup
    logs = run.task_dir / "logs"
    assert "GREETING hello from corp" in (logs / "setup.log").read_text()
    setup_log = [json.loads(x) for x in (logs / "egress-setup.jsonl").read_text().splitlines()]
    assert any(x["host"] == NPM_HOST and x.get("injected") for x in setup_log), setup_log
    assert "brokered" in (logs / "launcher.log").read_text()
    assert _grep(secrets, run.task_dir) == []
    for text in (
        lab.launcher.result(run.info.id).model_dump_json(),
        lab.launcher.get(run.info.id).model_dump_json(),
    ):
        for s in secrets:
            assert s not in text
