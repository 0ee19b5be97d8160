"""``agentbox image rm|ls`` and images built ``FROM`` an agentbox image (issue 11, item 8).

A derived image inherits every label of its base, the content-hash label
included. ``image rm`` of the derived image used to remove the base (every
tag of that hash) and its kept root directory. These tests build real derived
images with ``podman build`` (no registry: the base is local).

The first tests use a tiny labelled stand-in for the default image, in a
private cache dir, so even a broken ``image rm`` cannot touch the shared
default image. The last test uses the real default image as the base.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentbox.config import DEFAULT_IMAGE, Settings
from agentbox.errors import ImageError
from agentbox.image import HASH_LABEL, images_dir, list_images, remove, resolve

pytestmark = [pytest.mark.podman]

AGENTBOX = str(Path(sys.executable).parent / "agentbox")


def _exists(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name], check=False).returncode == 0


def _build_from(base: str, tag: str, context: Path) -> None:
    context.mkdir(exist_ok=True)
    (context / "Containerfile").write_text(f"FROM {base}\nLABEL io.example.derived=yes\n")
    subprocess.run(
        ["podman", "build", "-q", "--pull=never", "-t", tag, str(context)],
        check=True,
        capture_output=True,
        timeout=300,
    )


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AGENTBOX_CACHE_DIR": str(settings.cache_dir)}
    return subprocess.run(
        [AGENTBOX, "image", *args], capture_output=True, text=True, env=env, timeout=120,
        check=False,
    )  # fmt: skip


@dataclass
class Family:
    settings: Settings
    key: str
    base: str
    derived: str
    kept: Path


@pytest.fixture
def family(tmp_path: Path) -> Iterator[Family]:
    """A labelled base imported as agentbox imports (one layer, no parent), a kept root
    in a private cache dir, and an image built FROM the base."""
    key = secrets.token_hex(8)
    repo = f"localhost/agentbox-test-{secrets.token_hex(4)}"
    settings = Settings(cache_dir=tmp_path / "cache")
    kept = images_dir(settings) / key
    (kept / "rootfs/etc").mkdir(parents=True)
    (kept / "manifest.json").write_text(json.dumps({"hash": key, "created": "2026-01-01"}))
    src = tmp_path / "src"
    src.mkdir()
    (src / "hello").write_text("hi\n")
    tar = tmp_path / "tiny.tar"
    subprocess.run(["tar", "-cf", tar, "-C", src, "."], check=True)
    base, derived = f"{repo}:{key}", f"{repo}-derived:latest"
    subprocess.run(
        ["podman", "import", "-q", "--change", f"LABEL {HASH_LABEL}={key}",
         "--message", "agentbox image build", tar, base],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        _build_from(base, derived, tmp_path / "ctx")
        yield Family(settings, key, base, derived, kept)
    finally:
        subprocess.run(["podman", "rmi", "-i", derived], capture_output=True, check=False)
        subprocess.run(["podman", "rmi", "-i", base], capture_output=True, check=False)


def test_derived_image_inherits_the_label(family: Family) -> None:
    # The premise of the hole: podman copies the hash label into the derived image.
    out = subprocess.run(
        ["podman", "image", "inspect", "--format", "json", family.derived],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert json.loads(out)[0]["Labels"][HASH_LABEL] == family.key


def test_rm_of_a_derived_image_removes_nothing(family: Family) -> None:
    res = _cli(family.settings, "rm", family.derived)
    assert res.returncode == 1, res.stdout
    assert "not built by agentbox" in " ".join(res.stderr.split())
    assert _exists(family.derived) and _exists(family.base)
    assert (family.kept / "rootfs").is_dir()


def test_rm_of_a_base_in_use_is_refused(family: Family) -> None:
    for target in (family.base, family.key):
        with pytest.raises(ImageError, match="is the base of"):
            remove(family.settings, target)
    assert _exists(family.derived) and _exists(family.base)
    assert (family.kept / "rootfs").is_dir()
    # Once the derived image is gone, the base goes, exactly it and its root.
    subprocess.run(["podman", "rmi", family.derived], check=True, capture_output=True)
    removed = remove(family.settings, family.key)
    assert removed == [family.base, str(family.kept)]
    assert not _exists(family.base) and not family.kept.exists()


def test_ls_lists_only_what_agentbox_built(family: Family) -> None:
    res = _cli(family.settings, "ls", "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    mine = [r for r in rows if r["hash"] == family.key]
    assert [r["name"] for r in mine] == [family.base]
    assert not [r for r in rows if r["name"] == family.derived]
    assert family.derived not in {i.name for i in list_images(family.settings)}


def test_resolve_gives_a_derived_image_no_base_root(family: Family) -> None:
    # A microVM must not boot the base's root for an image that is not the base.
    got = resolve(family.settings, family.derived)
    assert (got.hash, got.rootfs) == (None, None)
    base = resolve(family.settings, family.base)
    assert (base.hash, base.rootfs) == (family.key, family.kept / "rootfs")


@pytest.mark.slow
def test_rm_of_an_image_built_from_the_default_keeps_the_default(
    default_image: str, tmp_path: Path
) -> None:
    settings = Settings()
    default = resolve(settings)
    assert default.name == DEFAULT_IMAGE and default.hash and default.rootfs
    derived = f"localhost/agentbox-test-{secrets.token_hex(4)}-fromdefault:latest"
    try:
        _build_from(DEFAULT_IMAGE, derived, tmp_path / "ctx")
        res = _cli(settings, "rm", derived)
        assert res.returncode == 1 and "not built by agentbox" in " ".join(res.stderr.split())
        res = _cli(settings, "ls", "--json")
        assert res.returncode == 0, res.stderr
        names = {r["name"] for r in json.loads(res.stdout)}
        assert DEFAULT_IMAGE in names and derived not in names
    finally:
        subprocess.run(["podman", "rmi", "-i", derived], capture_output=True, check=False)
    after = resolve(settings)
    assert (after.hash, after.podman_id, after.rootfs) == (
        default.hash,
        default.podman_id,
        default.rootfs,
    )
    assert default.rootfs.is_dir() and _exists(f"localhost/agentbox-default:{default.hash}")
