"""A command the front end forked loads its settings once: those its fork checked (they
name the front end's data dir) are the ones ``agentbox run`` takes, not a second load."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox import config
from agentbox.cli import _run
from agentbox.front import _child


def test_run_takes_the_settings_the_fork_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTBOX_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(_child, "checked_settings", None)
    _child._check_settings(tmp_path)
    checked = _child.checked_settings
    assert checked is not None and checked.data_dir == tmp_path

    def no_load(**_: object) -> None:
        raise AssertionError("loaded again")

    monkeypatch.setattr(_run, "load_settings", no_load)
    assert _run._settings() is checked


def test_another_data_dir_is_refused_and_nothing_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTBOX_DATA_DIR", str(tmp_path / "other"))
    monkeypatch.setattr(_child, "checked_settings", None)
    with pytest.raises(ValueError, match="data dir"):
        _child._check_settings(tmp_path)
    assert _child.checked_settings is None
    # Not a served command: loaded as ever.
    assert _run._settings().data_dir == config.load_settings().data_dir
