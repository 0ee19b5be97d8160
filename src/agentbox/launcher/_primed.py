"""A first command made ready ahead in the SDK's warm spare (podman): no client start on claim.

A ``podman exec`` costs a podman client start and a runtime exec (hundreds of ms on a
busy host); the spare is started ahead, and so is its first exec: a ``podman exec -i``
as the sandbox's uid in its workdir (the same confinement as every exec) whose bash
waits for one line on its stdin: the command's argv, NUL-separated, base64. On the
claimant's first command the launcher writes that line (then the command's stdin, then
EOF) and the waiting bash ``exec``-s the command: its output and exit code come back
through the exec already running. Only the launcher holds the pipe's host end; a process
in the sandbox that wrote to it would be the sandbox's own uid running a command in its
own sandbox, which it may do anyway.
"""

from __future__ import annotations

import base64
import contextlib
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

_SCRIPT = (
    'IFS= read -r line || exit 125; mapfile -d "" -t a < <(printf %s "$line" | base64 -d); '
    '[ "${#a[@]}" -gt 0 ] || exit 125; exec "${a[@]}"'
)


class Primed:
    """One ``podman exec`` of sandbox ``name`` waiting for its command."""

    def __init__(self, name: str, uid: int, workdir: str, cwd: Path) -> None:
        argv = ["podman", "exec", "-i", "--user", f"{uid}:{uid}", "--workdir", workdir,
                name, "bash", "-c", _SCRIPT]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, cwd=cwd,
                                     start_new_session=True)  # fmt: skip

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None,
        on_stdout: Callable[[bytes], None],
        on_stderr: Callable[[bytes], None],
    ) -> int:
        """Run ``argv`` in the waiting exec; stream its output; its exit code."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        assert self.proc.stderr is not None
        line = base64.b64encode(b"\0".join(a.encode() for a in argv)) + b"\n"

        def pump(src: IO[bytes], sink: Callable[[bytes], None]) -> None:
            while chunk := src.read1(65536):  # type: ignore[attr-defined]
                sink(chunk)

        readers = [
            threading.Thread(target=pump, args=(self.proc.stdout, on_stdout), daemon=True),
            threading.Thread(target=pump, args=(self.proc.stderr, on_stderr), daemon=True),
        ]
        for t in readers:
            t.start()
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.write(line + (stdin or b""))
            self.proc.stdin.flush()
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        rc = self.proc.wait()
        for t in readers:
            t.join()
        self.close()
        return rc

    def close(self) -> None:
        """End it if it still waits (its bash sees EOF and exits 125); idempotent."""
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        if self.proc.poll() is None:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
