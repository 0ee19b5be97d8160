"""The data dir's seal key (``backends._detached.detach_key``): one key, whole, private."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from agentbox.backends._detached import check_launch, detach_key
from agentbox.config import Settings
from agentbox.errors import ConfigError


def _read(data_dir: str) -> bytes:
    return detach_key(Settings(data_dir=Path(data_dir)))


def test_racing_makers_all_get_the_one_whole_key(tmp_path: Path) -> None:
    data = tmp_path / "data"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(8) as pool:
        keys = pool.map(_read, [str(data)] * 32)
    assert len(set(keys)) == 1 and len(keys[0]) == 32
    key_file = data / "detach.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in data.iterdir()] == ["detach.key"]  # no temporary left
    assert _read(str(data)) == keys[0]


def test_a_launch_needs_a_command_and_an_absolute_log(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs a command"):
        check_launch([], tmp_path / "log")
    with pytest.raises(ConfigError, match="absolute path"):
        check_launch(["true"], Path("relative.log"))
    with pytest.raises(ConfigError, match="absolute path"):
        check_launch(["true"], tmp_path / "missing" / "log")
    check_launch(["true"], tmp_path / "log")
