"""The in-sandbox relay's C twin, built static at image-build time.

``guest/relay.py`` is what a sandbox starts (it binds 127.0.0.1:PORT, forks its
server and execs the agent); its server process then ``exec``s
``/opt/agentbox/relay``, built here from ``guest/relay.c``, so no Python
interpreter stays resident per sandbox (~6 MiB of PSS each against
~0.2). The binary is static (no libc of the image needed: a user's Containerfile
may bring any, or none), built on the host with its C compiler, and checked to
run before it goes into the image.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from agentbox.core import proc as _proc
from agentbox.errors import CommandError, ImageError

#: The guest source file, and the name of the program built from it (next to relay.py).
RELAY_SOURCE = "relay.c"
RELAY_BINARY = "relay"
_FLAGS = ("-O2", "-static", "-pthread", "-s")


def compile_relay(source: Path, out: Path) -> None:
    """Build ``source`` into the static program ``out`` (mode 0755, root-owned).

    :class:`ImageError` with the fix when there is no C compiler or static libc,
    or when the result does not run.
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ImageError(
            "no C compiler to build the in-sandbox relay (guest/relay.c): install gcc "
            "and the static C library (Debian: apt-get install gcc libc6-dev)"
        )
    with tempfile.TemporaryDirectory(prefix="agentbox-relay-") as tmp:
        built = Path(tmp) / RELAY_BINARY
        try:
            _proc.run([cc, *_FLAGS, "-o", str(built), str(source)], timeout=300)
            # Runs on its own (static, no loader): a bad option exits 2 with its usage.
            res = _proc.run([str(built), "--port"], timeout=30, check=False)
        except CommandError as exc:
            raise ImageError(f"cannot build the in-sandbox relay from {source}: {exc}") from exc
        if res.returncode != 2 or "usage: relay" not in res.stderr:
            raise ImageError(f"the in-sandbox relay built from {source} does not run: {res}")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, out)
    os.chown(out, 0, 0)
    out.chmod(0o755)
