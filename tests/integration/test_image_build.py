"""The default image, read after it is built: hardened, runnable, cached, listable, removable.

One session-scoped build in the real cache dir (``scripts/test.sh`` builds it
first, so this is normally a cache hit; the first build ever takes ~1 min).
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.errors import ImageError
from agentbox.image import (
    HASH_LABEL,
    ImageInfo,
    build_default,
    images_dir,
    list_images,
    manifest,
    remove,
    resolve,
    verify,
)
from agentbox.image._build import build_lock

pytestmark = [pytest.mark.podman, pytest.mark.slow]

AGENTBOX = str(Path(sys.executable).parent / "agentbox")
RUN = [
    "podman", "run", "--rm", "--network", "none", "--runtime", "runc",
    "--cgroup-manager", "cgroupfs", "--read-only", "--cap-drop", "ALL",
    "--security-opt", "no-new-privileges",
    "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",
]  # fmt: skip


@pytest.fixture(scope="session")
def built() -> ImageInfo:
    return build_default(Settings())


def _run(
    image: str, *cmd: str, user: str | None = None, tmpfs: str | None = None
) -> subprocess.CompletedProcess[str]:
    who = (["--user", user] if user else []) + (["--tmpfs", tmpfs] if tmpfs else [])
    return subprocess.run(
        [*RUN, *who, image, *cmd], capture_output=True, text=True, timeout=120, check=False
    )


def test_rootfs_and_manifest_kept(built: ImageInfo) -> None:
    assert built.name == "localhost/agentbox-default:latest"
    assert built.hash and built.rootfs and built.podman_id
    assert built.rootfs == images_dir(Settings()) / built.hash / "rootfs"
    m = manifest(built)
    assert m is not None and m["hash"] == built.hash and m["name"] == built.name
    assert "/usr/bin/su" in m["removed"] and "/usr/bin/apt" in m["removed"]
    # The kept root passes the verifier on its own.
    verify(built.rootfs, guest_names=sorted(m["guest"]))


def test_no_setuid_setgid_in_built_root(built: ImageInfo) -> None:
    assert built.rootfs is not None
    bad = []
    for dirpath, dirnames, filenames in os.walk(built.rootfs):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                bad.append(os.path.join(dirpath, name))
    assert bad == []


def test_inside_no_setuid_no_package_manager_no_su(built: ImageInfo) -> None:
    # As the image's root (still without capabilities) so that every directory is readable.
    res = _run(built.name, "find", "/", "-xdev", "-perm", "/6000", user="0:0")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ""
    script = (
        "for x in apt apt-get apt-cache dpkg dpkg-query su sudo apk passwd newgrp; do "
        "command -v $x && exit 1; done; test ! -e /var/lib/dpkg && test ! -e /etc/apt"
    )
    res = _run(built.name, "sh", "-c", script)
    assert res.returncode == 0, f"found: {res.stdout} {res.stderr}"


def test_runs_as_agent_with_config(built: ImageInfo) -> None:
    res = _run(built.name, "sh", "-c", 'id -u; id -g; id -un; echo "$HOME"; pwd; ps -o comm= 1')
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["64000", "64000", "agent", "/home/agent", "/workspace", "tini"]
    info = json.loads(
        subprocess.run(
            ["podman", "image", "inspect", built.name], capture_output=True, text=True, check=True
        ).stdout
    )[0]
    assert info["Config"]["Labels"][HASH_LABEL] == built.hash
    assert info["Config"]["Entrypoint"] == ["/usr/bin/tini", "--"]


def test_home_tmpfs_is_writable_by_the_agent(built: ImageInfo) -> None:
    # podman 4.3 gives a tmpfs on an existing image dir that dir's mode, ignoring mode=.
    res = _run(
        built.name,
        "sh",
        "-c",
        'touch "$HOME/x" && stat -c %a "$HOME"',
        tmpfs="/home/agent:mode=1777",
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "1777"


def test_claude_and_tools_run_offline(built: ImageInfo) -> None:
    settings = Settings()
    res = _run(built.name, "claude", "--version")
    assert res.returncode == 0, res.stderr
    assert settings.claude_code_version in res.stdout
    res = _run(
        built.name, "sh", "-c", "git --version && rg --version && python3 -V && bash -c true"
    )
    assert res.returncode == 0, res.stderr


def test_guest_programs_installed_root_owned(built: ImageInfo) -> None:
    m = manifest(built)
    assert m is not None and m["guest"]
    res = _run(
        built.name,
        "stat",
        "-c",
        "%n %u %a",
        "/opt/agentbox",
        *(f"/opt/agentbox/{n}" for n in m["guest"]),
    )
    assert res.returncode == 0, res.stderr
    lines = [line.split() for line in res.stdout.splitlines()]
    assert lines[0] == ["/opt/agentbox", "0", "755"]
    for _, uid, mode in lines[1:]:
        assert uid == "0" and mode in ("644", "755")


def test_second_build_is_a_cache_hit(built: ImageInfo) -> None:
    seen: list[str] = []
    again = build_default(Settings(), progress=seen.append)
    assert again.cached is True
    assert (again.hash, again.podman_id, again.rootfs) == (
        built.hash,
        built.podman_id,
        built.rootfs,
    )
    assert not any(s.startswith(("base: mmdebstrap", "import:")) for s in seen), seen


def test_concurrent_build_waits_for_the_lock(built: ImageInfo) -> None:
    settings = Settings()
    seen: list[str] = []
    out: list[ImageInfo] = []
    with build_lock(images_dir(settings), lambda _m: None):
        t = threading.Thread(
            target=lambda: out.append(build_default(settings, progress=seen.append))
        )
        t.start()
        t.join(3)
        assert t.is_alive(), "build did not wait for the lock"
        assert any(s.startswith("lock: waiting") for s in seen)
    t.join(120)
    assert out and out[0].cached and out[0].hash == built.hash


def test_resolve(built: ImageInfo) -> None:
    settings = Settings()
    got = resolve(settings)
    assert (got.name, got.hash, got.rootfs) == (built.name, built.hash, built.rootfs)
    assert built.hash is not None and resolve(settings, built.hash).hash == built.hash
    name = f"localhost/agentbox-missing-{secrets.token_hex(4)}:latest"
    with pytest.raises(ImageError, match=r"agentbox image build.*podman images"):
        resolve(settings, name)
    with pytest.raises(ImageError, match="not a valid image name"):
        resolve(settings, "--privileged")


@pytest.fixture
def tiny_images(tmp_path: Path) -> Iterator[tuple[Settings, str, str, str]]:
    """A labelled tiny image with a kept root in a private cache dir, and an unlabelled one."""
    fake = secrets.token_hex(8)
    repo = f"localhost/agentbox-test-{secrets.token_hex(4)}"
    settings = Settings(cache_dir=tmp_path / "cache")
    kept = images_dir(settings) / fake
    (kept / "rootfs/etc").mkdir(parents=True)
    (kept / "manifest.json").write_text(
        json.dumps({"hash": fake, "created": "2026-01-01T00:00:00"})
    )
    src = tmp_path / "src"
    src.mkdir()
    (src / "hello").write_text("hi\n")
    tar = tmp_path / "tiny.tar"
    subprocess.run(["tar", "-cf", tar, "-C", src, "."], check=True)
    labelled, foreign = f"{repo}:{fake}", f"{repo}-foreign:latest"
    subprocess.run(
        ["podman", "import", "-q", "--change", f"LABEL {HASH_LABEL}={fake}", tar, labelled],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(["podman", "import", "-q", tar, foreign], check=True, capture_output=True)
    yield settings, fake, labelled, foreign
    subprocess.run(["podman", "rmi", "-i", labelled, foreign], capture_output=True, check=False)


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AGENTBOX_CACHE_DIR": str(settings.cache_dir)}
    return subprocess.run(
        [AGENTBOX, "image", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_cli_ls_and_rm(tiny_images: tuple[Settings, str, str, str]) -> None:
    settings, fake, labelled, foreign = tiny_images
    res = _cli(settings, "ls", "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["hash"]: r for r in json.loads(res.stdout)}
    assert rows[fake]["name"] == labelled and rows[fake]["rootfs"]
    assert fake in {i.hash for i in list_images(settings)}

    # A foreign image is never removed by agentbox.
    res = _cli(settings, "rm", foreign)
    assert res.returncode == 1 and "not built by agentbox" in " ".join(res.stderr.split())
    assert subprocess.run(["podman", "image", "exists", foreign], check=False).returncode == 0

    res = _cli(settings, "rm", "--json", fake)
    assert res.returncode == 0, res.stderr
    assert labelled in json.loads(res.stdout)["removed"]
    assert subprocess.run(["podman", "image", "exists", labelled], check=False).returncode == 1
    assert not (images_dir(settings) / fake).exists()
    with pytest.raises(ImageError, match="no image with hash"):
        remove(settings, fake)
    res = _cli(settings, "ls")
    assert res.returncode == 0 and fake not in res.stdout
