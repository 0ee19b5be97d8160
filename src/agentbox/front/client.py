"""The ``agentbox`` console script: run the command in a front-end server's fork when
one serves this data dir (:mod:`agentbox.front`), else in this process.

Standard library only, and little of it: this module is what every ``agentbox``
command pays for before it knows whether a server will run it.
"""

from __future__ import annotations

import _socket
import os
import sys

from agentbox.core.frontend import ENV, SOCKET_NAME, mode
from agentbox.front._wire import WireError, read_message, send_message

# Not typing's, nor pathlib (PTH: os.path), nor json, socket, signal (their enums) or
# contextlib (SIM105: try/except instead): ~30 ms of this client's start on a busy host.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal
    from typing import Any, NoReturn
else:
    import _signal as signal

__all__ = [
    "FrontEndNoAnswer",
    "FrontEndUnavailable",
    "command_of",
    "data_dir",
    "entry",
    "own_process",
    "python_config",
    "run_served",
    "socket_for",
]

#: Signals the client passes on to the command as they come (TSTP and CONT are
#: handled apart: the command stops and resumes with the client).
FORWARDED = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGWINCH,
)


#: How long a waiter may take to greet a connection: the client sends its request (and
#: its descriptors) only to a live waiter, so a server that is stopped or stuck costs
#: this long and then the command runs in the client, with nothing sent.
HELLO_TIMEOUT = 10.0
#: How long the waiter may take to say whether it started the command (milliseconds, in
#: practice; past this the client ends with an error, not a second run).
REPLY_TIMEOUT = 60.0


class FrontEndUnavailable(Exception):
    """No server answered, or it declined: the command did not start."""


class FrontEndNoAnswer(Exception):
    """The server took the request and said nothing: the command may or may not have
    started, so it is not run again in this process."""


def data_dir() -> str:
    """The data dir as :func:`agentbox.config.load_settings` finds it (environment, then
    the config file, then the default): only a hint for which socket to try, since the
    server's fork checks the settings it loads itself before it serves."""
    value: Any = os.environ.get("AGENTBOX_DATA_DIR")
    if not value:
        cfg = os.environ.get("AGENTBOX_CONFIG", "/etc/agentbox/config.toml")
        if os.path.isfile(cfg):
            import tomllib

            try:
                with open(cfg, "rb") as fh:
                    value = tomllib.load(fh).get("data_dir")
            except (OSError, ValueError):
                pass
    if not isinstance(value, str) or not value:
        if os.geteuid() == 0:
            value = "/var/lib/agentbox"
        else:
            base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
            value = os.path.join(base, "agentbox")
    return os.path.realpath(os.path.expanduser(str(value)))


def socket_for(data_dir: str) -> str:
    """The front end's socket for ``data_dir``."""
    return os.path.join(data_dir, "run", SOCKET_NAME)


#: Commands that are services, not work a person waits on, run as their own process
#: whatever the mode: what supervises them (systemd, a posture check, ``pgrep``), and
#: their own privilege drop (``mcp --user``), must find them at the pid it started.
#: ``shell`` wants a controlling terminal, which a fork of the server has not.
OWN_PROCESS = frozenset(
    {("mcp",), ("serve",), ("gateway",), ("shell",), ("launcher", "serve"), ("model", "serve")}
)


def command_of(argv: list[str]) -> tuple[str, ...]:
    """The command (and its group's subcommand) ``argv`` names, past the root options."""
    words: list[str] = []
    args = iter(argv[1:])
    for arg in args:
        if arg == "--log-level":
            next(args, None)
        elif not arg.startswith("-"):
            words.append(arg)
            if len(words) == 2:
                break
    return tuple(words)


def own_process(argv: list[str]) -> bool:
    """Whether ``argv`` is a service command that always runs in its own process."""
    words = command_of(argv)
    return words[:1] in OWN_PROCESS or words[:2] in OWN_PROCESS


