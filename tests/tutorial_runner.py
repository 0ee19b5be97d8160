"""Run a tutorial's command blocks verbatim, from the markdown itself.

The convention (written for authors in ``docs/tutorials/README.md``):

* A fenced block whose info string is ``console`` is a terminal session. A line
  that starts with a prompt, ``# `` (root) or ``$ ``, is a command; a command
  continues on the next line after a trailing ``\\`` and through a here-document
  (``<<'EOF'`` … ``EOF``). Every other line is the output the tutorial shows:
  checked *loosely*, each such line must appear in what the commands printed so
  far in that block (``…`` matches anything, runs of blanks match any blanks; a
  line that is only ``…`` is not checked).
* Any other fence (``sh``, ``text``, ``toml`` …) is only shown, never run; a
  tutorial keeps its commands in ``console`` blocks (a unit test holds it to that).
* An HTML comment on the line(s) before a ``console`` block annotates it:
  ``<!-- not-run: REASON -->`` shows it without running it (the runner reports
  the reason); ``<!-- background -->`` runs its one command the way a user runs it
  in another terminal (in the background, until the tutorial ends); its output
  lines are then what to wait for.
* ``<!-- requires: ray -->`` anywhere in the file names facilities the tutorial
  needs beyond the default ones (the test skips with the reason when absent).

Commands run one at a time, in order, in one ``bash`` (so ``cd``, variables and
``. .venv/bin/activate`` carry over, as in a terminal), started in the checkout
under test, each with stdin from ``/dev/null``. A command that exits non-zero, or
a shown output line that never appears, fails the run, naming the file and line.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import select
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Block",
    "Command",
    "ShellSession",
    "StepFailed",
    "TutorialRun",
    "expected_pattern",
    "parse_tutorial",
    "requirements",
    "run_tutorial",
]

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
_ANNOTATION = re.compile(r"<!--\s*(not-run|background)\s*(?::\s*(.*?))?\s*-->")
_REQUIRES = re.compile(r"<!--\s*requires:\s*(.*?)\s*-->")
_PROMPT = re.compile(r"^(#|\$) ")
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")


@dataclass
class Command:
    """One command of a console block: its text (continuations joined by newlines)."""

    text: str
    line: int
    """1-based line in the markdown where the command starts."""
    expect: list[tuple[int, str]] = field(default_factory=list)
    """Output lines shown after it (line number, text)."""


@dataclass
class Block:
    """A fenced block: its language, where it is, its commands, how it is annotated."""

    lang: str
    line: int
    commands: list[Command]
    not_run: str | None = None
    background: bool = False
    body: list[str] = field(default_factory=list)

    @property
    def runs(self) -> bool:
        """A console block with commands that is not marked not-run."""
        return self.lang == "console" and self.not_run is None and bool(self.commands)


def requirements(text: str) -> set[str]:
    """The facilities a tutorial names in ``<!-- requires: a, b -->``."""
    out: set[str] = set()
    for m in _REQUIRES.finditer(text):
        out |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    return out


def parse_tutorial(text: str) -> list[Block]:
    """Every fenced block of a markdown text, console blocks split into commands."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    pending: tuple[str, str] | None = None  # the annotation before the next fence
    while i < len(lines):
        m = _FENCE.match(lines[i])
        ann = _ANNOTATION.search(lines[i])
        if ann and not m:
            pending = (ann.group(1), ann.group(2) or "")
            i += 1
            continue
        if not m:
            if lines[i].strip():
                pending = None  # an annotation applies only to the block right after it
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3)
        start = i + 1
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        block = Block(lang=lang, line=start, commands=[], body=body)
        if pending is not None:
            kind, arg = pending
            if kind == "not-run":
                block.not_run = arg or "marked not-run"
            else:
                block.background = True
            pending = None
        if lang == "console":
            block.commands = _commands(body, start + 1)
        blocks.append(block)
    return blocks


def _commands(body: list[str], first_line: int) -> list[Command]:
    cmds: list[Command] = []
    j = 0
    while j < len(body):
        raw = body[j]
        if not _PROMPT.match(raw):
            if cmds and raw.strip() and raw.strip() != "…":
                cmds[-1].expect.append((first_line + j, raw))
            j += 1
            continue
        start = j
        parts = [raw[2:]]
        heredocs = [h.group(2) for h in _HEREDOC.finditer(raw[2:])]
        # Continued after a trailing backslash or while a quote is open.
        while (parts[-1].endswith("\\") or _open_quote("\n".join(parts))) and j + 1 < len(body):
            j += 1
            parts.append(body[j])
            heredocs += [h.group(2) for h in _HEREDOC.finditer(body[j])]
        for word in heredocs:
            while j + 1 < len(body):
                j += 1
                parts.append(body[j])
                if body[j].strip() == word:
                    break
        cmds.append(Command(text="\n".join(parts), line=first_line + start))
        j += 1
    return cmds


def _open_quote(text: str) -> bool:
    """A quote is still open at the end of ``text`` (the shell would read on)."""
    import shlex

    lex = shlex.shlex(text.split("<<", 1)[0], posix=True)
    lex.whitespace_split = True
    lex.commenters = "#"  # a comment's apostrophe opens nothing
    try:
        list(lex)
    except ValueError:
        return True
    return False


