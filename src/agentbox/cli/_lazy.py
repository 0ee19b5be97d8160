"""The root command group, importing a command's module only when that command runs.

Each command module (``_run.py``, ``_mcp.py``, ...) pulls in what its commands need:
pydantic models, the launcher, httpx, rich tables, the MCP SDK. Importing all fifteen
for every invocation cost ~1.5 s before any command ran, and the
long-lived ``agentbox launcher serve`` paid it on every restart. So the root group
knows each top-level command by name, module and one line of help (:data:`COMMANDS`),
and :meth:`LazyGroup.get_command` imports the module (calls its ``register(app)`` on a
scratch app) only when the command is resolved. ``agentbox --help`` lists the
commands from the table alone.

The table is a copy of what the modules register: ``tests/unit/test_cli_lazy.py``
builds the group eagerly the old way and checks names, order, help lines and the
rendered ``--help`` against it.
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
import typer.core
import typer.main
from typer import _click

#: Top-level command -> (the module under agentbox.cli whose ``register(app)`` adds it,
#: its help's first paragraph). In the order ``agentbox --help`` lists them: the
#: modules' plain commands, then their groups, each in module order.
COMMANDS: dict[str, tuple[str, str]] = {
    "mcp": (
        "_mcp",
        "Run the MCP server (stdio by default: claude mcp add agentbox -- agentbox mcp).",
    ),
    "serve": ("_mcp", "Run the launcher and the MCP HTTP server together; Ctrl-C stops both."),
    "ui": ("_ui", "Serve a web view of your tasks on 127.0.0.1; prints its login link first."),
    "tasks": ("_tasks", "List tasks, newest first (running ones with their live token counts)."),
    "show": (
        "_tasks",
        "Show a task's report and diff; for a best-of-N GROUP, its attempts compared.",
    ),
    "cancel": ("_tasks", "Cancel a task (its partial result is still collected)."),
    "logs": (
        "_tasks",
        "What the agent ran and what came back: launcher phases, each tool call with\n"
        "its result, the agent's messages, gateway refusals, with times.",
    ),
    "run": (
        "_run",
        "Delegate TASK to Claude Code in a sandbox; print the report and the branch's diff.",
    ),
    "resume": (
        "_run",
        "Continue a finished task: a new task on its branch, told what the previous one did.",
    ),
    "wait": (
        "_wait",
        "Wait until the tasks finish; exit 0 done, 1 failed, 5 timed out, 6 cancelled,\n"
        "7 --timeout passed first.",
    ),
    "watch": (
        "_wait",
        "Follow a task live, then print its report; Ctrl-C stops watching, not the task.",
    ),
    "diff": ("_diff", "Print a finished task's diff (colored on a terminal, plain when piped)."),
    "apply": (
        "_diff",
        "Apply a task's result onto the current branch of its repo (or check it out).",
    ),
    "publish": (
        "_publish",
        "Publish a finished task's result into its repo as a new branch; push it, open a PR.",
    ),
    "gateway": ("_gateway", "Run one task's model gateway until SIGTERM."),
    "models": (
        "_gateway",
        "List the models clients may choose: which is the default, which need a key not set.",
    ),
    "doctor": ("_doctor", "Report what this host supports, with a fix for each missing piece."),
    "exec": (
        "_sandbox",
        "Run CMD in a fresh hardened sandbox; stream its output; exit with its exit code.",
    ),
    "shell": (
        "_sandbox",
        "Open an interactive shell in a fresh hardened sandbox (same hardening as exec).",
    ),
    "smoke": (
        "_sandbox",
        "Check a live sandbox's posture like the seed's smoke-test.sh; exit 1 on any failure.",
    ),
    "escape-test": (
        "_escape",
        "Run the escape suite: probes inside real sandboxes, checks from the host, controls.",
    ),
    "rm": (
        "_retention",
        "Remove finished tasks: their workspace, shadow git dir, logs and record.",
    ),
    "prune": (
        "_retention",
        "Remove every task that finished more than --older-than ago (default 7 days).",
    ),
    "du": ("_retention", "Show what the data dir holds: each task's parts, and everything else."),
    "launcher": ("_launcher", "The privileged launcher service."),
    "model": ("_gateway", "The replay model and other model tools."),
    "image": ("_image", "Build, list and remove sandbox images."),
    "env": ("_env", "Frozen environments made by the setup phase (ls, rm, prune)."),
    "secret": ("_secret", "Secrets on the host, injected by egress rules (set, ls, rm)."),
    "node": ("_batch", "Join this host to a Ray cluster as an agentbox node."),
    "batch": ("_batch", "Run batches of tasks on a Ray cluster."),
}


def app_options() -> dict[str, Any]:
    """The options of the root app, shared by the scratch apps commands are built in
    (typer passes markup mode and exception settings down to each command)."""
    return {
        "name": "agentbox",
        "help": "Run coding agents in sandboxes that assume the worst.",
        "no_args_is_help": True,
        "pretty_exceptions_enable": False,
        "add_completion": False,
    }


class _Stub(typer.core.TyperCommand):
    """A command known only by name and help line, until it is resolved."""


def build(modules: list[str]) -> dict[str, _click.Command]:
    """The click commands the modules register, built as the eager CLI built them."""
    scratch = typer.Typer(**app_options())
    for mod in modules:
        importlib.import_module(f"agentbox.cli.{mod}").register(scratch)
    return dict(typer.main.get_group(scratch).commands)


class LazyGroup(typer.core.TyperGroup):
    """The root group: stubs from :data:`COMMANDS`, replaced by the real commands (their
    module imported) when resolved. Help listing reads the stubs and imports nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._listing = False
        for name, (_mod, line) in COMMANDS.items():
            if name not in self.commands:
                self.commands[name] = _Stub(name, help=line)

    def get_command(self, ctx: _click.Context, cmd_name: str) -> _click.Command | None:
        cmd = self.commands.get(cmd_name)
        if isinstance(cmd, _Stub) and not self._listing:
            mod = COMMANDS[cmd_name][0]
            for name, real in build([mod]).items():
                if isinstance(self.commands.get(name), _Stub):
                    self.commands[name] = real
            cmd = self.commands[cmd_name]
        return cmd

    def format_help(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False
