"""The Boxfile's sections (``[resources]``, ``[[mounts]]``, ``[env]``, ``[setup]``,
``[network]``, ``[image]``) as strict models; :mod:`agentbox.boxfile` assembles them."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from agentbox.config import DEFAULT_DISK, Settings, Size

if TYPE_CHECKING:
    from agentbox.egress.rules import NetworkRule

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


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class DiskLimit(BaseModel):
    """The workspace disk a sandbox gets: bytes and files, after the host's clamp."""

    model_config = ConfigDict(frozen=True)

    size: int
    inodes: int


class Resources(Strict):
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


class Mount(Strict):
    """A read-only host directory made visible inside the sandbox."""

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)

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


class EnvPolicy(Strict):
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


class Setup(Strict):
    """``[setup]``: shell commands run in ``/workspace`` before the agent, in the same sandbox
    posture; what they create there is frozen and reused (see :mod:`agentbox.env`).

    ``inputs`` are globs (relative to the repo root) of the files whose contents key the
    frozen environment when ``key = "inputs"``; by default the whole tree keys it, with
    the image, ``run``, the variables, mounts and egress setup sees, the repo and the user.
    ``network`` is ``"none"`` or ``"registries"`` (the package indexes the host's own
    pip, npm and uv use, through the task's egress proxy; ``[network] allow`` adds to it).
    """

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)

    run: tuple[str, ...] = Field(min_length=1, max_length=MAX_SETUP_COMMANDS)
    inputs: tuple[str, ...] = Field(default=(), max_length=MAX_SETUP_INPUTS)
    network: Literal["none", "registries"] = "none"
    deadline: float = Field(default=900.0, gt=0, le=24 * 3600)
    key: Literal["tree", "inputs"] = "tree"
    """What files key the frozen environment: ``"tree"``, the whole workspace setup starts
    from (a file setup reads that ``inputs`` does not name still counts); ``"inputs"``,
    only the files ``inputs`` matches, a narrowing the user opts into (see
    :mod:`agentbox.env._key`)."""
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


MAX_NETWORK_RULES = 64
_SECRET_OPEN = "${secret:"  # noqa: S105 (the syntax, not a secret)


def _no_secret(field: str, values: tuple[str, ...] | str) -> None:
    for v in (values,) if isinstance(values, str) else values:
        if _SECRET_OPEN in v:
            raise ValueError(f"{field}: ${{secret:...}} is allowed only in inject.value")


class InjectSpec(Strict):
    """``inject = { header = "Authorization", value = "Bearer ${secret:NAME}" }``."""

    model_config = ConfigDict(defer_build=True)

    header: str = Field(min_length=1, max_length=128)
    value: str = Field(min_length=1, max_length=4096)


class NetworkRuleSpec(Strict):
    """One ``[[network.rule]]``: requests to ``host`` that pass, per request, through the
    proxy (which terminates TLS for the host), and a header it injects into them.

    ``${secret:NAME}`` may appear only in ``inject.value``: a Boxfile names secrets, it
    never reads them (the names are checked here, the values exist only on the host).
    """

    model_config = ConfigDict(defer_build=True)

    host: str = Field(min_length=1, max_length=253)
    methods: tuple[str, ...] = Field(default=("GET", "HEAD"), min_length=1, max_length=16)
    paths: tuple[str, ...] = Field(default=("/*",), min_length=1, max_length=32)
    inject: InjectSpec | None = None
    phases: tuple[Literal["setup", "agent"], ...] = Field(
        default=("setup", "agent"), min_length=1, max_length=2
    )

    @model_validator(mode="after")
    def _valid(self) -> NetworkRuleSpec:
        _no_secret("host", self.host)
        _no_secret("methods", self.methods)
        _no_secret("paths", self.paths)
        if self.inject is not None:
            _no_secret("inject.header", self.inject.header)
        if any(len(p) > 1024 for p in self.paths):
            raise ValueError("a path glob is at most 1024 characters")
        name = self.host.lower().removesuffix(".")
        if not _HOST_PATTERN.match(name) or name.rsplit(".", 1)[-1][:1].isdigit():
            raise ValueError(
                f"host: not a host name or '*.suffix' (no IP literals): {self.host!r:.80}"
            )
        self.to_rule(line=None)  # the proxy's own checks (methods, paths, inject, secret names)
        return self

    def to_rule(self, *, line: int | None) -> NetworkRule:
        """This rule as the proxy's :class:`~agentbox.egress.rules.NetworkRule`."""
        from agentbox.egress.rules import Inject, NetworkRule

        inject = None if self.inject is None else Inject(self.inject.header, self.inject.value)
        return NetworkRule(
            host=self.host,
            methods=self.methods,
            paths=self.paths,
            inject=inject,
            phases=frozenset(self.phases),
            origin="boxfile",
            line=line,
        )


class NetworkPolicy(Strict):
    """``[network]``: host names the *agent* phase may reach through the egress proxy,
    and ``[[network.rule]]`` request-level rules (either phase).

    Each ``allow`` entry is ``host`` or ``*.suffix``; IP literals are refused. The host's
    ``egress_allow_cap`` setting bounds them and the rules' hosts (checked when a task is
    validated).
    """

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)

    allow: tuple[str, ...] = Field(default=(), max_length=MAX_ALLOWED_HOSTS)
    rule: tuple[NetworkRuleSpec, ...] = Field(default=(), max_length=MAX_NETWORK_RULES)

    def rules(self) -> tuple[NetworkRule, ...]:
        """The ``[[network.rule]]`` tables as rules, numbered from 1 in the Boxfile's order."""
        return tuple(spec.to_rule(line=i) for i, spec in enumerate(self.rule, 1))

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


class GitPolicy(Strict):
    """``[git]``: ``fetch = true`` lets the agent ``git fetch``/``git pull`` the repo's own
    https remote (``remote``, default ``origin``, as the user's repo on the host names it)
    through the egress proxy: upload-pack only, with the host user's credential injected
    (the secret ``secret`` as the password of ``user``, else the user's git credential
    helper); ``git push`` (receive-pack) is refused: results are published from the host.
    """

    fetch: bool = False
    remote: str = Field(default="origin", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    secret: str | None = Field(default=None, pattern=r"^[A-Z][A-Z0-9_]{0,63}$")
    """An ``agentbox secret`` name: the password (token) sent for ``user``."""
    user: str = Field(default="x-access-token", pattern=r"^[A-Za-z0-9._@+-]{1,128}$")

    @field_validator("secret")
    @classmethod
    def _not_reserved(cls, v: str | None) -> str | None:
        if v is not None and v.startswith("AGENTBOX_"):
            raise ValueError("secret names starting with AGENTBOX_ are reserved")
        return v


class ImageBuild(Strict):
    """``[image]``: the sandbox image is built from a Containerfile (``agentbox image build
    --containerfile``: the user's build, then agentbox's layer, hardening and verifier).

    Relative paths are relative to the Boxfile's directory; ``context`` defaults to the
    Containerfile's directory. A caller turns this into an image name with
    :func:`agentbox.image.build_for_boxfile` before a sandbox is made from the Boxfile.
    """

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True)

    containerfile: Path
    context: Path | None = None
    tag: str | None = Field(default=None, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$")
