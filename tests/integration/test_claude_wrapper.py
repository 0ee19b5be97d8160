"""``scripts/claude-wrapper.sh``: ``claude`` on PATH after setup (issue 13 section 5).

The delegate tutorial's ``claude mcp add …`` failed with "command not found": the
pinned binary lives in the cache dir. setup.sh now writes a wrapper (this script);
these tests run the real script against the real pinned binary, in temp dirs.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from agentbox.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "claude-wrapper.sh"


def _binary() -> Path:
    b = load_settings().claude_binary
    if not os.access(b, os.X_OK):
        pytest.skip(f"no pinned Claude Code binary at {b} (scripts/setup.sh installs it)")
    return b


def _wrap(binary: Path, wrapper: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(SCRIPT), str(binary), str(wrapper)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )


@pytest.mark.claude
def test_the_wrapper_runs_the_pinned_claude_by_name(tmp_path: Path) -> None:
    binary = _binary()
    wrapper = tmp_path / "bin" / "claude"
    _wrap(binary, wrapper)
    env = {"PATH": f"{wrapper.parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    got = subprocess.run(
        ["claude", "--version"], env=env, capture_output=True, text=True, timeout=120
    )
    want = subprocess.run(
        [str(binary), "--version"], env=env, capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout == want.stdout and want.stdout.strip()
    # Idempotent: a second run changes nothing and says nothing.
    before = wrapper.read_bytes()
    again = _wrap(binary, wrapper)
    assert wrapper.read_bytes() == before and again.stderr == ""


def test_a_claude_of_the_users_own_is_left_alone(tmp_path: Path) -> None:
    fake = tmp_path / "pinned"
    fake.write_text("#!/bin/sh\necho pinned\n")
    fake.chmod(0o755)
    wrapper = tmp_path / "claude"
    wrapper.write_text("#!/bin/sh\necho mine\n")
    res = _wrap(fake, wrapper)
    assert wrapper.read_text() == "#!/bin/sh\necho mine\n"
    assert "left alone" in res.stderr
    # A link (to anything) is not ours either.
    link = tmp_path / "claude-link"
    link.symlink_to(fake)
    _wrap(fake, link)
    assert link.is_symlink()


def test_a_wrapper_of_ours_follows_a_new_pinned_version(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    for p in (old, new):
        p.write_text(f"#!/bin/sh\necho {p.name}\n")
        p.chmod(0o755)
    wrapper = tmp_path / "claude"
    _wrap(old, wrapper)
    _wrap(new, wrapper)
    out = subprocess.run([str(wrapper)], capture_output=True, text=True, check=True, timeout=30)
    assert out.stdout.strip() == "new"
