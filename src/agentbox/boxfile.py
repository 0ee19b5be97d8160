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

Unknown keys and bad values are refused with a :class:`BoxfileError` naming
the key. Asking for capabilities or a network (``network = "host"``) is refused
by name: those are not knobs agentbox offers. Egress is only ever named hosts
through the per-task proxy (``[setup] network``, ``[network] allow``).

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
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from agentbox.config import DEFAULT_DISK, DEFAULT_IMAGE, Settings, Size, parse_size, setting_hint
from agentbox.errors import BoxfileError, PathRefused

__all__ = [
    "MAX_BOXFILE_BYTES",
    "Boxfile",
    "DiskLimit",
    "EnvPolicy",
    "Mount",
    "NetworkPolicy",
    "Resources",
    "Setup",
    "host_defaults",
    "load_boxfile",
    "loads_boxfile",
    "parse_size",
]

#: Host environment variables that may never be passed into a sandbox.
FORBIDDEN_ENV = re.compile(
    r"(?i)^(ANTHROPIC_.*|.*_API_KEY|.*TOKEN.*|.*SECRET.*|.*PASSWORD.*|AWS_.*|SSH_AUTH_SOCK|"
    r"LD_PRELOAD|LD_LIBRARY_PATH|DOCKER_HOST|CONTAINER_HOST|AGENTBOX_.*)$"
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
#: A Boxfile larger than this is refused unread (real ones are a few hundred bytes).
MAX_BOXFILE_BYTES = 1 << 20
#: ext4's default bytes-per-inode: a disk that does not name ``inodes`` gets size / this.
BYTES_PER_INODE = 16384


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class DiskLimit(BaseModel):
    """The workspace disk a sandbox gets: bytes and files, after the host's clamp."""

    model_config = ConfigDict(frozen=True)

    size: int
    inodes: int


class Resources(_Strict):
    """Limits; defaults are the seed's: 4 CPUs, 8 GiB (no swap), 512 pids, nofile 4096,
    and a 20 GiB workspace disk.

    ``disk`` bounds what the sandbox can write to ``/workspace`` (the copied repo
    included) and ``inodes`` how many files it can hold (default: one per 16 KiB
    of ``disk``, ext4's own ratio). Both are clamped by the host's
    ``max_disk``/``max_inodes`` settings (:meth:`disk_limit`).
    """

    cpus: float = Field(default=4.0, gt=0, le=256)
    memory: Size = 8 * 1024**3
    pids: int = Field(default=512, ge=16, le=65536)
    nofile: int = Field(default=4096, ge=64, le=20000)
    disk: Size = DEFAULT_DISK
    inodes: int | None = Field(default=None, ge=1024, le=2**32 - 1)

    @field_validator("disk")
    @classmethod
    def _min_disk(cls, v: int) -> int:
        if v < 64 * 1024**2:
            raise ValueError("disk must be at least 64MiB")
        return v

    def disk_limit(self, settings: Settings) -> DiskLimit:
        """``disk`` and ``inodes`` clamped by the host (``max_disk``, ``max_inodes``)."""
        size = min(self.disk, settings.max_disk)
        inodes = self.inodes if self.inodes is not None else size // BYTES_PER_INODE
        return DiskLimit(size=size, inodes=max(1024, min(inodes, settings.max_inodes)))

    @field_validator("memory")
    @classmethod
    def _min_memory(cls, v: int) -> int:
        if v < 64 * 1024**2:
            raise ValueError("memory must be at least 64MiB")
        return v


class Mount(_Strict):
    """A read-only host directory made visible inside the sandbox."""

    source: Path
    target: str
    read_only: Literal[True] = True

    @field_validator("source")
    @classmethod
    def _abs_source(cls, v: Path) -> Path:
        if not v.is_absolute():
            raise ValueError("mount source must be an absolute path")
        return v

    @field_validator("target")
    @classmethod
    def _abs_target(cls, v: str) -> str:
        p = PurePosixPath(v)
        if not p.is_absolute() or ".." in p.parts or "\0" in v or "," in v or ":" in v:
            raise ValueError("mount target must be an absolute path without '..', ',' or ':'")
        if str(p) in {"/", "/workspace", "/proc", "/sys", "/dev", "/run/agentbox", "/tmp"} or (
            p.parts[1] in {"proc", "sys", "dev", "etc", "usr", "bin", "sbin", "lib", "lib64"}
        ):
            raise ValueError(f"mount target {v} would shadow a system or agentbox path")
        return str(p)


class EnvPolicy(_Strict):
    """Which host variables pass into the sandbox (by name), and fixed ones to set."""

    allow: tuple[str, ...] = ("LANG", "LC_ALL", "TZ", "TERM")
    set: dict[str, str] = Field(default_factory=dict)

    @field_validator("allow")
    @classmethod
    def _check_allow(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            if not _ENV_NAME.match(name):
                raise ValueError(f"not a variable name: {name!r:.40}")
            if FORBIDDEN_ENV.match(name):
                raise ValueError(f"{name} may not pass into a sandbox (credentials stay out)")
        return v

    @field_validator("set")
    @classmethod
    def _check_set(cls, v: dict[str, str]) -> dict[str, str]:
        for name, val in v.items():
            if not _ENV_NAME.match(name) or FORBIDDEN_ENV.match(name):
                raise ValueError(f"variable {name!r:.40} may not be set in a sandbox")
            if "\0" in val:
                raise ValueError(f"value of {name} contains NUL")
        return v


#: A ``[network] allow`` entry: ``host`` or ``*.suffix`` (letters, digits, ``-``, dots).
_HOST_PATTERN = re.compile(r"^(\*\.)?(?!-)[a-z0-9-]{1,63}(?<!-)(\.(?!-)[a-z0-9-]{1,63}(?<!-))*$")
#: Setup commands, inputs and allowed hosts are each capped in number.
MAX_SETUP_COMMANDS = 64
MAX_SETUP_INPUTS = 64
MAX_ALLOWED_HOSTS = 64


class Setup(_Strict):
    """``[setup]``: shell commands run in ``/workspace`` before the agent, in the same sandbox
    posture; what they create there is frozen and reused (see :mod:`agentbox.env`).

    ``inputs`` are globs (relative to the repo root) of the files whose contents key the
    frozen environment, with the image and ``run``. ``network`` is ``"none"`` or
    ``"registries"`` (the package indexes the host's own pip, npm and uv use, through the
    task's egress proxy; ``[network] allow`` adds to it).
    """

    run: tuple[str, ...] = Field(min_length=1, max_length=MAX_SETUP_COMMANDS)
    inputs: tuple[str, ...] = Field(default=(), max_length=MAX_SETUP_INPUTS)
    network: Literal["none", "registries"] = "none"
    deadline: float = Field(default=900.0, gt=0, le=24 * 3600)
    keep: tuple[str, ...] = Field(default=(), max_length=16)
    """Paths under ``~`` (``"~/.cache/ms-playwright"``) setup leaves that are frozen with
    the environment and mounted at the same place for the agent."""

    @field_validator("keep")
    @classmethod
    def _keep(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for k in v:
            rel = PurePosixPath(k[2:]) if k.startswith("~/") else None
            if (
                rel is None
                or len(k) > 512
                or not rel.parts
                or rel.is_absolute()
                or any(part in ("..", ".") for part in rel.parts)
                or any(c in k for c in "\0\n'\\")
            ):
                raise ValueError(f"keep {k!r:.60} must be a path under '~/' without '..'")
        return v

    @field_validator("run")
    @classmethod
    def _commands(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for cmd in v:
            if not cmd.strip() or len(cmd) > 8192 or "\0" in cmd:
                raise ValueError("each setup command must be 1..8192 characters without NUL")
        return v

    @field_validator("inputs")
    @classmethod
    def _globs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for g in v:
            p = PurePosixPath(g)
            if (
                not g
                or len(g) > 1024
                or p.is_absolute()
                or ".." in p.parts
                or any(c in g for c in "\0\n\\")
            ):
                raise ValueError(f"input {g!r:.60} must be a relative glob without '..'")
        return v


class NetworkPolicy(_Strict):
    """``[network]``: host names the *agent* phase may reach through the egress proxy.

    Each entry is ``host`` or ``*.suffix``; IP literals are refused. The host's
    ``egress_allow_cap`` setting bounds them (checked when a task is validated).
    """

    allow: tuple[str, ...] = Field(default=(), max_length=MAX_ALLOWED_HOSTS)

    @field_validator("allow")
    @classmethod
    def _hosts(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for h in v:
            name = h.lower().removesuffix(".") if isinstance(h, str) else ""
            if (
                len(name) > 253
                or not _HOST_PATTERN.match(name)
                or name.rsplit(".", 1)[-1][:1].isdigit()
            ):
                raise ValueError(f"not a host name or '*.suffix' (no IP literals): {h!r:.80}")
            out.append(name)
        return tuple(dict.fromkeys(out))


class ImageBuild(_Strict):
    """``[image]``: the sandbox image is built from a Containerfile (``agentbox image build
    --containerfile``: the user's build, then agentbox's layer, hardening and verifier).

    Relative paths are relative to the Boxfile's directory; ``context`` defaults to the
    Containerfile's directory. A caller turns this into an image name with
    :func:`agentbox.image.build_for_boxfile` before a sandbox is made from the Boxfile.
    """

    containerfile: Path
    context: Path | None = None
    tag: str | None = Field(default=None, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$")


class Boxfile(_Strict):
    """One sandbox's declaration. Every field has a safe default."""

    image: str = DEFAULT_IMAGE
    # ``[image] containerfile = …`` (a table where ``image`` is a name) lands here.
    image_build: ImageBuild | None = None
    backend: Literal["podman", "qemu", "firecracker", "docker"] = "podman"
    runtime: Literal["runc", "crun", "runsc"] = "runc"
    isolation: Literal["standard", "strict"] = "standard"
    deadline: float = Field(default=3600.0, gt=0, le=7 * 24 * 3600)
    model: str | None = None
    budget: int | None = Field(default=None, gt=0, le=10_000_000_000)
    resources: Resources = Field(default_factory=Resources)
    mounts: tuple[Mount, ...] = ()
    env: EnvPolicy = Field(default_factory=EnvPolicy)
    setup: Setup | None = None
    # A string other than "none" exists only to be refused by name; a [network] table
    # names the hosts the agent phase may reach through the egress proxy.
    network: Literal["none"] | NetworkPolicy = "none"
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
                    f"set by {setting_hint('mount_roots')})",
                    path=m.source,
                )
            if not real.exists():
                raise PathRefused(f"[mounts.{i}.source] does not exist", path=m.source)
        return self.mounts

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], *, path: Path | None = None, settings: Settings | None = None
    ) -> Boxfile:
        """Validate ``data``; the first problem is raised as a BoxfileError naming its key.

        With ``settings``, the host's defaults (``AGENTBOX_IMAGE``, ``AGENTBOX_BACKEND``,
        ``AGENTBOX_AGENT_RUNTIME``) fill the keys ``data`` does not set.
        """
        if settings is not None:
            data = {**host_defaults(settings), **data}
        try:
            box = cls.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            key = ".".join(str(p) for p in err["loc"])[:200] or None
            if key is not None and key.startswith("image_build") and "image_build" not in data:
                key = "image" + key.removeprefix("image_build")  # the [image] table's key
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            raise BoxfileError(msg, key=key, path=path) from exc
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
