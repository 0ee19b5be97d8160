"""Shared fixtures of the e2e tests.

``env_lab``: the environment scenarios' (issue 12) common ground, one per test module
(see tests/env_helpers.py): a factory of labs, each a private data dir, a replay model and
one launcher, cleaned at the module's end with the frozen environments and image tags made
(the images themselves stay as the session's content-addressed cache).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.launcher import Launcher
from env_helpers import EnvLab


@pytest.fixture(scope="module")
def env_lab() -> Iterator[Callable[..., EnvLab]]:
    """A factory ``make(prefix, script, max_tasks=1, **settings)`` of :class:`EnvLab`;
    every lab made is closed and cleaned at the module's end (its launcher, frozen
    environments, images, and dir unless ``E2E_KEEP_DIRS``)."""
    from agentbox.env import EnvStore
    from agentbox.image import build_default

    if os.geteuid() != 0:
        pytest.skip("the launcher runs as root")
    build_default(Settings())
    labs: list[EnvLab] = []

    def make(prefix: str, script: str, *, max_tasks: int = 1, **settings: object) -> EnvLab:
        base = Path(tempfile.mkdtemp(prefix=f"agentbox-{prefix}-", dir="/var/tmp"))
        base.chmod(0o711)
        model = f"replay-{prefix}"
        (base / "script.yaml").write_text(script)
        (base / "models.toml").write_text(
            f'[models.{model}]\nkind = "replay"\nupstream = "{base / "script.yaml"}"\n'
        )
        (base / "data").mkdir()
        (base / "repos").mkdir()
        s = Settings(
            data_dir=base / "data", repos_root=base / "repos",
            models_file=base / "models.toml", **settings,  # type: ignore[arg-type]
        )  # fmt: skip
        lab = EnvLab(base, s, model, Launcher(s, max_tasks=max_tasks))
        labs.append(lab)
        return lab

    try:
        yield make
    finally:
        for lab in labs:
            lab.launcher.close()
            store = EnvStore(lab.settings)
            for key in lab.keys:
                store.remove(key, force=True)
            for tag, _digest in lab.images:
                # The tag only: the content-addressed image (and docker's copy, named by
                # its hash) is the session's cache for the next module that builds it.
                subprocess.run(["podman", "untag", tag], check=False, capture_output=True)
            if not os.environ.get("E2E_KEEP_DIRS"):
                shutil.rmtree(lab.base, ignore_errors=True)
