"""Images from a user's Containerfile, built by real podman (issue 12, section 1).

Every build here is real: ``podman build`` of a Containerfile ``FROM
localhost/agentbox-base`` (made by ``agentbox image build`` alongside the
default image), then agentbox's layer, the hardening pass and the verifier.
The nodejs build installs Debian's ``nodejs`` package from the host's Debian
mirror. Each test's Containerfile or context carries a fresh token, so a
build left by an earlier run can never make a first build a cache hit, and
every image a test makes is removed after it (``image rm``, then ``podman rmi``).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends.podman import PodmanBackend
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.errors import ImageError
from agentbox.image import BASE_IMAGE, CUSTOM_REPO, build_containerfile, images_dir, resolve
from agentbox.sandbox import spec_from_boxfile

pytestmark = [pytest.mark.podman, pytest.mark.slow]

AGENTBOX = str(Path(sys.executable).parent / "agentbox")


def _exists(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name], check=False).returncode == 0


def _podman_names(prefix: str) -> list[str]:
    out = subprocess.run(
        ["podman", "images", "--format", "{{.Repository}}:{{.Tag}}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [n for n in out.split() if n.startswith(prefix)]


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "AGENTBOX_CONFIG": "/nonexistent"}
    return subprocess.run(
        [AGENTBOX, "image", *args], capture_output=True, text=True, env=env, timeout=timeout,
        check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def base_image() -> str:
    """``localhost/agentbox-base``, made (cheaply) by the default image's build."""
    from agentbox.image import build_default

    build_default(Settings())
    assert _exists(BASE_IMAGE)
    return BASE_IMAGE


def _manifests() -> list[dict[str, object]]:
    out = []
    for m in images_dir(Settings()).glob("*/manifest.json"):
        try:
            out.append(json.loads(m.read_text()))
        except (OSError, ValueError):
            continue
    return out


@pytest.fixture(scope="module")
def made() -> Iterator[list[str]]:
    """Names of images the tests made; each is removed (with its kept root) afterwards."""
    names: list[str] = []
    yield names
    settings = Settings()
    for name in names:
        if _exists(name):
            try:
                from agentbox.image import remove

                remove(settings, name)
            except ImageError:
                subprocess.run(["podman", "rmi", "-i", name], capture_output=True, check=False)


def _tag(made: list[str], what: str) -> str:
    name = f"localhost/agentbox-test-{secrets.token_hex(4)}-{what}:dev"
    made.append(name)
    return name


