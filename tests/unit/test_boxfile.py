"""The Boxfile: unknown keys and bad values are refused with the key named."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.boxfile import Boxfile, load_boxfile, parse_size
from agentbox.config import Settings
from agentbox.errors import BoxfileError, PathRefused


def _load(tmp_path: Path, text: str) -> Boxfile:
    p = tmp_path / "Boxfile"
    p.write_text(text)
    return load_boxfile(p)


def test_full_example_parses(tmp_path: Path) -> None:
    box = _load(
        tmp_path,
        """
image = "localhost/agentbox-default:latest"
backend = "podman"
runtime = "runsc"
isolation = "strict"
deadline = 1800
[resources]
cpus = 2
memory = "512MiB"
pids = 256
nofile = 1024
[[mounts]]
source = "/opt/venvs/proj"
target = "/opt/venv"
[env]
allow = ["LANG"]
set = { PYTHONDONTWRITEBYTECODE = "1" }
""",
    )
    assert box.runtime == "runsc"
    assert box.resources.memory == 512 * 1024**2
    assert box.mounts[0].target == "/opt/venv"
    assert box.env.set == {"PYTHONDONTWRITEBYTECODE": "1"}


def test_defaults_are_the_seeds() -> None:
    box = Boxfile()
    assert (box.resources.cpus, box.resources.memory) == (4.0, 8 * 1024**3)
    assert (box.resources.pids, box.resources.nofile) == (512, 4096)
    assert box.network == "none" and box.capabilities == ()


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('imagee = "x"', "imagee"),
        ('runtime = "kata"', "runtime"),
        ('backend = "lxc"', "backend"),
        ("deadline = -1", "deadline"),
        ('[resources]\nmemory = "lots"', "resources.memory"),
        ("[resources]\nnofile = 100000", "resources.nofile"),
        ("[resources]\ncpus = 0", "resources.cpus"),
        ('[resources]\nswap = "1g"', "resources.swap"),
        ('[[mounts]]\nsource = "rel/path"\ntarget = "/x"', "mounts.0.source"),
        ('[[mounts]]\nsource = "/opt/x"\ntarget = "/usr/lib/x"', "mounts.0.target"),
        ('[[mounts]]\nsource = "/opt/x"\ntarget = "/workspace"', "mounts.0.target"),
        ('[[mounts]]\nsource = "/opt/x"\ntarget = "/x"\nread_only = false', "mounts.0.read_only"),
        ('[env]\nallow = ["ANTHROPIC_API_KEY"]', "env.allow"),
        ('[env]\nallow = ["GITHUB_TOKEN"]', "env.allow"),
        ('[env]\nset = { LD_PRELOAD = "/x.so" }', "env.set"),
    ],
)
def test_bad_input_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(BoxfileError) as ei:
        _load(tmp_path, text)
    assert ei.value.key == key
    assert f"[{key}]" in str(ei.value)


@pytest.mark.parametrize(
    ("text", "key", "words"),
    [
        ('capabilities = ["CAP_SYS_ADMIN"]', "capabilities", "cannot be granted"),
        ('network = "host"', "network", "no network"),
        ('network = "bridge"', "network", "no network"),
    ],
)
def test_capabilities_and_networks_are_refused_by_name(
    tmp_path: Path, text: str, key: str, words: str
) -> None:
    with pytest.raises(BoxfileError, match=words) as ei:
        _load(tmp_path, text)
    assert ei.value.key == key


def test_not_toml(tmp_path: Path) -> None:
    with pytest.raises(BoxfileError, match="not valid TOML"):
        _load(tmp_path, "image = ")


def test_mount_outside_roots_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "roots"
    (root / "venv").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    settings = Settings(data_dir=tmp_path, mount_roots=(root,))
    ok = Boxfile.from_dict({"mounts": [{"source": str(root / "venv"), "target": "/opt/venv"}]})
    assert ok.check_mounts(settings)[0].target == "/opt/venv"
    bad = Boxfile.from_dict({"mounts": [{"source": str(tmp_path / "elsewhere"), "target": "/e"}]})
    with pytest.raises(PathRefused, match="mount root"):
        bad.check_mounts(settings)


def test_mount_escaping_a_root_through_a_link_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "roots"
    root.mkdir()
    (tmp_path / "secret").mkdir()
    (root / "link").symlink_to(tmp_path / "secret")
    settings = Settings(data_dir=tmp_path, mount_roots=(root,))
    box = Boxfile.from_dict({"mounts": [{"source": str(root / "link"), "target": "/opt/x"}]})
    with pytest.raises(PathRefused):
        box.check_mounts(settings)


@pytest.mark.parametrize(
    ("value", "size"),
    [(1024, 1024), ("8GiB", 8 * 1024**3), ("512m", 512 * 1024**2), ("1.5g", int(1.5 * 1024**3))],
)
def test_parse_size(value: object, size: int) -> None:
    assert parse_size(value) == size


@pytest.mark.parametrize("value", [True, 0, -5, "ten", "5 parsecs", None])
def test_parse_size_refuses(value: object) -> None:
    with pytest.raises(ValueError):
        parse_size(value)
