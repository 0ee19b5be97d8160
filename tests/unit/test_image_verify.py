"""The hardening steps and the verifier, on small fake roots (no podman, no mmdebstrap)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agentbox.errors import ImageError
from agentbox.image import verify
from agentbox.image._harden import harden
from agentbox.image._rootfs import resolve_in, resolve_parent_in


def _exe(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A minimal root that passes verification: merged /usr, the essentials, the agent."""
    r = tmp_path / "root"
    for d in ("usr/bin", "usr/sbin", "usr/lib", "usr/local/bin", "etc", "tmp", "opt/agentbox"):
        (r / d).mkdir(parents=True)
    for d in ("workspace", "run/agentbox/gw", "home/agent"):
        (r / d).mkdir(parents=True)
    (r / "home/agent").chmod(0o1777)
    (r / "bin").symlink_to("usr/bin")
    (r / "sbin").symlink_to("usr/sbin")
    (r / "lib").symlink_to("usr/lib")
    for name in ("tini", "dash", "bash", "env", "git", "python3", "rg"):
        _exe(r / "usr/bin" / name)
    (r / "usr/bin/sh").symlink_to("dash")
    _exe(r / "usr/local/bin/claude")
    (r / "opt/agentbox/relay.py").write_text("print('relay')\n")
    (r / "etc/passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\nagent:x:64000:64000:agent:/home/agent:/bin/bash\n"
    )
    return r


def test_clean_root_passes(root: Path) -> None:
    verify(root, sandbox_uid=64000, guest_names=["relay.py"])


@pytest.mark.parametrize("mode", [0o4755, 0o2755, 0o6755])
def test_setuid_or_setgid_file_refused(root: Path, mode: int) -> None:
    planted = _exe(root / "usr/lib/helper/escalate")
    planted.chmod(mode)
    with pytest.raises(ImageError, match=r"/usr/lib/helper/escalate") as err:
        verify(root)
    assert "set" in str(err.value)


def test_setgid_directory_refused(root: Path) -> None:
    d = root / "var/mail"
    d.mkdir(parents=True)
    d.chmod(0o2775)
    with pytest.raises(ImageError, match=r"setgid .*/var/mail"):
        verify(root)


@pytest.mark.parametrize(
    "where",
    ["usr/bin/apt", "usr/sbin/dpkg-query", "usr/local/bin/sudo", "usr/bin/su", "usr/sbin/apk"],
)
def test_package_manager_or_su_on_path_refused(root: Path, where: str) -> None:
    _exe(root / where)
    with pytest.raises(ImageError, match=f"forbidden tool on PATH: /{where}"):
        verify(root)


def test_forbidden_name_as_a_dangling_link_is_still_refused(root: Path) -> None:
    (root / "usr/bin/apt-get").symlink_to("/nonexistent/apt-get")
    with pytest.raises(ImageError, match="apt-get"):
        verify(root)


def test_dpkg_state_refused(root: Path) -> None:
    (root / "var/lib/dpkg/info").mkdir(parents=True)
    with pytest.raises(ImageError, match="package-manager state left: /var/lib/dpkg"):
        verify(root)


def test_missing_or_unexecutable_claude_refused(root: Path) -> None:
    (root / "usr/local/bin/claude").chmod(0o644)
    with pytest.raises(ImageError, match="Claude Code missing or not executable"):
        verify(root)
    (root / "usr/local/bin/claude").unlink()
    with pytest.raises(ImageError, match="Claude Code"):
        verify(root)
    verify(root, require_claude=False)


def test_missing_agent_user_guest_and_essentials_refused(root: Path) -> None:
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "usr/bin/rg").unlink()
    (root / "lib").unlink()
    (root / "home/agent").chmod(0o755)
    with pytest.raises(ImageError) as err:
        verify(root, guest_names=["relay.py", "agent.py"])
    msg = str(err.value)
    assert "user agent (64000) missing" in msg
    assert "guest program missing: /opt/agentbox/agent.py" in msg
    assert "essential program missing: /usr/bin/rg" in msg
    assert "essential directory missing: /lib" in msg
    assert "/home/agent must be mode 0o1777" in msg
    assert "5 problem(s)" in msg


def _dpkg_list(root: Path, package: str, paths: list[str]) -> None:
    info = root / "var/lib/dpkg/info"
    info.mkdir(parents=True, exist_ok=True)
    (info / f"{package}.list").write_text("\n".join(["/.", *paths]) + "\n")


def test_harden_removes_and_strips_then_verify_passes(root: Path, tmp_path: Path) -> None:
    # A host file with setuid, reachable from the root only through an absolute link:
    # hardening must strip bits inside the root, never follow a link out of it.
    outside = _exe(tmp_path / "host-setuid")
    outside.chmod(0o4755)
    (root / "usr/bin/pager").symlink_to(str(outside))

    _exe(root / "usr/bin/apt")
    _exe(root / "usr/lib/apt/methods/http")
    _exe(root / "usr/bin/dpkg")
    (root / "etc/apt").mkdir()
    _dpkg_list(root, "apt", ["/usr", "/usr/bin", "/usr/bin/apt", "/usr/lib/apt",
                             "/usr/lib/apt/methods", "/usr/lib/apt/methods/http"])  # fmt: skip
    # dpkg lists /lib as a directory; on merged /usr it is a link that must survive.
    _dpkg_list(root, "dpkg", ["/lib", "/usr/bin/dpkg"])
    for name in ("su", "passwd", "chsh", "newgrp"):
        _exe(root / "usr/bin" / name).chmod(0o4755)
    mount = _exe(root / "usr/bin/mount")
    mount.chmod(0o4755)
    chk = _exe(root / "usr/sbin/unix_chkpwd")
    chk.chmod(0o2755)
    (root / "var/local").mkdir(parents=True)
    (root / "var/local").chmod(0o2775)

    done = harden(root)

    assert stat.S_IMODE(outside.stat().st_mode) == 0o4755, "followed a link out of the root"
    assert (root / "lib").is_symlink() and (root / "lib").resolve() == (root / "usr/lib").resolve()
    for gone in ("usr/bin/apt", "usr/lib/apt", "usr/bin/dpkg", "usr/bin/su", "usr/bin/passwd",
                 "var/lib/dpkg", "etc/apt"):  # fmt: skip
        assert not (root / gone).exists(), gone
    assert stat.S_IMODE(mount.stat().st_mode) == 0o755
    assert stat.S_IMODE(chk.stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "var/local").stat().st_mode) == 0o775
    assert "/usr/bin/su" in done["removed"] and "/usr/bin/mount" in done["stripped"]
    verify(root, guest_names=["relay.py"])


def test_resolve_in_stays_inside(root: Path) -> None:
    (root / "etc/alternatives").mkdir()
    (root / "etc/alternatives/pager").symlink_to("/usr/bin/env")
    (root / "usr/bin/up").symlink_to("../../../../../../etc")
    assert resolve_in(root, "/etc/alternatives/pager") == root / "usr/bin/env"
    assert resolve_in(root, "/bin/bash") == root / "usr/bin/bash"
    assert resolve_in(root, "/usr/bin/up") == root / "etc"
    assert resolve_parent_in(root, "/bin/pager-link") == root / "usr/bin/pager-link"
    (root / "loop").symlink_to("loop")
    with pytest.raises(ImageError, match="too many symlinks"):
        resolve_in(root, "/loop/x")
    assert os.path.commonpath([resolve_in(root, "/../../etc"), root]) == str(root)
