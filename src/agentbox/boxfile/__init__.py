"""The Boxfile: a TOML file that declares one sandbox.

Example::

    image = "localhost/agentbox-default:latest"   # or an [image] table:
    # [image]
    # containerfile = "Containerfile"   # built FROM localhost/agentbox-base, hardened
    # context = "."                     # (paths relative to this file)
    backend = "podman"          # podman | docker | qemu | firecracker
    runtime = "runc"            # runc | crun | runsc   (podman only)
    isolation = "standard"      # standard | strict
    deadline = 1800             # seconds
    model = "replay-demo"       # a name from the model registry (tasks only)
    budget = 20_000_000         # tokens (tasks only)

    [resources]
    cpus = 4
    memory = "8GiB"
    pids = 512
    nofile = 4096
    disk = "20GiB"              # what /workspace may hold (clamped by the host's max_disk)
    inodes = 1_000_000          # files it may hold (default: disk / 16KiB)

    [[mounts]]                  # read-only, each under a configured mount root
    source = "/opt/venvs/proj"
    target = "/opt/venv"

    [env]
    allow = ["LANG", "TZ"]      # host variables passed through by name
    set = { PYTHONDONTWRITEBYTECODE = "1" }

    [setup]                     # runs before the agent; what it makes is frozen and reused
    run = ["python3 -m venv .venv", ".venv/bin/pip install -r requirements.txt"]
    inputs = ["requirements.txt"]   # files (globs) whose contents key the frozen environment
    network = "registries"      # none | registries (the host's own pip/npm/uv indexes)
    deadline = 900              # seconds

    [network]                   # the agent phase's egress, through the per-task proxy
    allow = ["docs.example.org", "*.example.com"]   # within the host's egress cap

    [[network.rule]]            # request-level: the proxy terminates TLS for this host
    host = "pypi.corp.example"
    methods = ["GET", "HEAD"]
    paths = ["/simple/*", "/packages/*"]
    inject = { header = "Authorization", value = "Bearer ${secret:CORP_PYPI_TOKEN}" }
    phases = ["setup"]          # setup | agent (default: both)

    [git]                       # the agent may fetch (never push) the repo's https remote
    fetch = true                # upload-pack only, the host user's credential injected

Unknown keys and bad values are refused with a :class:`BoxfileError` naming
each key, all at once; a misspelt key with the key it likely meant (``[netwrok]
unknown key (did you mean [network]?)``). Asking for capabilities or a network
(``network = "host"``) is refused by name: those are not knobs agentbox offers.
Egress is only ever named hosts through the per-task proxy (``[setup] network``,
``[network] allow``).

A Boxfile may come from a repo someone else wrote: :func:`load_boxfile` reads
at most :data:`MAX_BOXFILE_BYTES` of a regular file, and bytes that are not
UTF-8, nesting too deep for the parser and numbers too large to be sizes all
become a :class:`BoxfileError` naming the file, never a traceback.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from agentbox.boxfile._sections import (
    MAX_BOXFILE_BYTES,
    DiskLimit,
    EnvPolicy,
    GitPolicy,
    ImageBuild,
    Mount,
    NetworkPolicy,
    Resources,
    Setup,
    Strict,
)
from agentbox.config import DEFAULT_IMAGE, Backend, Settings, parse_size, setting_source
from agentbox.core.invalid import nearest_key
from agentbox.errors import BoxfileError, PathRefused

if TYPE_CHECKING:
    from agentbox.egress.rules import NetworkRule

__all__ = [
    "MAX_BOXFILE_BYTES",
    "Boxfile",
    "DiskLimit",
    "EnvPolicy",
    "GitPolicy",
    "Mount",
    "NetworkPolicy",
    "Resources",
    "Setup",
    "host_defaults",
    "load_boxfile",
    "loads_boxfile",
    "parse_size",
]


class Boxfile(Strict):
    """One sandbox's declaration. Every field has a safe default."""

    image: str = DEFAULT_IMAGE
    # ``[image] containerfile = …`` (a table where ``image`` is a name) lands here.
    image_build: ImageBuild | None = None
    backend: Backend = "podman"
    runtime: Literal["runc", "crun", "runsc"] = "runc"
    isolation: Literal["standard", "strict"] = "standard"
    deadline: float = Field(default=3600.0, gt=0, le=7 * 24 * 3600)
    model: str | None = None
    budget: int | None = Field(default=None, gt=0, le=10_000_000_000)
    budget_usd: float | None = Field(default=None, gt=0, le=1_000_000)
    """A dollar budget at the model's registry prices (tasks only; the model needs prices)."""
    resources: Resources = Field(default_factory=Resources)
    mounts: tuple[Mount, ...] = ()
    env: EnvPolicy = Field(default_factory=EnvPolicy)
    setup: Setup | None = None
    # A string other than "none" exists only to be refused by name; a [network] table
    # names the hosts the agent phase may reach through the egress proxy.
    network: Literal["none"] | NetworkPolicy = "none"
    git: GitPolicy = Field(default_factory=GitPolicy)
    # This exists only to refuse it by name (a clearer error than "unknown key").
    capabilities: tuple[()] = ()

    @field_validator("network", mode="before")
    @classmethod
    def _no_network(cls, v: Any) -> Any:
        if isinstance(v, dict):
            try:
                return NetworkPolicy.model_validate(v)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])[:100]
                msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
                raise ValueError(f"{where}: {msg.removeprefix('Value error, ')}") from None
        if v != "none":
            raise ValueError(
                "sandboxes have no network; name hosts in a [network] table "
                '(allow = ["host"]) to reach them through the egress proxy'
            )
        return v

    @property
    def egress_allow(self) -> tuple[str, ...]:
        """The hosts ``[network] allow`` names (empty: the agent phase has no egress)."""
        return self.network.allow if isinstance(self.network, NetworkPolicy) else ()

    def network_rules(self, phase: str | None = None) -> tuple[NetworkRule, ...]:
        """The ``[[network.rule]]`` rules (those of ``phase`` only, if given)."""
        if not isinstance(self.network, NetworkPolicy):
            return ()
        rules = self.network.rules()
        return rules if phase is None else tuple(r for r in rules if phase in r.phases)

    @field_validator("capabilities", mode="before")
    @classmethod
    def _no_caps(cls, v: Any) -> Any:
        if v:
            raise ValueError("capabilities cannot be granted: every sandbox runs with none")
        return ()

    @model_validator(mode="before")
    @classmethod
    def _image_table(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("image"), dict):
            if "image_build" in data:
                raise ValueError("give either an [image] table or image_build, not both")
            data = {k: v for k, v in data.items() if k != "image"} | {"image_build": data["image"]}
        return data

    @field_validator("image")
    @classmethod
    def _image_name(cls, v: str) -> str:
        if not v or len(v) > 255 or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*", v):
            raise ValueError(f"not an image name: {v!r:.60}")
        return v

    def check_mounts(self, settings: Settings) -> tuple[Mount, ...]:
        """Require every mount's source to resolve inside a configured mount root."""
        for i, m in enumerate(self.mounts):
            real = m.source.resolve()
            if not any(real == r or r in real.parents for r in settings.mount_roots):
                roots = ", ".join(map(str, settings.mount_roots)) or "none configured"
                raise PathRefused(
                    f"[mounts.{i}.source] must live under a configured mount root ({roots}; "
                    f"{setting_source('mount_roots', settings.mount_roots)})",
                    path=m.source,
                )
            if not real.exists():
                raise PathRefused(f"[mounts.{i}.source] does not exist", path=m.source)
        return self.mounts

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], *, path: Path | None = None, settings: Settings | None = None
    ) -> Boxfile:
        """Validate ``data``; its problems are raised as one BoxfileError naming each key.

        With ``settings``, the host's defaults (``AGENTBOX_IMAGE``, ``AGENTBOX_BACKEND``,
        ``AGENTBOX_AGENT_RUNTIME``) fill the keys ``data`` does not set.
        """
        if settings is not None:
            data = {**host_defaults(settings), **data}
        try:
            box = cls.model_validate(data)
        except ValidationError as exc:
            raise _boxfile_error(exc, data, path) from exc
        build = box.image_build
        if build is not None and path is not None:
            here = path.absolute().parent
            box = box.model_copy(
                update={
                    "image_build": build.model_copy(
                        update={
                            "containerfile": here / build.containerfile,
                            "context": None if build.context is None else here / build.context,
                        }
                    )
                }
            )
        return box


