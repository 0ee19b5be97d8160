"""Settings: typed, from env and file, injectable."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.config import Settings, load_settings
from agentbox.errors import ConfigError


def test_env_overrides_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'data_dir = "{tmp_path}/from-file"\nsandbox_uid = 64001\n')
    monkeypatch.setenv("AGENTBOX_CONFIG", str(cfg))
    monkeypatch.setenv("AGENTBOX_DATA_DIR", str(tmp_path / "from-env"))
    s = load_settings()
    assert s.data_dir == tmp_path / "from-env"
    assert s.sandbox_uid == 64001


def test_seed_runtime_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTBOX_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setenv("AGENTBOX_AGENT_RUNTIME", "runsc")
    assert load_settings().runtime == "runsc"


def test_bad_values_are_config_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTBOX_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setenv("AGENTBOX_BACKEND", "lxc")
    with pytest.raises(ConfigError, match="backend"):
        load_settings()


def test_unknown_file_key_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("no_such_setting = 1\n")
    monkeypatch.setenv("AGENTBOX_CONFIG", str(cfg))
    with pytest.raises(ConfigError, match="no_such_setting"):
        load_settings()


def test_broken_toml_names_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("data_dir = \n")
    monkeypatch.setenv("AGENTBOX_CONFIG", str(cfg))
    with pytest.raises(ConfigError, match=str(cfg)):
        load_settings()


def test_mount_roots_from_colon_list(tmp_path: Path) -> None:
    s = Settings(mount_roots=f"{tmp_path}/a:{tmp_path}/b")  # type: ignore[arg-type]
    assert s.mount_roots == (tmp_path / "a", tmp_path / "b")


def test_sandbox_host_uid_owns_nothing_of_root() -> None:
    s = Settings()
    assert s.sandbox_host_uid == 164000
    assert s.sandbox_host_uid != 0


def test_mount_roots_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTBOX_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setenv("AGENTBOX_MOUNT_ROOTS", f"{tmp_path}/a:{tmp_path}/b")
    assert load_settings().mount_roots == (tmp_path / "a", tmp_path / "b")


def test_host_defaults_fill_a_boxfile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The seed's AGENTBOX_AGENT_RUNTIME=runsc reaches every sandbox that does not say otherwise."""
    from agentbox.boxfile import Boxfile

    monkeypatch.setenv("AGENTBOX_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setenv("AGENTBOX_AGENT_RUNTIME", "runsc")
    monkeypatch.setenv("AGENTBOX_BACKEND", "qemu")
    s = load_settings()
    box = Boxfile.from_dict({}, settings=s)
    assert (box.runtime, box.backend, box.image) == ("runsc", "qemu", s.image)
    # A Boxfile's own choice wins over the host default.
    assert Boxfile.from_dict({"runtime": "runc"}, settings=s).runtime == "runc"
