"""Every tutorial runs verbatim (issue 13 section 5): a doc that drifts fails the build.

Each page in ``docs/tutorials/`` (but its README, which states the convention) is
read by ``tests/tutorial_runner.py`` and its ``console`` blocks run in order, in
one bash, started in the checkout under test, as root, with a throwaway ``HOME``
and data dir (``AGENTBOX_DATA_DIR``), no API key (the tutorials use the replay
model, the offline default), the real podman and the real Claude Code. The
commands come from the markdown itself, not from a copy.

``TUTORIALS_CHECKOUT=DIR`` runs the pages in another checkout (where its
``scripts/setup.sh`` is the one run); CI leaves it unset. The pages run
``scripts/setup.sh``: the test skips when that would re-install the shared venv
(pyproject.toml changed since the last setup), which scripts/test.sh never leaves.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tutorial_runner import kill_marked, marked_pids, parse_tutorial, requirements, run_tutorial

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the tutorials are followed as root"),
]

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = sorted(p for p in (ROOT / "docs" / "tutorials").glob("*.md") if p.name != "README.md")
#: The how-to guides: their console blocks run too (issue 34 item 10), each page on its
#: own, as a reader who has agentbox installed runs them (the venv on PATH).
HOWTOS = sorted((ROOT / "docs" / "how-to").glob("*.md"))
#: The user the delegate tutorial makes for its repos (removed again if the test made it).
TUTORIAL_USER = "dev"


def _missing(text: str) -> list[str]:
    """What a page's ``<!-- requires: … -->`` names that this host lacks."""
    out = []
    for req in sorted(requirements(text)):
        if req == "ray":
            if importlib.util.find_spec("ray") is None:
                out.append("ray (pip install 'agentbox[ray]'; scripts/setup.sh installs it)")
        elif req == "runsc":
            from agentbox.core import host as _host

            fac = _host.podman_runtime("runsc")
            if not fac.ok:
                out.append(f"runsc ({fac.detail})")
        elif req not in ("root", "podman", "claude"):
            out.append(f"{req} (unknown requirement: the test cannot check it)")
    return out


def _venv_stale(checkout: Path) -> str | None:
    """Why setup.sh (run by the pages) would re-install the venv, or None."""
    stamp = checkout / ".venv" / ".agentbox-installed"
    want = hashlib.sha256((checkout / "pyproject.toml").read_bytes()).hexdigest()[:16]
    try:
        have = stamp.read_text().strip()
    except OSError:
        have = ""
    if have != want:
        return (
            f"scripts/setup.sh would re-install {checkout / '.venv'} (pyproject.toml changed "
            "since the last setup): run scripts/setup.sh first"
        )
    return None


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path) + "/"
    with open("/proc/self/mounts") as fh:
        return [f.split()[1] for f in fh if f.split()[1].startswith(prefix)]