#: Keys never suggested for a misspelt one: ``image_build`` is the ``[image]`` table's
#: inside name, ``capabilities`` exists only to be refused.
_NOT_SUGGESTED = frozenset({"image_build", "capabilities"})


def _boxfile_error(exc: ValidationError, data: dict[str, Any], path: Path | None) -> BoxfileError:
    """Every problem of ``exc``, each naming its key, an unknown key with the known key it
    most likely meant (``[netwrok] unknown key (did you mean [network]?)``); the error's
    ``key`` is the first one's."""
    parts: list[tuple[str | None, str]] = []
    for err in exc.errors()[:20]:
        loc = list(err["loc"])
        shown = [str(p) for p in loc]
        if shown and shown[0] == "image_build" and "image_build" not in data:
            shown[0] = "image"  # the [image] table's key
        key = ".".join(shown)[:200] or None
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            near = nearest_key(Boxfile, loc, hidden=_NOT_SUGGESTED)
            if near is not None:
                msg += f" (did you mean [{'.'.join([*shown[:-1], near])[:200]}]?)"
        else:
            msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append((key, msg))
    first_key, first_msg = parts[0]
    if len(parts) == 1:
        return BoxfileError(first_msg, key=first_key, path=path)
    error = BoxfileError(
        f"{len(parts)} problems: " + "; ".join(f"[{k}] {m}" if k else m for k, m in parts),
        path=path,
    )
    error.key = first_key
    return error


