"""Boxfile ``[setup]`` and ``[network]`` (issue 12): accepted shapes and strict refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.boxfile import Boxfile, NetworkPolicy, Setup, load_boxfile
from agentbox.errors import BoxfileError


def _load(tmp_path: Path, text: str) -> Boxfile:
    p = tmp_path / "Boxfile.toml"
    p.write_text(text)
    return load_boxfile(p)


def test_setup_and_network_tables(tmp_path: Path) -> None:
    box = _load(
        tmp_path,
        """
[setup]
run = ["python3 -m venv .venv", ".venv/bin/pip install -r requirements.txt"]
inputs = ["requirements*.txt", "pyproject.toml"]
network = "registries"
deadline = 600

[network]
allow = ["Docs.Example.org.", "*.example.com", "docs.example.org"]
""",
    )
    assert box.setup == Setup(
        run=("python3 -m venv .venv", ".venv/bin/pip install -r requirements.txt"),
        inputs=("requirements*.txt", "pyproject.toml"),
        network="registries",
        deadline=600,
    )
    # Lower-cased, trailing dot dropped, repeats removed.
    assert box.egress_allow == ("docs.example.org", "*.example.com")
    assert isinstance(box.network, NetworkPolicy)


def test_defaults_have_no_setup_and_no_egress() -> None:
    box = Boxfile.from_dict({})
    assert box.setup is None and box.egress_allow == () and box.network == "none"
    setup = Boxfile.from_dict({"setup": {"run": ["true"]}}).setup
    assert setup is not None and setup.network == "none" and setup.deadline == 900


@pytest.mark.parametrize(
    ("data", "key", "words"),
    [
        ({"network": "host"}, "network", "sandboxes have no network"),
        ({"network": {"allow": ["10.0.0.1"]}}, "network", "no IP literals"),
        ({"network": {"allow": ["*"]}}, "network", "not a host name"),
        ({"network": {"allow": ["a..b"]}}, "network", "not a host name"),
        ({"network": {"allow": ["x.org:443"]}}, "network", "not a host name"),
        ({"network": {"allow": ["x.123"]}}, "network", "no IP literals"),
        ({"network": {"allow": "x.org"}}, "network", "tuple"),
        ({"network": {"allow": ["x.org"], "deny": ["y"]}}, "network", "unknown key"),
        ({"network": {"allow": [f"h{i}.org" for i in range(65)]}}, "network", "at most 64"),
        ({"setup": {"run": []}}, "setup.run", "at least 1"),
        ({"setup": {"run": ["ok", "bad\0"]}}, "setup.run", "without NUL"),
        ({"setup": {"run": ["x" * 9000]}}, "setup.run", "1..8192"),
        ({"setup": {"run": ["true"], "inputs": ["../etc/passwd"]}}, "setup.inputs", "'..'"),
        ({"setup": {"run": ["true"], "inputs": ["/etc/passwd"]}}, "setup.inputs", "relative"),
        ({"setup": {"run": ["true"], "network": "all"}}, "setup.network", "'registries'"),
        ({"setup": {"run": ["true"], "deadline": 0}}, "setup.deadline", "greater than 0"),
        ({"setup": {"run": ["true"], "keep": ["/etc"]}}, "setup.keep", "under '~/'"),
        ({"setup": {"run": ["true"], "keep": ["~/../etc"]}}, "setup.keep", "without '..'"),
        ({"setup": {"run": ["true"], "keep": ["~/"]}}, "setup.keep", "under '~/'"),
        ({"setup": {"run": ["true"], "keep": ["~/a'b"]}}, "setup.keep", "under '~/'"),
        ({"setup": {"run": ["true"], "cache": ["x"]}}, "setup.cache", "unknown key"),
    ],
)
def test_bad_setup_and_network_are_refused_naming_the_key(
    data: dict[str, object], key: str, words: str
) -> None:
    with pytest.raises(BoxfileError) as exc:
        Boxfile.from_dict(data)
    assert exc.value.key == key
    assert words in str(exc.value)