def entry() -> NoReturn:
    """The console script: served if a server answers (``AGENTBOX_FRONT_END``), else
    :func:`agentbox.cli.entry` in this process (and always for :data:`OWN_PROCESS`)."""
    how = mode()
    if how != "off" and not own_process(sys.argv):
        try:
            status = run_served(socket_for(data_dir()), sys.argv)
        except FrontEndUnavailable as exc:
            if how == "require":
                sys.stderr.write(f"agentbox: {ENV}=require, but {exc}\n")
                sys.stderr.flush()
                os._exit(4)
        except FrontEndNoAnswer as exc:
            sys.stderr.write(f"agentbox: {exc}; {ENV}=off runs commands without it\n")
            sys.stderr.flush()
            os._exit(1)
        else:
            _exit_like(status)
    from agentbox.cli import entry as in_process

    in_process()


def _ignored() -> list[int]:
    """The signals this process ignores (inherited: ``nohup``, a background job)."""
    out: list[int] = []
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            if signal.getsignal(sig) == signal.SIG_IGN:
                out.append(int(sig))
        except (OSError, ValueError):
            pass
    return out


def _stdio() -> dict[str, list[str] | None]:
    """Each standard stream's encoding and error handler, for the command's own."""
    out: dict[str, list[str] | None] = {}
    for name in ("stdin", "stdout", "stderr"):
        stream = getattr(sys, name)
        enc = getattr(stream, "encoding", None)
        out[name] = [enc, stream.errors] if enc else None
    return out


#: The interpreter's flags that change what the command does (not, say, bytecode writing;
#: UTF-8 mode is compared by its effect, the default text encoding).
FLAGS = (
    "optimize",
    "no_user_site",
    "no_site",
    "ignore_environment",
    "isolated",
    "dev_mode",
    "warn_default_encoding",
    "safe_path",
    "int_max_str_digits",
    "bytes_warning",
)


def python_config() -> dict[str, Any]:
    """What this interpreter imports from (``sys.path`` past the script's own directory),
    its flags, ``-W`` and ``-X`` options: a server with other ones declines (a
    ``PYTHONPATH``, another venv, ``-O``)."""
    return {
        "path": sys.path[1:],
        "flags": {name: getattr(sys.flags, name, None) for name in FLAGS},
        "warnoptions": list(sys.warnoptions),
        "xoptions": {str(k): str(v) for k, v in sys._xoptions.items()},
        "encoding": text_encoding(),
    }


def text_encoding() -> str:
    """``open()``'s default encoding here (UTF-8 mode, else the locale's), by codec name:
    ``locale.getpreferredencoding(False)``, without importing :mod:`locale` (and ``re``)."""
    import _locale
    import codecs

    return codecs.lookup("utf-8" if sys.flags.utf8_mode else _locale.getencoding()).name


def _cmdline() -> str:
    """This process's command line, as ``ps`` shows it: the served command's title."""
    try:
        with open("/proc/self/cmdline", "rb") as fh:
            return fh.read().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return " ".join(sys.argv)


def _open_fds() -> tuple[list[int], list[bool]]:
    """Descriptors 0-2 that are open (a closed one stays closed in the command), and the
    working directory's (``O_PATH``: a directory the caller may not read still works)."""
    fds: list[int] = []
    present: list[bool] = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            present.append(False)
            continue
        fds.append(fd)
        present.append(True)
    return fds, present


def run_served(path: str, argv: list[str]) -> tuple[str, int]:
    """Run ``argv`` in the server at ``path``; ``("exit", code)`` or ``("signal", number)``.

    :class:`FrontEndUnavailable` when nothing was started (no server, declined):
    the caller may then run the command itself. Once started, signals are forwarded
    and the command's end is waited for.
    """
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        try:
            sock.connect(path)
        except OSError as exc:
            raise FrontEndUnavailable(
                f"no front end answers at {path} ({exc.strerror or exc})"
            ) from None
        return _served(sock, argv)
    finally:
        sock.close()


