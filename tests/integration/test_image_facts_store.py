"""``image_facts`` across processes: facts read once hold, in the process and in every
process forked from it (the front end's commands), while podman's image list is
unchanged; a name moved to another image, or removed, is inspected again and never
answered from the cache. Real podman, real images (a tag of the default image and an
image built from it with one label)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.backends.oci import _args as _oci_args
from agentbox.core import proc as _proc
from agentbox.errors import ImageError

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="root's podman image store"),
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
]


def _podman(*args: str) -> str:
    return subprocess.run(
        ["podman", *args], check=True, capture_output=True, text=True, timeout=300
    ).stdout.strip()


@pytest.fixture
def images(default_image: str, tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """(a test name tagged on the default image, that image's id, another image's id)."""
    token = secrets.token_hex(4)
    name = f"localhost/agentbox-facts-test-{token}:1"
    other = f"localhost/agentbox-facts-other-{token}:1"
    (tmp_path / "Containerfile").write_text(
        f"FROM {default_image}\nLABEL agentbox.test.facts={token}\n"
    )
    _podman("tag", default_image, name)
    try:
        _podman("build", "-q", "-t", other, "-f", str(tmp_path / "Containerfile"), str(tmp_path))
        first = _podman("image", "inspect", "--format", "{{.Id}}", name)
        second = _podman("image", "inspect", "--format", "{{.Id}}", other)
        assert first != second
        yield name, first, second
    finally:
        subprocess.run(["podman", "untag", default_image, name], capture_output=True, timeout=120)
        subprocess.run(["podman", "rmi", "-f", other], capture_output=True, timeout=120)
        subprocess.run(["podman", "rmi", name], capture_output=True, timeout=120)
        _oci_args.forget_image(name)


def _in_a_fork_without_podman(name: str) -> str:
    """What a fork of this process answers for ``name``, with podman out of reach."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        try:

            def no_podman(*_: object, **__: object) -> None:
                raise AssertionError("podman was run")

            _proc.run = no_podman  # type: ignore[assignment]
            os.write(w, _oci_args.image_facts(name).id.encode())
        except BaseException as exc:
            os.write(w, f"error: {exc}".encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        said = fh.read().decode()
    os.waitpid(pid, 0)
    return said


def test_facts_hold_across_forks_until_the_image_list_changes(
    images: tuple[str, str, str],
) -> None:
    name, first, second = images
    if _oci_args.store_signature() is None:
        pytest.skip("podman's image list cannot be told on this host (storage.conf)")
    _oci_args.forget_image(name)
    assert _oci_args.image_facts(name).id == first
    # A fork (the front end's command) inherits the facts and runs no podman for them.
    assert _in_a_fork_without_podman(name) == first
    # The name moved to another image: asked again, in this process and in a fork.
    _podman("tag", second, name)
    assert _in_a_fork_without_podman(name).startswith("error: podman was run")
    assert _oci_args.image_facts(name).id == second
    assert _in_a_fork_without_podman(name) == second
    # Removed: never the cached facts, the fix instead.
    _podman("untag", second, name)
    with pytest.raises(ImageError, match="not in podman's local storage"):
        _oci_args.image_facts(name)


def test_the_front_end_warm_up_reads_the_facts_its_forks_use(
    images: tuple[str, str, str],
) -> None:
    name, first, _ = images
    if _oci_args.store_signature() is None:
        pytest.skip("podman's image list cannot be told on this host (storage.conf)")
    _oci_args.forget_image(name)
    _oci_args.warm_image_facts(name)
    assert _in_a_fork_without_podman(name) == first
    missing = "localhost/agentbox-facts-missing:1"
    _oci_args.warm_image_facts(missing)  # raises nothing
    # Asked once while podman's image list is unchanged: no podman on each warm-up.
    real, calls = _oci_args._inspect_image, []

    def counted(image: str, **kw: object) -> object:
        calls.append(image)
        return real(image, **kw)  # type: ignore[arg-type]

    _oci_args._inspect_image = counted  # type: ignore[assignment]
    try:
        _oci_args.warm_image_facts(missing)
        assert calls == []
        _podman("tag", first, missing)  # the list changed: asked again, and found
        _oci_args.warm_image_facts(missing)
        assert calls == [missing]
        assert _in_a_fork_without_podman(missing) == first
    finally:
        _oci_args._inspect_image = real  # type: ignore[assignment]
        subprocess.run(["podman", "untag", first, missing], capture_output=True, timeout=120)
        _oci_args.forget_image(missing)