def host_defaults(settings: Settings) -> dict[str, Any]:
    """The Boxfile keys whose defaults come from the host's settings."""
    return {"image": settings.image, "backend": settings.backend, "runtime": settings.runtime}


def _read_capped(path: Path) -> bytes:
    """At most :data:`MAX_BOXFILE_BYTES` of the regular file ``path``.

    ``O_NONBLOCK``: a FIFO put where a Boxfile was expected cannot hang the
    open; it is then refused, like a device or a directory, for not being a
    regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise BoxfileError(f"cannot read: {exc.strerror}", path=path) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BoxfileError("not a regular file", path=path)
        if st.st_size > MAX_BOXFILE_BYTES:
            raise BoxfileError(
                f"too large ({st.st_size} bytes; a Boxfile may hold {MAX_BOXFILE_BYTES})", path=path
            )
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(MAX_BOXFILE_BYTES + 1)
    except OSError as exc:
        raise BoxfileError(f"cannot read: {exc.strerror}", path=path) from exc
    finally:
        os.close(fd)
    if len(data) > MAX_BOXFILE_BYTES:  # it grew after the fstat
        raise BoxfileError(f"too large (a Boxfile may hold {MAX_BOXFILE_BYTES} bytes)", path=path)
    return data


def load_boxfile(path: Path, settings: Settings | None = None) -> Boxfile:
    """Read and validate a Boxfile (keys it leaves out default to ``settings``, if given).

    Every failure (unreadable, not a regular file, too large, not UTF-8, not
    TOML, nested too deep, a bad key) is a :class:`BoxfileError` naming ``path``.
    """
    raw = _read_capped(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BoxfileError(
            f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start}", path=path
        ) from exc
    return loads_boxfile(text, path=path, settings=settings)


def loads_boxfile(text: str, *, path: Path, settings: Settings | None = None) -> Boxfile:
    """Validate the Boxfile ``text`` (from ``path``, named in errors: a file or a committed
    blob); every failure is a :class:`BoxfileError`."""
    if len(text) > MAX_BOXFILE_BYTES:
        raise BoxfileError(f"too large (a Boxfile may hold {MAX_BOXFILE_BYTES} bytes)", path=path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BoxfileError(f"not valid TOML: {exc}", path=path) from exc
    except RecursionError as exc:
        raise BoxfileError(
            "not a usable Boxfile: arrays or tables nest too deep", path=path
        ) from exc
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise BoxfileError(f"not valid TOML: {str(exc)[:200]}", path=path) from exc
    try:
        return Boxfile.from_dict(data, path=path, settings=settings)
    except RecursionError as exc:
        raise BoxfileError("not a usable Boxfile: values nest too deep", path=path) from exc
