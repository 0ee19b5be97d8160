"""From a Boxfile and the host's Settings to a validated :class:`SandboxSpec`.

This is the one place where a declaration becomes something a backend runs,
so every check that does not need the backend happens here, before anything
starts:

* declared mounts must resolve inside a configured mount root and exist
  (:meth:`Boxfile.check_mounts`); their sources must be absolute and must not
  contain ``,`` or ``:`` (podman's volume syntax would split them);
* the workspace and the gateway dir must be existing directories;
* host environment variables pass only by name through the Boxfile's
  allowlist (credentials were already refused when the Boxfile was parsed);
* resources are clamped to what the host has (cpus to ``nproc``, memory to
  physical RAM), with a logged note, so a Boxfile written for a bigger host
  still runs.

Capabilities and host networking cannot even be expressed: the Boxfile
refuses them by name.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

from agentbox.backends.base import (
    HOME_IN_SANDBOX,
    LABEL,
    BindMount,
    SandboxSpec,
)
from agentbox.boxfile import Boxfile, Resources
from agentbox.config import DEFAULT_IMAGE, Settings
from agentbox.core.log import get_logger
from agentbox.errors import ConfigError, PathRefused

__all__ = ["NAME_RE", "clamp_resources", "new_sandbox_name", "spec_from_boxfile"]

log = get_logger(__name__)

#: Sandbox (container) names: podman's own rule, shortened.
NAME_RE = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,62}")
_BAD_PATH_CHARS = (",", ":", "\n", "\0")


def new_sandbox_name(prefix: str = "agentbox") -> str:
    """A fresh, unique-enough sandbox name (``agentbox-`` + 12 hex digits)."""
    return f"{prefix}-{secrets.token_hex(6)}"


def clamp_resources(res: Resources) -> Resources:
    """Clamp cpus to the host's CPU count and memory to its physical RAM (logged)."""
    ncpu = float(os.cpu_count() or 1)
    phys = int(psutil.virtual_memory().total)
    cpus, memory = res.cpus, res.memory
    if cpus > ncpu:
        log.info("clamped cpus to the host", asked=cpus, host=ncpu)
        cpus = ncpu
    if memory > phys:
        log.info("clamped memory to the host", asked=memory, host=phys)
        memory = phys
    if (cpus, memory) == (res.cpus, res.memory):
        return res
    return res.model_copy(update={"cpus": cpus, "memory": memory})


def _host_dir(path: Path, what: str) -> Path:
    if not path.is_absolute():
        raise PathRefused(f"{what} must be an absolute path", path=path)
    real = path.resolve()
    if not real.is_dir():
        raise PathRefused(f"{what} is not an existing directory", path=path)
    if any(c in str(real) for c in _BAD_PATH_CHARS):
        raise PathRefused(f"{what} contains ',', ':' or a newline", path=path)
    return real


def _mounts(boxfile: Boxfile, settings: Settings) -> tuple[BindMount, ...]:
    out = []
    for i, m in enumerate(boxfile.check_mounts(settings)):
        real = m.source.resolve()
        if any(c in str(real) for c in _BAD_PATH_CHARS):
            raise PathRefused(f"[mounts.{i}.source] contains ',', ':' or a newline", path=real)
        out.append(BindMount(source=real, target=m.target, read_only=True))
    targets = [m.target for m in out]
    if len(set(targets)) != len(targets):
        raise ConfigError("two declared mounts share one target")
    return tuple(out)


def _env(boxfile: Boxfile, extra_env: Mapping[str, str]) -> dict[str, str]:
    env = {name: os.environ[name] for name in boxfile.env.allow if name in os.environ}
    env.update(boxfile.env.set)
    # extra_env comes from trusted callers (the launcher: gateway URL, one-time token).
    env.update(extra_env)
    env["HOME"] = HOME_IN_SANDBOX
    for name, value in env.items():
        if "\n" in value or "\0" in value:
            raise ConfigError(f"environment variable {name} contains a newline or NUL")
    return env


def image_of(boxfile: Boxfile, settings: Settings) -> str:
    """The image a sandbox for ``boxfile`` runs: the Boxfile's when it sets one, else the
    settings' (``AGENTBOX_IMAGE``), which also stands in for the default image's name."""
    image = boxfile.image if "image" in boxfile.model_fields_set else settings.image
    if image == DEFAULT_IMAGE and settings.image != DEFAULT_IMAGE:
        image = settings.image
    return image


def spec_from_boxfile(
    boxfile: Boxfile,
    settings: Settings,
    *,
    name: str | None = None,
    workspace: Path | None = None,
    gateway_dir: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
) -> SandboxSpec:
    """Validate ``boxfile`` against ``settings`` and return the spec a backend runs.

    ``image`` and ``runtime`` come from the Boxfile when it sets them, else from
    the settings (``AGENTBOX_IMAGE``, ``AGENTBOX_AGENT_RUNTIME``). Raises
    :class:`PathRefused` for a mount outside the roots or a missing directory,
    :class:`ConfigError` for a bad name or environment value.
    """
    name = name or new_sandbox_name()
    if not NAME_RE.fullmatch(name):
        raise ConfigError(f"not a sandbox name: {name!r:.80}")
    if settings.sandbox_uid >= 65536 or settings.sandbox_uid <= 0:
        raise ConfigError(f"sandbox_uid must be in 1..65535, got {settings.sandbox_uid}")
    if boxfile.image_build is not None:
        raise ConfigError(
            f"the Boxfile's [image] table (containerfile {boxfile.image_build.containerfile}) "
            "is built by the agentbox CLI before a sandbox is made, never by the launcher "
            "(a committed Boxfile cannot start a build): run `agentbox image build "
            "--containerfile PATH --tag NAME` and set image = NAME"
        )
    fields_set = boxfile.model_fields_set
    image = image_of(boxfile, settings)
    runtime = boxfile.runtime if "runtime" in fields_set else settings.runtime
    all_labels = {
        LABEL: "1",
        "io.agentbox.created": str(int(time.time())),
        **(labels or {}),
    }
    return SandboxSpec(
        name=name,
        image=image,
        runtime=runtime,
        isolation=boxfile.isolation,
        resources=clamp_resources(boxfile.resources),
        mounts=_mounts(boxfile, settings),
        workspace=_host_dir(workspace, "workspace") if workspace is not None else None,
        gateway_dir=_host_dir(gateway_dir, "gateway dir") if gateway_dir is not None else None,
        env=_env(boxfile, extra_env or {}),
        deadline=boxfile.deadline,
        labels=all_labels,
        uid=settings.sandbox_uid,
    )