def _containers_of(data_dir: Path) -> list[str]:
    """This data dir's containers, once a last task's removal (off its path, after the
    command returned: backends/podman/_removals.py) has had up to 30 s to end."""
    from agentbox.config import Settings
    from agentbox.launcher._names import DATA_LABEL, data_label

    label = f"label={DATA_LABEL}={data_label(Settings(data_dir=data_dir))}"
    end = time.monotonic() + 30
    while True:
        res = subprocess.run(
            ["podman", "ps", "-a", "--filter", label, "--format", "{{.Names}}"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if not res.stdout.split() or time.monotonic() > end:
            return res.stdout.split()
        time.sleep(0.5)


@pytest.mark.parametrize("path", HOWTOS, ids=lambda p: p.name)
def test_the_how_to_guide_runs_verbatim(path: Path) -> None:
    """A how-to page's console blocks that run (the rest are ``not-run`` with a reason, held
    to that by tests/unit/test_howto_guides.py), in order, in one bash; cheap: what needs
    a real API key, a model server, a second host or changes the host is not run."""
    text = path.read_text()
    if not any(b.runs for b in parse_tutorial(text)):
        pytest.skip(f"{path.name}: every console block is not-run (each says why)")
    missing = _missing(text)
    if missing:
        pytest.skip(f"{path.name} requires {', '.join(missing)}")
    checkout = Path(os.environ.get("TUTORIALS_CHECKOUT") or ROOT)
    base = Path(tempfile.mkdtemp(prefix="agentbox-howto-"))
    base.chmod(0o755)  # runsc's gofer reaches the data dir's workspaces
    (base / "home").mkdir(mode=0o700)
    (base / "steps").mkdir()
    marker = f"AGENTBOX_TUTORIAL_RUN={uuid.uuid4().hex}"
    env = {
        "PATH": f"{checkout / '.venv/bin'}:{os.environ['PATH']}",
        "HOME": str(base / "home"),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "USER": "root",
        "LOGNAME": "root",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        marker.split("=", 1)[0]: marker.split("=", 1)[1],
    }
    envs = _env_keys()
    try:
        run = run_tutorial(path, cwd=checkout, env=env, workdir=base / "steps", timeout=600)
        assert run.ran, f"{path.name}: nothing ran"
        for block, why in run.skipped:
            print(f"{path.name}:{block.line}: not run: {why}")
    finally:
        kill_marked(marker)
        survivors = list(marked_pids(marker))
        containers = _containers_of(base / "data")
        for name in containers:
            subprocess.run(["podman", "rm", "-f", name], capture_output=True, timeout=120)
        _remove_envs(_env_keys() - envs)
        shutil.rmtree(base, ignore_errors=True)
    assert not survivors, f"processes survived the guide's cleanup: {survivors}"
    assert not containers, f"sandboxes left behind: {containers}"


def _env_keys() -> set[str]:
    """The frozen environments on this host (they live in the cache dir, not the run's data
    dir): a run removes those it made, or the next run of the page is a cache hit and its
    setup never runs."""
    from agentbox.config import Settings
    from agentbox.env import EnvStore

    return {e.key for e in EnvStore(Settings()).list()}


def _remove_envs(keys: set[str]) -> None:
    from agentbox.config import Settings
    from agentbox.env import EnvStore

    store = EnvStore(Settings())
    for key in keys:
        store.remove(key, force=True)


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_the_tutorial_runs_verbatim(path: Path) -> None:
    text = path.read_text()
    missing = _missing(text)
    if missing:
        pytest.skip(f"{path.name} requires {', '.join(missing)}")
    makes_user = f"useradd --create-home {TUTORIAL_USER}" in text
    if makes_user and _user_exists(TUTORIAL_USER):
        pytest.skip(
            f"a user {TUTORIAL_USER!r} exists on this host: {path.name} would write into its "
            f"home (userdel -r {TUTORIAL_USER} if an earlier run left it)"
        )
    checkout = Path(os.environ.get("TUTORIALS_CHECKOUT") or ROOT)
    stale = _venv_stale(checkout)
    if stale:
        pytest.skip(stale)
    base = Path(tempfile.mkdtemp(prefix="agentbox-tutorial-"))
    base.chmod(0o755)  # the MCP server runs as another user and reaches the data dir
    (base / "home").mkdir(mode=0o700)
    (base / "steps").mkdir()
    marker = f"AGENTBOX_TUTORIAL_RUN={uuid.uuid4().hex}"
    env = {
        # The caller's PATH (the python3 that made the venv) without the venv: a reader's
        # shell finds `agentbox` only once the page activates it.
        "PATH": ":".join(
            p for p in os.environ["PATH"].split(":") if p and Path(p) != checkout / ".venv/bin"
        ),
        "HOME": str(base / "home"),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "USER": "root",
        "LOGNAME": "root",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        marker.split("=", 1)[0]: marker.split("=", 1)[1],
    }
    steps: list[str] = []
    envs = _env_keys()
    try:
        run = run_tutorial(
            path,
            cwd=checkout,
            env=env,
            workdir=base / "steps",
            timeout=900,
            on_step=lambda c: steps.append(f"{path.name}:{c.line}: {c.text.splitlines()[0]}"),
        )
        assert run.ran, f"{path.name}: nothing ran"
        for block, why in run.skipped:
            print(f"{path.name}:{block.line}: not run: {why}")
    finally:
        started = kill_marked(marker)
        survivors = list(marked_pids(marker))
        containers = _containers_of(base / "data")
        for name in containers:
            subprocess.run(["podman", "rm", "-f", name], capture_output=True, timeout=120)
        mounts = _mounts_under(base)
        for m in sorted(mounts, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True, timeout=60)
        if makes_user and _user_exists(TUTORIAL_USER):
            subprocess.run(["userdel", "-r", TUTORIAL_USER], capture_output=True, timeout=60)
        _remove_envs(_env_keys() - envs)
        shutil.rmtree(base, ignore_errors=True)
        print(f"ran {len(steps)} commands; stopped {len(started)} processes it left running")
    assert not survivors, f"processes survived the tutorial's cleanup: {survivors}"
    assert not containers, f"sandboxes left behind: {containers}"
    assert not mounts, f"mounts left behind: {mounts}"
