"""The CLI imports a command's module only when that command runs (issue 15).

The oracle is the eager CLI: every command module registered on one typer app, as
``agentbox.cli`` did before. The lazy root group must list the same commands in the
same order with the same help, and every command's own ``--help`` must be the same.
Then real processes show what each path imports (``python -X importtime``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner

import agentbox.cli as cli
from agentbox.cli._lazy import COMMANDS, app_options


def _eager() -> typer.Typer:
    """The CLI as it was built before: every module registered up front."""
    app = typer.Typer(**app_options())
    app.callback()(cli._root)
    for mod in cli.COMMAND_MODULES:
        importlib.import_module(f"agentbox.cli.{mod}").register(app)
    return app


def _out(app: typer.Typer, args: list[str]) -> str:
    res = CliRunner().invoke(app, args, env={"COLUMNS": "100", "TERMINAL_WIDTH": "100"})
    assert res.exit_code == 0, res.output
    return res.output


def test_the_table_is_what_the_modules_register() -> None:
    # A command added, renamed or re-documented in its module goes in COMMANDS too.
    assert {mod for mod, _ in COMMANDS.values()} == set(cli.COMMAND_MODULES)
    eager = typer.main.get_group(_eager()).commands
    assert list(COMMANDS) == list(eager)  # names, and the order --help lists them in
    for name, cmd in eager.items():
        first = inspect.cleandoc(cmd.help or "").partition("\f")[0].split("\n\n")[0]
        assert COMMANDS[name][1] == first, f"COMMANDS[{name!r}]: its help is now {first!r}"
        mod = importlib.import_module(f"agentbox.cli.{COMMANDS[name][0]}")
        alone = typer.Typer(**app_options())
        mod.register(alone)
        assert name in typer.main.get_group(alone).commands, (name, COMMANDS[name][0])


def test_help_is_the_eager_clis_help_for_every_command() -> None:
    root = _out(cli.app, ["--help"])
    assert root == _out(_eager(), ["--help"])
    for name in COMMANDS:  # the control: the root help lists every command
        assert f" {name} " in root, name
    for name in COMMANDS:
        assert _out(cli.app, [name, "--help"]) == _out(_eager(), [name, "--help"]), name
    assert " stop " in _out(cli.app, ["launcher", "--help"])


#: ``python -m agentbox ARGS`` that writes, as it exits, every module it imported
#: (``-X importtime`` misses what importlib.import_module loads, as the lazy group does).
_PROBE = (
    "import atexit, runpy, sys\n"
    "atexit.register(lambda: print('MODULES', *sorted(sys.modules), file=sys.stderr))\n"
    "sys.argv = ['agentbox', *sys.argv[1:]]\n"
    "runpy.run_module('agentbox', run_name='__main__', alter_sys=True)\n"
)


def _imported(*args: str) -> set[str]:
    """The modules ``python -m agentbox ARGS`` imports (it must exit by itself)."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return _modules(out.stderr)


def _modules(stderr: str) -> set[str]:
    lines = [line for line in stderr.splitlines() if line.startswith("MODULES ")]
    assert len(lines) == 1, stderr[-2000:]
    return set(lines[0].split()[1:])


#: What no ``--help`` of the root needs (each costs 0.1-0.5 s).
HEAVY = ("pydantic", "pydantic_settings", "structlog", "httpx", "mcp", "agentbox.config")


def test_root_help_imports_no_command_module() -> None:
    mods = _imported("--help")
    assert "agentbox.cli._lazy" in mods  # the probe sees the CLI's imports
    assert (
        sorted(m for m in mods if m.startswith("agentbox.cli._") and m != "agentbox.cli._lazy")
        == []
    )
    assert sorted(m for m in mods if m.split(".")[0] in HEAVY or m in HEAVY) == []
    # Positive control: a command's help imports its module and what it pulls in.
    run = _imported("run", "--help")
    assert {"agentbox.cli._run", "pydantic", "agentbox.config"} <= run
    assert "agentbox.cli._mcp" not in run
    assert "httpx" not in run  # a foreground run's launcher is in-process: no HTTP client


#: What the launcher daemon never uses: the MCP server and SDK, the HTTP client,
#: and the other commands' modules (tables, views, the client).
NOT_FOR_SERVE = ("mcp", "agentbox.mcp", "httpx", "agentbox.launcher.client")


#: ``python -m agentbox launcher serve``, writing every module imported by the time its
#: socket exists (a thread watches for it: a stopped launcher dies of its signal) to the
#: file $PROBE_OUT (not stderr, where the launcher's own lines would cut into it).
_SERVE_PROBE = (
    "import os, runpy, sys, threading, time\n"
    "def watch():\n"
    "    sock = os.path.join(os.environ['AGENTBOX_DATA_DIR'], 'run', 'launcher.sock')\n"
    "    while not os.path.exists(sock):\n"
    "        time.sleep(0.05)\n"
    "    out = os.environ['PROBE_OUT']\n"
    "    with open(out + '.tmp', 'w') as fh:\n"
    "        fh.write(' '.join(['MODULES', *sorted(sys.modules)]))\n"
    "    os.rename(out + '.tmp', out)\n"
    "threading.Thread(target=watch, daemon=True).start()\n"
    "sys.argv = ['agentbox', 'launcher', 'serve']\n"
    "runpy.run_module('agentbox', run_name='__main__', alter_sys=True)\n"
)


def test_launcher_serve_imports_no_mcp_no_client(tmp_path: Path) -> None:
    out = tmp_path / "modules.txt"
    env = {**os.environ, "AGENTBOX_DATA_DIR": str(tmp_path / "data"), "PROBE_OUT": str(out)}
    log = tmp_path / "serve.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE_PROBE],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=fh,
            start_new_session=True,
        )
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not out.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"launcher exited {proc.poll()}: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        seen.append(out.read_text())
    finally:
        proc.send_signal(signal.SIGTERM)  # a plain stop
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    mods = _modules(seen[-1])
    assert "agentbox.launcher._server" in mods  # the probe sees what serving imported
    assert sorted(m for m in mods if m in NOT_FOR_SERVE or m.split(".")[0] in NOT_FOR_SERVE) == []
    others = sorted(m for m in mods if m.startswith("agentbox.cli._"))
    assert others == ["agentbox.cli._launcher", "agentbox.cli._lazy"]


def test_a_prebuilt_cli_is_what_main_runs(monkeypatch: Any, capsys: Any) -> None:
    """The front end's server builds the commands once (``prebuild``); a command forked
    from it parses with them, builds nothing, and says what a fresh build says."""
    from agentbox.cli._lazy import _Stub

    monkeypatch.setattr(cli, "_prebuilt", None)
    monkeypatch.setattr(sys, "argv", ["agentbox", "run", "--help"])
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as fresh:
        cli.main()
    built = capsys.readouterr().out
    cli.prebuild(("run", "launcher"))
    group = cli._prebuilt
    assert group is not None and not isinstance(group.commands["run"], _Stub)
    for cmd in (group, group.commands["run"], *group.commands["launcher"].commands.values()):
        for param in [*cmd.params, cmd._help_option]:
            assert getattr(param, "_runtime_param", True) is not None, (cmd.name, param)

    def no_build(*_: object, **__: object) -> None:
        raise AssertionError("built again")

    monkeypatch.setattr(typer.main, "get_command", no_build)
    with pytest.raises(SystemExit) as served:
        cli.main()
    assert (served.value.code, capsys.readouterr().out) == (fresh.value.code, built)
    assert "Delegate TASK" in built
