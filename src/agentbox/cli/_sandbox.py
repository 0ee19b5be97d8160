"""``agentbox exec``, ``agentbox shell`` and ``agentbox smoke``: sandboxes from the command line.

``exec`` runs one command in a fresh hardened sandbox, streams its output and
exits with its exit code (124 when the Boxfile's deadline killed it). Every
refusal (a ``--mount`` outside the configured roots, a Boxfile asking for a
capability or a network, a missing image, an unknown runtime) happens before
anything starts. Heavy imports are deferred to the command bodies so that
``agentbox exec`` starts quickly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from agentbox.backends.base import SandboxSpec
    from agentbox.config import Settings

_CTX = {"allow_extra_args": False, "ignore_unknown_options": False}

CmdArg = typer.Argument(..., help="The command (after --)")
ShellArg = typer.Argument(None, help="Shell to run (default /bin/bash)")
BackendOpt = typer.Option(None, "--backend", help="podman (default) or another backend")
RuntimeOpt = typer.Option(None, "--runtime", help="OCI runtime: runc, crun or runsc (podman)")
BoxfileOpt = typer.Option(None, "--boxfile", "-f", help="A Boxfile (TOML) declaring the sandbox")
MountOpt = typer.Option(
    None, "--mount", "-m", help="A host dir mounted read-only at the same path (under mount roots)"
)
WorkspaceOpt = typer.Option(
    None, "--workspace", "-w", help="Host dir mounted read-write at /workspace (default: scratch)"
)


def _boxfile(
    boxfile: Path | None,
    backend: str | None,
    runtime: str | None,
    mounts: list[Path] | None,
    settings: Settings,
) -> Any:
    from agentbox.boxfile import Boxfile, load_boxfile

    _check_flags(backend=backend, runtime=runtime)
    data: dict[str, Any] = (
        load_boxfile(boxfile).model_dump(exclude_unset=True, mode="json") if boxfile else {}
    )
    if backend is not None:
        data["backend"] = backend
    if runtime is not None:
        data["runtime"] = runtime
    if mounts:
        data["mounts"] = list(data.get("mounts", [])) + [
            {"source": str(m.absolute()), "target": str(m.absolute())} for m in mounts
        ]
    box = Boxfile.from_dict(data, path=boxfile, settings=settings)
    if box.image_build is not None:  # [image] containerfile = …: build it (cached) first
        from agentbox.image import build_for_boxfile

        box = build_for_boxfile(settings, box)
    return box


def _check_flags(**values: str | None) -> None:
    """``--backend``/``--runtime`` checked as the Boxfile's keys, refused in the flag's
    words (``--backend must be 'podman', … or 'docker', got 'lxc'``)."""
    from pydantic import ValidationError

    from agentbox.boxfile import Boxfile
    from agentbox.core.invalid import flag_message
    from agentbox.errors import BoxfileError

    for key, value in values.items():
        if value is None:
            continue
        try:
            Boxfile.model_validate({key: value})
        except ValidationError as exc:
            raise BoxfileError(flag_message(exc, {key: (f"--{key}", "")})) from exc


@contextlib.contextmanager
def _workspace(settings: Settings, given: Path | None) -> Iterator[Path]:
    """The given workspace, or a scratch one owned by the sandbox identity (removed after)."""
    if given is not None:
        ws = given.absolute()
        with contextlib.suppress(OSError):
            if ws.stat().st_uid != settings.sandbox_host_uid:
                print(
                    f"agentbox: note: {ws} is not owned by the sandbox identity "
                    f"(host uid {settings.sandbox_host_uid}); the sandbox may not write to it",
                    file=sys.stderr,
                )
        yield ws
        return
    root = settings.data_dir / "scratch"
    # 0711: runsc's gofer (host uid subid_base) must traverse it; it cannot list it.
    root.mkdir(parents=True, exist_ok=True, mode=0o711)
    ws = Path(tempfile.mkdtemp(prefix="ws-", dir=root))
    try:
        if os.geteuid() == 0:
            os.chown(ws, settings.sandbox_host_uid, settings.sandbox_host_uid)
        yield ws
    finally:
        shutil.rmtree(ws, ignore_errors=True)


@contextlib.contextmanager
def _own_slot(
    settings: Settings, given: Path | None, backend: str | None, boxfile: Path | None
) -> Iterator[Settings]:
    """Settings for a sandbox holding a host uid range of its own (a uid slot, released at
    the end). A workspace you give keeps the slot-less range from ``subid_base`` (the
    owner you gave it, ``settings.sandbox_host_uid``, is the sandbox's then)."""
    if given is not None or os.geteuid() != 0:
        yield settings
        return
    from agentbox.backends import uid_slot
    from agentbox.boxfile import load_boxfile

    named = load_boxfile(boxfile).model_dump(exclude_unset=True) if boxfile else {}
    with uid_slot(settings, backend or named.get("backend") or settings.backend, "exec") as mine:
        yield mine


def _prepare(
    boxfile: Path | None,
    backend: str | None,
    runtime: str | None,
    mounts: list[Path] | None,
    workspace: Path,
    settings: Settings,
    *,
    cold: bool = False,
) -> tuple[Any, SandboxSpec]:
    from agentbox.backends import backend_class, get_backend
    from agentbox.errors import PolicyRefused
    from agentbox.sandbox import spec_from_boxfile

    box = _boxfile(boxfile, backend, runtime, mounts, settings)
    spec = spec_from_boxfile(box, settings, workspace=workspace)
    if cold and not backend_class(box.backend).snapshots:
        raise PolicyRefused(f"--cold is for the qemu backend (snapshot restore); not {box.backend}")
    be = (
        get_backend(box.backend, settings, cold=True)
        if cold
        else get_backend(box.backend, settings)
    )
    be.check(spec)
    return be, spec


def exec_cmd(
    cmd: list[str] = CmdArg,
    backend: str | None = BackendOpt,
    runtime: str | None = RuntimeOpt,
    boxfile: Path | None = BoxfileOpt,
    mount: list[Path] | None = MountOpt,
    workspace: Path | None = WorkspaceOpt,
    stdin: bool = typer.Option(False, "--stdin", "-i", help="Pass this process's stdin"),
    cold: bool = typer.Option(
        False, "--cold", help="qemu: boot fresh instead of restoring the ready snapshot"
    ),
) -> None:
    """Run CMD in a fresh hardened sandbox; stream its output; exit with its exit code."""
    from agentbox.cli.reap import exit_on_signals, guarded
    from agentbox.config import load_settings

    _check_flags(backend=backend, runtime=runtime)  # before a slot is claimed for it
    # A signal unwinds through run() (which destroys the sandbox) before the process
    # ends; a SIGKILL is answered by the guard, which reaps the sandbox at once.
    with (
        exit_on_signals(),
        _own_slot(load_settings(), workspace, backend, boxfile) as settings,
        _workspace(settings, workspace) as ws,
    ):
        be, spec = _prepare(boxfile, backend, runtime, mount, ws, settings, cold=cold)
        out, err = sys.stdout.buffer, sys.stderr.buffer

        def on_out(chunk: bytes) -> None:
            out.write(chunk)
            out.flush()

        def on_err(chunk: bytes) -> None:
            err.write(chunk)
            err.flush()

        data = sys.stdin.buffer.read() if stdin else None
        scratch = ws if workspace is None else None
        with guarded(be.name, spec.name, spec.deadline, settings.data_dir, scratch=scratch):
            res = be.run(spec, cmd, on_stdout=on_out, on_stderr=on_err, stdin=data)
    if res.timed_out:
        print(f"agentbox: deadline of {spec.deadline:g}s reached; sandbox killed", file=sys.stderr)
        raise SystemExit(124)
    raise SystemExit(res.exit_code if 0 <= res.exit_code < 256 else 1)


def shell_cmd(
    backend: str | None = BackendOpt,
    runtime: str | None = RuntimeOpt,
    boxfile: Path | None = BoxfileOpt,
    mount: list[Path] | None = MountOpt,
    workspace: Path | None = WorkspaceOpt,
    cmd: list[str] | None = ShellArg,
) -> None:
    """Open an interactive shell in a fresh hardened sandbox (same hardening as exec)."""
    from agentbox.cli.reap import exit_on_signals, guarded
    from agentbox.config import load_settings
    from agentbox.errors import UnsupportedError

    _check_flags(backend=backend, runtime=runtime)  # before a slot is claimed for it
    with (
        exit_on_signals(),
        _own_slot(load_settings(), workspace, backend, boxfile) as settings,
        _workspace(settings, workspace) as ws,
    ):
        be, spec = _prepare(boxfile, backend, runtime, mount, ws, settings)
        interactive = getattr(be, "interactive", None)
        if interactive is None:
            raise UnsupportedError(f"backend {be.name} has no interactive shell yet")
        scratch = ws if workspace is None else None
        with guarded(be.name, spec.name, spec.deadline, settings.data_dir, scratch=scratch):
            rc = int(interactive(spec, cmd or ["/bin/bash"]))
    raise SystemExit(rc)


def smoke_cmd(
    backend: str | None = BackendOpt,
    runtime: str | None = RuntimeOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON"),
) -> None:
    """Check a live sandbox's posture like the seed's smoke-test.sh; exit 1 on any failure."""
    from agentbox.config import load_settings
    from agentbox.smoke import render, run_smoke

    posture = run_smoke(load_settings(), backend=backend, runtime=runtime)
    if as_json:
        print(json.dumps(posture.to_dict(), indent=2))
    else:
        from rich.console import Console

        Console().print(render(posture))
    raise SystemExit(0 if posture.ok else 1)


def register(app: typer.Typer) -> None:
    """Add ``exec``, ``shell`` and ``smoke`` to the ``agentbox`` app."""
    app.command("exec", context_settings=_CTX)(exec_cmd)
    app.command("shell")(shell_cmd)
    app.command("smoke")(smoke_cmd)
