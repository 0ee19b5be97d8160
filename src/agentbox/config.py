"""Typed settings, read from the environment (``AGENTBOX_*``) and an optional TOML file.

Read at one edge (:func:`load_settings`) and passed down; tests build a
:class:`Settings` directly. The file is ``$AGENTBOX_CONFIG`` or
``/etc/agentbox/config.toml``; the environment wins over the file.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BeforeValidator, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from agentbox.errors import ConfigError

__all__ = [
    "CLAUDE_CODE_VERSION",
    "DEFAULT_DISK",
    "DEFAULT_IMAGE",
    "Settings",
    "load_settings",
    "parse_size",
]

#: The pinned ``@anthropic-ai/claude-code`` npm release baked into the default image.
CLAUDE_CODE_VERSION = "2.1.332"
#: The name of the default image in podman's storage (tagged with its content hash too).
DEFAULT_IMAGE = "localhost/agentbox-default:latest"

#: A task's workspace disk when its Boxfile does not say (``[resources] disk``).
DEFAULT_DISK = 20 * 1024**3
#: The largest size any key accepts (1 EiB): beyond it a number is a mistake, not a size.
MAX_SIZE = 1 << 60

_SIZE_RE = re.compile(r"(?i)^\s*(\d+(?:\.\d+)?)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)?\s*$")
_UNITS = {
    None: 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}  # fmt: skip


def parse_size(value: object) -> int:
    """``"8GiB"``, ``"512m"``, ``1073741824`` → bytes. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a string like '8GiB'")
    if isinstance(value, int):
        return _check_size(value)
    if isinstance(value, str) and len(value) <= 64 and (m := _SIZE_RE.match(value)):
        unit = m.group(2).lower() if m.group(2) else None
        number = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(number) or number > MAX_SIZE:  # int(inf) would raise OverflowError
            raise ValueError("a size must be at most 1 EiB")
        return _check_size(int(number))
    raise ValueError(f"not a size: {value!r:.40} (use bytes or e.g. '8GiB')")


def _check_size(size: int) -> int:
    if size <= 0:
        raise ValueError("a size must be positive")
    if size > MAX_SIZE:
        raise ValueError("a size must be at most 1 EiB")
    return size


Size = Annotated[int, BeforeValidator(parse_size)]

#: The backends a user may name: :data:`agentbox.backends.registry.NAMES`, written out for
#: the type checker (tests/unit/test_backend_registry.py holds the two equal).
Backend = Literal["podman", "qemu", "firecracker", "docker"]
Runtime = Literal["runc", "crun", "runsc"]


def _default_cache_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/cache/agentbox")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agentbox"


def _default_data_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/agentbox")
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local/share")
    return Path(base) / "agentbox"


#: How a setting is written in the environment, for errors that name it.
_SETTING_FORMS = {
    "repos_root": "a directory",
    "mount_roots": "a colon-separated list of directories, as PATH is",
    "egress_allow_cap": "a comma-separated list of host names",
    "egress_trusted_ranges": "a comma-separated list of CIDR ranges",
    "egress_hosts": "a comma-separated list of NAME=ADDRESS",
    "egress_upstream_ca": "a colon-separated list of CA files",
    "forge_hosts": "a comma-separated list of HOST=github|gitlab[:API-URL]",
    "max_disk": "a size such as 100GiB",
    "models_file": "a TOML file",
}


#: A setting's default in words, where its value alone does not say it.
_SETTING_DEFAULTS = {"repos_root": "the home directory"}


def setting_hint(name: str) -> str:
    """``AGENTBOX_<NAME>`` and its format, for an error that names the setting ``name``."""
    form = _SETTING_FORMS.get(name)
    return f"AGENTBOX_{name.upper()}" + (f", {form}" if form else "")


def setting_source(name: str, value: Any) -> str:
    """Where the setting ``name``'s ``value`` came from, for an error that shows it:
    ``set by AGENTBOX_REPOS_ROOT``, ``set in /etc/agentbox/config.toml``, or ``the default
    (the home directory); set AGENTBOX_REPOS_ROOT, a directory, to choose another``
    (the order :func:`load_settings` reads them in, the environment first)."""
    env = f"AGENTBOX_{name.upper()}"
    if env in os.environ:
        return f"set by {env}"
    path = config_path()
    try:
        if name in tomllib.loads(path.read_text()):
            return f"set in {path}"
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        pass
    if not _is_default(name, value):  # given by the program that made the settings
        return f"set when agentbox started; {setting_hint(name)} sets it"
    what = _SETTING_DEFAULTS.get(name)
    default = f"the default ({what})" if what else "the default"
    comma = "," if name in _SETTING_FORMS else ""
    return f"{default}; set {setting_hint(name)}{comma} to choose another"


