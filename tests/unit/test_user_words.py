"""What a new user reads: errors in the words of what they typed (issue 34, items 11-20).

Each test runs the real code (the CLI through typer's runner, the Boxfile parser, the
launcher's checks) with no services; each fails on the code before the issue.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentbox.boxfile import Boxfile, loads_boxfile
from agentbox.errors import BoxfileError, PolicyRefused

# -- item 11: a flag's bad value names the flag and its unit --------------------------


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"deadline": 5}, "--deadline must be at least 10 seconds, got 5"),
        ({"deadline": 90000}, "--deadline must be at most 86,400 seconds, got 90,000"),
        ({"budget": 0}, "--budget must be at least 1 token, got 0"),
        ({"model": ""}, "--model must not be empty"),
        ({"model": "m" * 200}, "--model must be at most 128 characters"),
    ],
)
def test_a_flags_bad_value_names_the_flag_and_unit(fields: dict[str, object], words: str) -> None:
    from agentbox.cli._run import _request

    with pytest.raises(PolicyRefused) as ei:
        _request(repo="/srv/r", task="do it", **fields)
    assert str(ei.value) == words
    assert "Input should" not in str(ei.value)


def test_run_deadline_5_says_the_flag(tmp_path: Path) -> None:
    """``agentbox run --deadline 5`` as the user types it: the refusal names the flag."""
    from agentbox.cli import app

    out = CliRunner().invoke(
        app, ["run", "--repo", str(tmp_path), "--deadline", "5", "--detach", "x"]
    )
    assert isinstance(out.exception, PolicyRefused), out.output
    assert str(out.exception) == "--deadline must be at least 10 seconds, got 5"


# -- item 20: every unknown Boxfile key, with "did you mean" --------------------------


def test_every_unknown_boxfile_key_is_named_with_a_near_miss() -> None:
    text = (
        'netwrok = "none"\nimagee = "x"\nflavour = 1\n'
        '[setup]\nrun = ["true"]\nrnu = ["x"]\n[resources]\ncpu = 2\n'
    )
    with pytest.raises(BoxfileError) as ei:
        loads_boxfile(text, path=Path("/r/Boxfile.toml"))
    msg = str(ei.value)
    assert "[netwrok] unknown key (did you mean [network]?)" in msg
    assert "[imagee] unknown key (did you mean [image]?)" in msg
    assert "[setup.rnu] unknown key (did you mean [setup.run]?)" in msg
    assert "[resources.cpu] unknown key (did you mean [resources.cpus]?)" in msg
    assert "[flavour] unknown key" in msg and "[flavour] unknown key (" not in msg
    assert msg.startswith("/r/Boxfile.toml: 5 problems: ")
    assert ei.value.key is not None


def test_one_unknown_key_keeps_its_key_and_suggests() -> None:
    with pytest.raises(BoxfileError) as ei:
        Boxfile.from_dict({"image": {"containerfile": "C", "contxt": "."}})
    assert ei.value.key == "image.contxt"
    assert str(ei.value) == "[image.contxt] unknown key (did you mean [image.context]?)"


def test_an_internal_key_is_never_suggested() -> None:
    with pytest.raises(BoxfileError) as ei:
        Boxfile.from_dict({"capabilitie": 1})
    assert "did you mean" not in str(ei.value)
