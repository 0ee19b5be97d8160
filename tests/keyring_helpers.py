"""A host user's keyring for tests: the real ``keyring`` library with keyrings.alt's
plaintext file backend (this machine runs no D-Bus secret service), chosen the way a
user chooses one, by ``keyringrc.cfg``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def _python_with_keyring() -> str | None:
    """A python3 that has the keyring library and keyrings.alt's file backends."""
    for py in ("/usr/bin/python3", shutil.which("python3")):
        if (
            py
            and subprocess.run(
                [py, "-c", "import keyring, keyrings.alt.file"], capture_output=True, check=False
            ).returncode
            == 0
        ):
            return py
    return None


def keyring_home(env: dict[str, str], entries: dict[tuple[str, str], str]) -> None:
    """The user's keyring: keyrings.alt's plaintext file backend chosen by keyringrc.cfg
    (no D-Bus secret service here), ``entries`` stored by the keyring library itself.
    ``env["PATH"]`` then finds that python3 first. Skips where no python3 has keyring."""
    py = _python_with_keyring()
    if py is None:
        pytest.skip("no python3 with keyring and keyrings.alt (apt install python3-keyrings.alt)")
    home = Path(env["HOME"])
    (home / ".config" / "python_keyring").mkdir(parents=True, exist_ok=True)
    (home / ".config" / "python_keyring" / "keyringrc.cfg").write_text(
        "[backend]\ndefault-keyring=keyrings.alt.file.PlaintextKeyring\n"
    )
    env["PATH"] = f"{Path(py).parent}:{env['PATH']}"
    for (service, user), password in entries.items():
        subprocess.run(
            [py, "-c", "import keyring, sys; keyring.set_password(sys.argv[1], sys.argv[2], "
             "sys.stdin.read())", service, user],
            input=password, text=True, env={"HOME": str(home), "PATH": env["PATH"]}, check=True,
        )  # fmt: skip