def expected_pattern(shown: str) -> re.Pattern[str]:
    """A shown output line as a loose pattern: ``…`` is anything, blanks are any blanks."""
    pieces = [re.escape(p) for p in shown.strip().split("…")]
    rx = ".*".join(re.sub(r"(\\ )+|\s+", r"\\s+", p) for p in pieces)
    return re.compile(rx)


class StepFailed(AssertionError):
    """A tutorial command failed or did not print what the tutorial shows."""


class ShellSession:
    """One ``bash`` fed commands one at a time, output (stdout and stderr) kept in order."""

    def __init__(self, *, cwd: Path, env: Mapping[str, str], workdir: Path) -> None:
        self.workdir = workdir
        self.marker = uuid.uuid4().hex
        self.out = ""
        self._n = 0
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        os.set_blocking(self._fd, False)

    def _pump(self, wait: float) -> None:
        ready, _, _ = select.select([self._fd], [], [], wait)
        if not ready:
            return
        with contextlib.suppress(BlockingIOError):
            chunk = os.read(self._fd, 1 << 16)
            if chunk:
                self.out += chunk.decode("utf-8", errors="replace")
            elif self.proc.poll() is not None:
                time.sleep(wait)  # EOF: nothing more will come

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()

    def run(self, text: str, *, background: bool, timeout: float) -> tuple[int, int, int]:
        """Run one command; (exit code, output start, output end) once it returned."""
        self._n += 1
        script = self.workdir / f"step-{self._n:03d}.sh"
        # In the background: the whole command, as a user's other terminal would run it.
        script.write_text(f"{{\n{text}\n}} &\n" if background else text + "\n")
        start = len(self.out)
        tag = f"{self.marker}:{self._n}"
        self._send(f'source {script} </dev/null; printf "\\n@@{tag}:%s@@\\n" "$?"\n')
        rx = re.compile(rf"\n@@{re.escape(tag)}:(\d+)@@\n")
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = rx.search(self.out, start)
            if m:
                self.out = self.out[: m.start()] + self.out[m.end() :]
                return int(m.group(1)), start, m.start()
            if self.proc.poll() is not None:
                raise StepFailed(f"the shell exited ({self.proc.returncode}) during the command")
            self._pump(0.2)
        raise StepFailed(f"still running after {timeout:.0f} s")

    def wait_for(self, rx: re.Pattern[str], since: int, timeout: float) -> bool:
        """Until ``rx`` matches a line of the output from ``since`` on (background output)."""
        end = time.monotonic() + timeout
        while True:
            if any(rx.search(line) for line in self.out[since:].splitlines()):
                return True
            if time.monotonic() >= end:
                return False
            self._pump(0.2)

    def close(self) -> None:
        """Stop the background jobs and the shell (TERM, then KILL), read what is left."""
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._send("kill $(jobs -p) 2>/dev/null; wait; exit 0\n")
                self.proc.stdin.close()  # type: ignore[union-attr]
            end = time.monotonic() + 60
            while self.proc.poll() is None and time.monotonic() < end:
                self._pump(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@dataclass
class TutorialRun:
    """What a run did: each command with its outcome, and the blocks it skipped (why)."""

    path: Path
    ran: list[tuple[Command, int]] = field(default_factory=list)
    skipped: list[tuple[Block, str]] = field(default_factory=list)
    transcript: str = ""


def run_tutorial(
    path: Path,
    *,
    cwd: Path,
    env: Mapping[str, str],
    workdir: Path,
    timeout: float = 900.0,
    output_wait: float = 60.0,
    text: str | None = None,
    on_step: Callable[[Command], None] | None = None,
) -> TutorialRun:
    """Run ``path``'s console blocks (``text`` instead of the file's, for tests of this).

    ``output_wait``: how long a shown output line may take to come after its command
    returned (output of a job the command started with ``&``); a background block's
    lines may take up to ``timeout``.

    Raises :class:`StepFailed` naming the file, the line and the command, with the
    output's tail. ``workdir`` holds the step scripts; the caller cleans up what the
    tutorial started (see :func:`kill_marked`).
    """
    text = path.read_text() if text is None else text
    result = TutorialRun(path=path)
    sh = ShellSession(cwd=cwd, env=env, workdir=workdir)
    try:
        for block in parse_tutorial(text):
            if block.lang != "console":
                continue
            if block.not_run is not None:
                result.skipped.append((block, block.not_run))
                continue
            block_start = len(sh.out)
            for cmd in block.commands:
                if on_step is not None:
                    on_step(cmd)
                where = f"{path.name}:{cmd.line}: {cmd.text.splitlines()[0]!r}"
                try:
                    rc, start, _ = sh.run(cmd.text, background=block.background, timeout=timeout)
                except StepFailed as exc:
                    raise StepFailed(f"{where}: {exc}\n--- output ---\n{sh.out[-6000:]}") from None
                result.ran.append((cmd, rc))
                if rc != 0:
                    raise StepFailed(
                        f"{where} exited {rc}\n--- output ---\n{sh.out[start:][-6000:]}"
                    )
                for line_no, shown in cmd.expect:
                    # Shown lines may come from this block's earlier commands or, for a
                    # background command, later: wait for them a while.
                    wait = timeout if block.background else output_wait
                    if not sh.wait_for(expected_pattern(shown), block_start, wait):
                        raise StepFailed(
                            f"{path.name}:{line_no}: the tutorial shows {shown.strip()!r} "
                            f"after {cmd.text.splitlines()[0]!r}, which did not print it\n"
                            f"--- output ---\n{sh.out[block_start:][-6000:]}"
                        )
    finally:
        sh.close()
        result.transcript = sh.out
    return result


def marked_pids(marker_env: str) -> Iterator[int]:
    """Processes whose environment holds ``marker_env`` (``NAME=value``) exactly."""
    want = marker_env.encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if want in (d / "environ").read_bytes().split(b"\0"):
                yield int(d.name)


def kill_marked(marker_env: str, *, grace: float = 30.0) -> list[int]:
    """TERM every process the run started (found by its marker), then KILL survivors."""
    pids = list(marked_pids(marker_env))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(True for _ in marked_pids(marker_env)):
        time.sleep(0.2)
    for pid in marked_pids(marker_env):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


_OPERATORS = {"|", "||", "&&", ";", "&", ")", "(", "|&"}
_REDIRECT = re.compile(r"^(\d*>>?|&>|<|>\|)")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PREFIXES = {"sudo", "env", "exec", "time", "nohup", "setsid", "command"}


def agentbox_invocations(command: str) -> list[list[str]]:
    """The ``agentbox …`` calls in a shell command, as argument lists (words after it).

    Enough shell for tutorials: quotes, ``\\`` continuations, ``;``/``&&``/``|``,
    ``$( … )``, leading ``VAR=value`` words; a here-document's body is not searched.
    """
    import shlex

    first = command.split("\n")
    keep: list[str] = []
    heredoc: str | None = None
    for line in first:
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        keep.append(line)
        h = _HEREDOC.search(line)
        if h:
            heredoc = h.group(2)
    text = "\n".join(keep).replace("\\\n", " ").replace("$(", " ( ")
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|()")
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        words = list(lex)
    except ValueError:
        return []
    calls: list[list[str]] = []
    cur: list[str] | None = None
    at_command = True  # the next word names the program (start, after an operator)
    skip_next = False
    for w in [*words, ";"]:
        if skip_next:
            skip_next = False
            continue
        if w in _OPERATORS:
            if cur is not None:
                calls.append(cur)
            cur, at_command = None, True
        elif _REDIRECT.match(w):
            skip_next = w in (">", ">>", "<", "2>", "2>>", "&>", ">|")  # the target follows
        elif cur is not None:
            cur.append(w)
        elif at_command and (w == "agentbox" or w.endswith("/bin/agentbox")):
            cur = []
        elif at_command and not (_ASSIGN.match(w) or w in _PREFIXES):
            at_command = False
    return calls


@functools.cache
def _cli() -> Any:
    import typer.main

    from agentbox.cli import app

    return typer.main.get_command(app)


def cli_error(args: list[str]) -> str | None:
    """Why ``agentbox ARGS`` would be refused by the CLI's parser (None: it parses).

    Resolves the subcommands, then parses the options and arguments exactly as the
    real command would, without running it (``--help`` and ``--version`` excepted).
    """
    from typer._click import exceptions as click_exc  # typer vendors click

    if any(a in ("--help", "-h", "--version") for a in args):
        return None
    cmd = _cli()
    path = ["agentbox"]
    rest = list(args)
    while hasattr(cmd, "list_commands"):  # a group: the next word names a subcommand
        if not rest or rest[0].startswith("-"):
            return f"{' '.join(path)}: no subcommand named (got {rest[:1]})"
        sub = cmd.get_command(cmd.make_context(" ".join(path), [], resilient_parsing=True), rest[0])
        if sub is None:
            return f"{' '.join(path)}: no command {rest[0]!r}"
        path.append(rest.pop(0))
        cmd = sub
    try:
        cmd.make_context(" ".join(path), rest, resilient_parsing=False)
    except click_exc.NoArgsIsHelpError:
        return f"{' '.join(path)}: no arguments (it only prints its help)"
    except click_exc.UsageError as exc:
        return f"{' '.join(path)}: {exc.format_message()}"
    return None


def cli_drift(text: str, *, only_run: bool = True) -> list[str]:
    """Every ``agentbox`` call in the tutorial's console blocks the CLI would refuse.

    ``only_run``: just the blocks that run (not-run blocks are shown to users too,
    so the test checks both). Each entry names the line and the reason.
    """
    out: list[str] = []
    for block in parse_tutorial(text):
        if block.lang != "console" or (only_run and not block.runs):
            continue
        for cmd in block.commands:
            for args in agentbox_invocations(cmd.text):
                why = cli_error(args)
                if why is not None:
                    out.append(f"line {cmd.line}: {why}")
    return out