def _is_default(name: str, value: Any) -> bool:
    field = Settings.model_fields.get(name)
    if field is None:
        return False
    default = field.get_default(call_default_factory=True)
    if isinstance(default, Path) and isinstance(value, Path):
        return default.expanduser().resolve() == value.expanduser().resolve()
    return bool(default == value)


def config_path() -> Path:
    """The config file: ``$AGENTBOX_CONFIG``, else ``/etc/agentbox/config.toml``."""
    return Path(os.environ.get("AGENTBOX_CONFIG", "/etc/agentbox/config.toml"))


class Settings(BaseSettings):
    """Host-level settings. A Boxfile chooses per sandbox within these."""

    model_config = SettingsConfigDict(
        env_prefix="AGENTBOX_", extra="forbid", frozen=True, populate_by_name=True
    )

    data_dir: Path = Field(default_factory=_default_data_dir)
    """Workspaces, task state, sockets, tokens: everything agentbox writes per task."""
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    """Built images (rootfs, podman tarball, microVM disks), kernels, Claude Code: rebuildable."""
    repos_root: Path = Field(default_factory=Path.home)
    """Repos that may be delegated must resolve inside this directory."""
    mount_roots: Annotated[tuple[Path, ...], NoDecode] = ()
    """Extra read-only mounts (venvs, toolchains) must live under one of these."""
    image: str = DEFAULT_IMAGE
    backend: Backend = "podman"
    runtime: Runtime = Field(
        default="runc", validation_alias=AliasChoices("AGENTBOX_AGENT_RUNTIME", "AGENTBOX_RUNTIME")
    )
    sandbox_uid: int = 64000
    """The uid/gid the agent runs as inside the sandbox."""
    subid_base: int = 100000
    """The start of agentbox's host ids: sandbox id N maps to ``sandbox_subid_base + N``,
    a range of the sandbox's own (see ``uid_slots``)."""
    uid_slots: int = Field(default=256, ge=1, le=16384)
    """How many sandboxes may hold a host uid range of their own at once: slot k is the
    65536 ids from ``subid_base + (2 + k) * 65536`` (backends/_uidslots.py)."""
    uid_slot: int | None = Field(default=None, ge=0)
    """This sandbox's slot, set per sandbox by whoever claimed it (never in a config
    file); None: the slot-less range from ``subid_base`` (direct backend use, docker)."""
    pool_size: int = Field(default=0, ge=0, le=32)
    """Warm podman sandboxes ``launcher serve`` keeps started for the next tasks (0: no
    pool). Each idles at about 12 MiB; ``AGENTBOX_POOL_SIZE=2`` on a service host."""
    pool_ttl: float = Field(default=300.0, ge=30.0, le=3600.0)
    """Seconds a pooled sandbox waits unclaimed before it is replaced."""
    env_shared_across_users: bool = False
    """Whether one user's task may reuse a frozen environment another user's setup made
    (the same key but for the user). Off: each user's environments are their own."""
    models_file: Path | None = None
    """The model registry (TOML); None means the built-in registry (the replay model)."""
    gateway_template: bool = True
    """Fork each task's gateway from one prepared template process per launcher instead of
    starting a new interpreter (``AGENTBOX_GATEWAY_TEMPLATE=0`` turns it off): its imports
    are shared, so an idle gateway costs about half the memory, and it serves in tens of
    milliseconds. Falls back to starting one (logged) when the template cannot serve."""
    claude_code_version: str = CLAUDE_CODE_VERSION
    max_disk: Size = 64 * 1024**3
    """The largest workspace disk a Boxfile may ask for (``[resources] disk``); larger asks
    are clamped to it. ``AGENTBOX_MAX_DISK=100GiB``."""
    max_inodes: int = Field(default=4_000_000, ge=1024, le=2**32 - 1)
    """The most files (inodes) a workspace disk may hold; larger asks are clamped to it."""
    qemu_binary: str = "qemu-system-x86_64"
    firecracker_binary: Path | None = None
    egress_allow_cap: Annotated[tuple[str, ...], NoDecode] = ()
    """Host names a Boxfile's ``[network] allow`` may add (``host``, ``*.suffix``, or ``*``
    for any); empty: a Boxfile may add none. Comma-separated in the environment."""
    egress_trusted_ranges: Annotated[tuple[str, ...], NoDecode] = ()
    """Address ranges (CIDR) that allowed names other than the host's own registries may
    resolve to although private or reserved (a company mirror). Comma-separated."""
    egress_ca_bundle: Path | None = None
    """The CA bundle phases with egress trust; None: the host's system bundle."""
    egress_hosts: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    """Names the egress proxy resolves to given addresses instead of asking DNS
    (``{ "pypi.corp.example" = "10.1.2.3" }``; ``AGENTBOX_EGRESS_HOSTS="name=addr,…"``),
    trusted like a registry's name (the address may be private). Root's config only."""
    egress_upstream_ca: Annotated[tuple[Path, ...], NoDecode] = ()
    """CA files the egress proxy trusts for upstreams it terminates TLS for, besides the
    system bundle. Colon-separated in the environment, as PATH is."""
    forge_hosts: Annotated[tuple[str, ...], NoDecode] = ()
    """Forges besides github.com and gitlab.com that ``publish --pr`` opens pull requests
    on, as ``HOST=github|gitlab[:API-URL]`` (GitHub Enterprise: ``ghe.corp=github:https://
    ghe.corp/api/v3``; self-hosted GitLab: ``git.corp=gitlab``, API at ``https://HOST``).
    An entry for github.com or gitlab.com replaces its API URL. Comma-separated."""

    @field_validator("egress_hosts", mode="before")
    @classmethod
    def _hosts_map(cls, v: Any) -> Any:
        # "name=addr,name=addr" in the environment, a table in the config file.
        if isinstance(v, str):
            out: dict[str, str] = {}
            for item in (p.strip() for p in v.split(",")):
                if not item:
                    continue
                name, sep, addr = item.partition("=")
                if not sep:
                    raise ValueError(f"{item!r:.80}: write NAME=ADDRESS")
                out[name.strip()] = addr.strip()
            return out
        return v

    @field_validator("egress_hosts")
    @classmethod
    def _hosts_valid(cls, v: dict[str, str]) -> dict[str, str]:
        import ipaddress

        from agentbox.core.hostname import normalize_host

        out = {}
        for name, addr in v.items():
            out[normalize_host(name)] = str(ipaddress.ip_address(addr))
        return out

    @field_validator("egress_upstream_ca", mode="before")
    @classmethod
    def _ca_files(cls, v: Any) -> Any:
        if isinstance(v, str):
            return tuple(Path(p) for p in v.split(":") if p)
        return v

    @field_validator("data_dir", "cache_dir", "repos_root")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @field_validator("mount_roots", mode="before")
    @classmethod
    def _split_roots(cls, v: Any) -> Any:
        # A colon-separated list, as PATH is (the environment's form).
        if isinstance(v, str):
            return tuple(Path(p).expanduser().resolve() for p in v.split(":") if p)
        return v

    @field_validator("egress_allow_cap", "egress_trusted_ranges", "forge_hosts", mode="before")
    @classmethod
    def _split_commas(cls, v: Any) -> Any:
        if isinstance(v, str):
            return tuple(p.strip() for p in v.split(",") if p.strip())
        return v

    @field_validator("egress_trusted_ranges")
    @classmethod
    def _cidrs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        import ipaddress

        return tuple(str(ipaddress.ip_network(p, strict=False)) for p in v)

    @property
    def sandbox_subid_base(self) -> int:
        """The host id the sandbox's id 0 maps to: its slot's range, or ``subid_base``."""
        if self.uid_slot is None:
            return self.subid_base
        return self.subid_base + (2 + self.uid_slot) * 65536

    @property
    def sandbox_host_uid(self) -> int:
        """The host uid the sandbox's uid maps to (owns nothing; no other live sandbox's)."""
        return self.sandbox_subid_base + self.sandbox_uid

    def for_slot(self, slot: int | None) -> Settings:
        """These settings for a sandbox holding uid ``slot``."""
        return self.model_copy(update={"uid_slot": slot})

    @property
    def claude_code_dir(self) -> Path:
        """Where the pinned Claude Code npm package is installed on the host."""
        return self.cache_dir / "claude-code" / self.claude_code_version

    @property
    def claude_binary(self) -> Path:
        """The native Claude Code binary from the pinned npm package."""
        return self.claude_code_dir / "node_modules/@anthropic-ai/claude-code-linux-x64/claude"


def load_settings(**overrides: Any) -> Settings:
    """Settings from the config file, then the environment, then ``overrides``."""
    path = config_path()
    file_values: dict[str, Any] = {}
    if path.is_file():
        try:
            file_values = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    env_names = {f"AGENTBOX_{k.upper()}" for k in Settings.model_fields} | {
        "AGENTBOX_AGENT_RUNTIME"
    }
    # Values from the environment override the file: drop file keys the env sets.
    for key in list(file_values):
        if f"AGENTBOX_{key.upper()}" in os.environ and f"AGENTBOX_{key.upper()}" in env_names:
            file_values.pop(key)
    try:
        return Settings(**{**file_values, **overrides})
    except (ValidationError, SettingsError) as exc:
        raise ConfigError(f"invalid settings: {exc}") from exc
