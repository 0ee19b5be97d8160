"""Who may read the secret store, and who may expand ``${secret:...}``: a Boxfile names
secrets, it never reads them.

An AST walk of the package: the store (``SecretStore``, ``resolve_for_task``) is reached
only from the modules that run as root on the host for a known user (the CLI as root, the
launcher, the egress phases and credential broker, the forge token; and the escape probe's
throwaway store), and ``expand`` only from the
egress package (inject values, in the proxy). The Boxfile package imports neither.
"""

from __future__ import annotations

import ast
from pathlib import Path

import agentbox

SRC = Path(agentbox.__file__).parent
STORE = {"SecretStore", "resolve_for_task", "task_secrets"}
#: Modules that may open the store, each for a user the kernel named.
STORE_USERS = {
    "cli/_secret.py",  # root's own, directly
    "launcher/_secretroutes.py",  # the caller's, by SO_PEERCRED
    "launcher/_secrets.py",  # the task's submitter's
    "egress/_hostcreds.py",  # [git] secret, for the task's user
    "env/_egress.py",  # rule_secrets: a phase's rules, for the task's owner
    "escape/_secret.py",  # the escape probe's own throwaway store
    "forge/_token.py",  # the publishing user's forge token
}


def _uses() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("secrets/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            names: set[str] = set()
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "agentbox.secrets"
            ):
                names = {a.name for a in node.names} | {node.module or ""}
            elif isinstance(node, ast.Import):
                names = {a.name for a in node.names if a.name.startswith("agentbox.secrets")}
            elif isinstance(node, ast.ImportFrom) and node.module == "agentbox.launcher._secrets":
                names = {a.name for a in node.names}
            if names:
                found.setdefault(rel, set()).update(names)
    return found


def test_only_host_side_modules_open_the_store() -> None:
    readers = {rel for rel, names in _uses().items() if names & STORE}
    assert readers <= STORE_USERS, sorted(readers - STORE_USERS)
    assert "cli/_secret.py" in readers and "launcher/_secretroutes.py" in readers


def test_only_the_egress_package_expands_references() -> None:
    expanders = {rel for rel, names in _uses().items() if "expand" in names}
    assert all(rel.startswith("egress/") for rel in expanders), sorted(expanders)


def test_the_boxfile_package_never_reads_a_secret() -> None:
    boxfile = {rel: n for rel, n in _uses().items() if rel.startswith("boxfile/")}
    assert not any(names & (STORE | {"expand"}) for names in boxfile.values()), boxfile