@pytest.fixture(scope="module")
def node_image(
    base_image: str, made: list[str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, str]:
    """A Containerfile FROM agentbox-base adding Debian's nodejs and build-essential (the
    documented example; dpkg-dev brings a hook script named like a package-manager tool);
    returns (name, hash)."""
    ctx = tmp_path_factory.mktemp("node-ctx")
    (ctx / "hello.js").write_text(f'console.log("hello {secrets.token_hex(4)}")\n')
    (ctx / "Containerfile").write_text(
        f"FROM {base_image}\n"
        "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "
        "--no-install-recommends nodejs build-essential\n"
        "COPY hello.js /opt/app/hello.js\n"
        "ENV NODE_ENV=production\n"
    )
    tag = _tag(made, "node")
    res = _cli("build", "--containerfile", str(ctx / "Containerfile"), "--tag", tag, "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads(res.stdout)
    assert info["name"] == tag and info["cached"] is False and info["hash"]
    made.append(f"{CUSTOM_REPO}:{info['hash']}")
    return tag, info["hash"]


def test_nodejs_from_debian_packages_is_hardened_and_runs(
    node_image: tuple[str, str], sandbox_settings: Settings, sandbox_factory: Callable[..., object]
) -> None:
    name, key = node_image
    info = resolve(Settings(), name)
    assert info.hash == key and info.rootfs is not None
    root = info.rootfs
    # The hardening pass removed the apt the build used; Claude Code and our layer are in.
    for gone in ("usr/bin/apt-get", "usr/bin/dpkg", "var/lib/dpkg", "etc/apt"):
        assert not (root / gone).exists(), gone
    assert (root / "usr/local/bin/claude").is_file()
    assert (root / "opt/agentbox/relay.py").is_file()
    assert os.access(root / "opt/agentbox/relay", os.X_OK)  # the relay's C twin, built static
    assert (root / "usr/bin/node").exists()
    manifest = json.loads((root.parent / "manifest.json").read_text())
    assert manifest["kind"] == "containerfile" and manifest["name"] == name
    assert manifest["from"][BASE_IMAGE] == subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", BASE_IMAGE],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert "/usr/bin/apt-get" in manifest["removed"]

    tracker = sandbox_factory(PodmanBackend(sandbox_settings), sandbox_settings)
    spec = spec_from_boxfile(Boxfile(image=name), sandbox_settings)
    res = tracker.run(  # type: ignore[attr-defined]
        spec,
        ["sh", "-c", "node --version && node /opt/app/hello.js && id -u && echo $NODE_ENV"
         " && printf 'int main(void){return 0;}' > /tmp/a.c && cc /tmp/a.c -o /tmp/a && /tmp/a"
         " && echo compiled && { command -v apt-get dpkg || echo no-package-manager; }"
         " && { /opt/agentbox/relay --port 2>/dev/null; echo relay-$?; }"],
    )  # fmt: skip
    out = res.stdout.decode()
    assert res.exit_code == 0, out + res.stderr.decode()
    lines = out.split()
    assert lines[0].startswith("v") and lines[1] == "hello" and lines[3] == "64000"
    # relay-2: the static relay runs in the user's image (its usage error, exit 2).
    assert lines[4:] == ["production", "compiled", "no-package-manager", "relay-2"]


@pytest.mark.qemu
def test_nodejs_image_runs_on_qemu(
    node_image: tuple[str, str], sandbox_settings: Settings, sandbox_factory: Callable[..., object]
) -> None:
    from agentbox.backends.microvm.qemu import QemuBackend
    from agentbox.boxfile import Resources

    name, _ = node_image
    tracker = sandbox_factory(QemuBackend(sandbox_settings), sandbox_settings)
    spec = spec_from_boxfile(
        Boxfile(image=name, backend="qemu", resources=Resources(memory="1GiB", cpus=1)),
        sandbox_settings,
    )
    res = tracker.run(spec, ["sh", "-c", "node --version && node /opt/app/hello.js"])  # type: ignore[attr-defined]
    out = res.stdout.decode()
    assert res.exit_code == 0, out + res.stderr.decode()
    assert out.split()[0].startswith("v") and out.split()[1] == "hello"


def test_setuid_capability_and_kept_package_manager_are_refused_by_name(
    base_image: str, made: list[str], tmp_path: Path
) -> None:
    (tmp_path / "token").write_text(secrets.token_hex(8))
    cap = "struct.pack('<IIIII', 0x02000001, 1 << 13, 0, 0, 0)"  # cap_net_raw, effective
    (tmp_path / "Containerfile").write_text(
        f"FROM {base_image}\n"
        "COPY token /opt/token\n"
        "RUN cp /bin/bash /usr/local/bin/rootsh && chmod 4755 /usr/local/bin/rootsh\n"
        "RUN mkdir -p /opt/keep && cp /usr/bin/dpkg /usr/bin/apt-get /opt/keep/\n"
        'RUN cp /bin/true /usr/local/bin/rawping && python3 -c "import os, struct; '
        f"os.setxattr('/usr/local/bin/rawping', 'security.capability', {cap})\"\n"
    )
    tag = _tag(made, "refused")
    with pytest.raises(ImageError) as err:
        build_containerfile(Settings(), tmp_path / "Containerfile", tag=tag)
    text = str(err.value)
    assert "failed verification" in text
    assert "setuid 0o4755: /usr/local/bin/rootsh" in text
    assert "forbidden tool: /opt/keep/dpkg" in text
    assert "forbidden tool: /opt/keep/apt-get" in text
    assert "file capability: /usr/local/bin/rawping" in text
    # Nothing tagged, nothing kept, no build image left behind.
    assert not _exists(tag)
    assert tag not in {m.get("name") for m in _manifests()}
    assert _podman_names("localhost/agentbox-build-") == []


@pytest.mark.timeout(1800)  # two builds and a removal: up to 10 min on a busy 2-core host
def test_cache_hits_and_misses_then_ls_shows_and_rm_removes_exactly_one(
    base_image: str, made: list[str], tmp_path: Path
) -> None:
    """The cache: an unchanged build is a hit (same hash, same podman image), a changed
    Containerfile or context a miss; the first content built again under another tag is a
    hit that tags it. Then ``image ls`` shows both tags, and ``image rm`` of one removes
    exactly its tag, its content-hash tag and its kept root, and leaves the other and the
    base. (One test: ls/rm reuse the cache's images, two builds instead of five.)"""
    settings = Settings()
    data = tmp_path / "data.txt"
    one = f"one {secrets.token_hex(8)}\n"
    data.write_text(one)
    cf = tmp_path / "Containerfile"
    cf.write_text(f"FROM {base_image}\nCOPY data.txt /opt/data.txt\n")
    tag = _tag(made, "cache")

    def build(as_tag: str = tag) -> tuple[str, bool, str | None, Path]:
        info = build_containerfile(settings, cf, tag=as_tag)
        made.append(info.name)
        made.append(f"{CUSTOM_REPO}:{info.hash}")
        assert info.hash is not None and info.rootfs is not None
        return info.hash, info.cached, info.podman_id, info.rootfs

    first, cached, pid, root_first = build()
    assert not cached
    again, cached, pid2, _ = build()
    assert (again, cached, pid2) == (first, True, pid)

    # Changed Containerfile and context at once: a miss whose root has the new context.
    # (Which inputs the key follows, one by one, is the unit tier's
    # test_key_follows_containerfile_context_and_base: each miss here is a minute.)
    cf.write_text(f"FROM {base_image}\nCOPY data.txt /opt/data.txt\nRUN true\n")
    data.write_text(f"two {secrets.token_hex(8)}\n")
    changed_ctx, cached, _, root_ctx = build()
    assert changed_ctx != first and not cached
    root = resolve(settings, tag).rootfs
    assert root is not None and (root / "opt/data.txt").read_text().startswith("two ")

    # The first content again, under a second tag: a hit that names it.
    cf.write_text(f"FROM {base_image}\nCOPY data.txt /opt/data.txt\n")
    data.write_text(one)
    other = _tag(made, "other")
    back, cached, pid3, _ = build(other)
    assert (back, cached, pid3) == (first, True, pid)

    res = _cli("ls", "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    for name, key in ((tag, changed_ctx), (other, first)):
        assert rows[name]["hash"] == key and rows[name]["kind"] == "containerfile"
    assert BASE_IMAGE not in rows

    res = _cli("rm", tag, "--json")
    assert res.returncode == 0, res.stderr
    removed = json.loads(res.stdout)["removed"]
    assert sorted(removed) == sorted([tag, f"{CUSTOM_REPO}:{changed_ctx}", str(root_ctx.parent)])
    assert not _exists(tag) and not _exists(f"{CUSTOM_REPO}:{changed_ctx}")
    assert not root_ctx.parent.exists()
    assert _exists(other) and _exists(f"{CUSTOM_REPO}:{first}") and root_first.is_dir()
    assert _exists(BASE_IMAGE)


def test_boxfile_image_table_is_built_then_run_by_exec(
    base_image: str, made: list[str], tmp_path: Path, sandbox_settings: Settings
) -> None:
    repo = tmp_path / "repo"
    (repo / "ci").mkdir(parents=True)
    (repo / ".agentbox").mkdir()
    token = secrets.token_hex(8)
    (repo / "ci/marker").write_text(token + "\n")
    (repo / "ci/Containerfile").write_text(f"FROM {base_image}\nCOPY marker /opt/marker\n")
    tag = _tag(made, "boxfile")
    (repo / ".agentbox/Boxfile.toml").write_text(
        f'[image]\ncontainerfile = "../ci/Containerfile"\ntag = "{tag}"\n'
    )
    env = {
        "PATH": os.environ["PATH"],
        "AGENTBOX_DATA_DIR": str(sandbox_settings.data_dir),
        "AGENTBOX_MOUNT_ROOTS": ":".join(str(r) for r in sandbox_settings.mount_roots),
        "AGENTBOX_CONFIG": "/nonexistent",
    }
    res = subprocess.run(
        [AGENTBOX, "exec", "--boxfile", str(repo / ".agentbox/Boxfile.toml"), "--",
         "sh", "-c", "cat /opt/marker; id -u"],
        capture_output=True, text=True, env=env, timeout=900, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == [token, "64000"]
    info = resolve(Settings(), tag)
    made.append(f"{CUSTOM_REPO}:{info.hash}")
    assert info.rootfs is not None and (info.rootfs / "opt/marker").read_text().strip() == token


def test_a_from_image_not_in_local_storage_is_named(made: list[str], tmp_path: Path) -> None:
    missing = f"localhost/agentbox-test-{secrets.token_hex(4)}-missing:1"
    (tmp_path / "Containerfile").write_text(f"FROM {missing}\nRUN true\n")
    tag = _tag(made, "nofrom")
    with pytest.raises(ImageError) as err:
        build_containerfile(Settings(), tmp_path / "Containerfile", tag=tag)
    assert f"FROM {missing}: not in podman's local storage" in str(err.value)
    assert not _exists(tag)
    assert _podman_names("localhost/agentbox-build-") == []
