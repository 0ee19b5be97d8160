"""The unit suite's leak guard (tests/unit/conftest.py) really fails a leaking test.

A throw-away project with our pytest settings and this conftest runs three
tests in a child pytest: one leaks a file, one a socket (noticed only by the
garbage collector), one leaks nothing. The first two must fail, the third pass.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[1]

LEAKS = """
import gc
import socket


def test_leaks_a_file():
    f = open(__file__)
    del f


def test_leaks_a_socket():
    s = socket.socket()
    del s
    gc.collect()


def test_closes_what_it_opens():
    with open(__file__) as f:
        f.read()
"""


def test_a_leak_fails_the_unit_test_that_leaked(tmp_path: Path) -> None:
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    lines = ", ".join(f'"{w}"' for w in ini["filterwarnings"])
    (tmp_path / "pyproject.toml").write_text(
        f"[tool.pytest.ini_options]\nfilterwarnings = [{lines}]\n"
    )
    unit = tmp_path / "tests" / "unit"
    unit.mkdir(parents=True)
    shutil.copy(HERE / "conftest.py", unit / "conftest.py")
    (unit / "test_leaks.py").write_text(LEAKS)
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(unit)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = res.stdout
    assert "FAILED tests/unit/test_leaks.py::test_leaks_a_file" in out, out
    assert "FAILED tests/unit/test_leaks.py::test_leaks_a_socket" in out, out
    assert "PASSED tests/unit/test_leaks.py::test_closes_what_it_opens" in out, out