def _served(sock: _socket.socket, argv: list[str]) -> tuple[str, int]:
    import agentbox

    fds, present = _open_fds()
    try:
        cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise FrontEndUnavailable(f"the working directory: {exc.strerror}") from None
    pending: list[int] = []
    child = [0]
    saved = _forward_signals(pending, child)
    try:
        request = {
            "v": 1,
            "argv": argv,
            "env": dict(os.environ),
            "package": os.path.dirname(os.path.realpath(agentbox.__file__ or "")),
            "executable": sys.executable,
            "stdio": _stdio(),
            "fds": present,
            "ignored": _ignored(),
            "main_package": getattr(sys.modules.get("__main__"), "__package__", None),
            "title": _cmdline(),
            "python": python_config(),
            "path0": sys.path[0] if sys.path else "",
        }
        sock.settimeout(HELLO_TIMEOUT)
        hello = _read(sock)
        if hello is None or hello.get("hello") != 1:
            raise FrontEndUnavailable(f"the front end did not greet within {HELLO_TIMEOUT:.0f} s")
        sock.settimeout(REPLY_TIMEOUT)
        try:
            send_message(sock, request, [*fds, cwd])
        finally:
            os.close(cwd)
        first = _read(sock)
        if first is not None and "declined" in first:  # only then: nothing was started
            raise FrontEndUnavailable(f"the front end declined: {str(first['declined'])[:300]}")
        if first is None or "started" not in first:
            raise FrontEndNoAnswer(
                f"the front end gave no answer within {REPLY_TIMEOUT:.0f} s: the command may "
                "not have run"
            )
        sock.settimeout(None)
        pid = first["started"]
        if not isinstance(pid, int) or pid <= 1:
            raise FrontEndNoAnswer("the front end sent a bad reply")
        child[0] = pid
        for sig in pending:
            _kill(pid, sig)
        while True:
            msg = _read(sock)
            if msg is None:
                sys.stderr.write("agentbox: the front end went away before the command ended\n")
                return ("exit", 1)
            if isinstance(msg.get("exit"), int):
                return ("exit", msg["exit"])
            if isinstance(msg.get("signal"), int):
                return ("signal", msg["signal"])
    except (FrontEndUnavailable, FrontEndNoAnswer):
        _restore(saved)
        for sig in pending:  # a signal that came before anything started: as if unserved
            signal.raise_signal(sig)
        raise
    finally:
        if child[0] == 0:
            _restore(saved)


def _read(sock: _socket.socket) -> dict[str, Any] | None:
    try:
        return read_message(sock)
    except (OSError, WireError):
        return None


def _kill(pid: int, sig: int) -> None:
    try:  # noqa: SIM105
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _forward_signals(pending: list[int], child: list[int]) -> dict[int, Any]:
    """Pass each signal the caller does not ignore on to the command (kept in
    ``pending`` until its pid is known); TSTP stops the command, then this process."""

    def forward(sig: int, _frame: object) -> None:
        if child[0]:
            _kill(child[0], sig)
        else:
            pending.append(sig)

    def stop(_sig: int, _frame: object) -> None:
        if child[0]:
            _kill(child[0], signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)

    def resume(_sig: int, _frame: object) -> None:
        if child[0]:
            _kill(child[0], signal.SIGCONT)

    saved: dict[int, Any] = {}
    handlers: list[tuple[int, Any]] = [(s, forward) for s in FORWARDED]
    handlers += [(signal.SIGTSTP, stop), (signal.SIGCONT, resume)]
    for sig, handler in handlers:
        old = signal.getsignal(sig)
        if old == signal.SIG_IGN:
            continue  # ignored by the caller: ignored by the command too
        saved[sig] = old
        signal.signal(sig, handler)
    return saved


def _restore(saved: dict[int, Any]) -> None:
    for sig, old in saved.items():
        try:  # noqa: SIM105
            signal.signal(sig, old)
        except (OSError, ValueError, TypeError):
            pass


def _exit_like(status: tuple[str, int]) -> NoReturn:
    """End as the command ended: its exit code, or killed by its signal."""
    kind, value = status
    for stream in (sys.stdout, sys.stderr):
        try:  # noqa: SIM105
            stream.flush()
        except Exception:  # noqa: S110 (a closed or broken stream: the exit goes on)
            pass
    if kind == "signal" and 0 < value < signal.NSIG:
        try:
            signal.signal(value, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [value])
            os.kill(os.getpid(), value)
        except (OSError, ValueError):
            pass
        os._exit(128 + value)
    os._exit(value & 0xFF)
