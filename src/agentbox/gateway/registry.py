"""The model registry: the names a client may choose, and where each one really goes.

Clients (the CLI, the MCP ``delegate`` tool, a Boxfile) name a model; only the
registry says which upstream serves it, under which upstream model id, with
which key from the host environment. The registry is a TOML file
(``Settings.models_file``) or, without one, the built-in registry below, whose
default entry ``replay-demo`` is the offline replay model and needs no key::

    [models.sonnet]
    kind = "anthropic"                      # anthropic | compatible | replay
    upstream = "https://api.anthropic.com"  # base URL, or a replay script path
    upstream_model = "claude-sonnet-5-5"
    key_env = "ANTHROPIC_API_KEY"           # read from the host env by the gateway only
    unsupported_fields = []                 # request fields stripped before forwarding
    # allowed_fields / allowed_block_types / allowed_betas: the request allow-lists
    # (default: the kind's, see agentbox.gateway._policy); image_tokens, document_tokens
    cache_creation_weight = 1.25
    cache_read_weight = 0.1
    [models.sonnet.price]                   # US dollars per million tokens (optional)
    input = 2.0
    output = 10.0
    cache_write = 2.5                       # 5-minute writes; cache_write_1h: 1-hour ones
    cache_read = 0.1

A relative replay script path is resolved against the registry file's directory,
and must name a readable file when the registry is loaded. A top-level
``default = "<name>"`` picks the model a task gets when it names none; without
it, the first real (not replay) model whose key is set (``sonnet`` first), else
``replay-demo`` if the registry has it, else the first name in sort order (and
``agentbox models`` says which, and why). An entry whose ``key_env`` is not set
in the environment is listed as unavailable, with that reason, and a task
naming it is refused before anything starts. Errors in an entry are reported in
our own words, naming the entry and the key (``[models.x] kind: …``).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from agentbox.errors import ConfigError
from agentbox.gateway._catalog import BUILTIN, DEMO_SCRIPT, RETIRED_MODELS
from agentbox.gateway._check import (
    Checker,
    Errors,
    Invalid,
    boolean,
    choice,
    integer,
    number,
    optional,
    text,
    tuple_of,
)
from agentbox.gateway._check import fields as check_fields
from agentbox.gateway._policy import (
    DEFAULT_BETAS,
    DEFAULT_BLOCK_TYPES,
    DEFAULT_FIELDS,
    NETWORK_BETA_PREFIXES,
    NETWORK_BLOCK_TYPES,
    NETWORK_FIELDS,
    RequestPolicy,
)
from agentbox.gateway._price import Price
from agentbox.gateway._regfile import MAX_REGISTRY_BYTES, check_script, read_registry_file

if TYPE_CHECKING:
    # Only a type here: the gateway process loads the registry without the settings
    # loader (pydantic-settings, ~5 MiB per task).
    from agentbox.config import Settings

__all__ = [
    "DEFAULT_MODEL",
    "DEMO_SCRIPT",
    "KIND_UNSUPPORTED_FIELDS",
    "MAX_REGISTRY_BYTES",
    "RETIRED_MODELS",
    "ModelEntry",
    "Price",
    "Registry",
    "builtin_registry",
    "load_registry",
    "scripted_note",
]

Kind = Literal["anthropic", "compatible", "replay"]

#: The built-in offline default: the replay model playing the demo script.
DEFAULT_MODEL = "replay-demo"

#: Request fields each upstream kind does not accept; stripped unless the entry says otherwise.
#: Anthropic-compatible local servers (llama.cpp, vLLM) reject or mishandle the newer,
#: Anthropic-only fields Claude Code sends; the real API and the replay model take them all.
KIND_UNSUPPORTED_FIELDS: Mapping[str, tuple[str, ...]] = {
    "anthropic": (),
    "replay": (),
    "compatible": (
        "betas",
        "container",
        "context_management",
        "mcp_servers",
        "service_tier",
        "thinking",
        "output_format",
    ),
}


_REQUIRED_FIELDS = frozenset({"model", "messages", "max_tokens", "stream"})


def _none_of(bad_of: Callable[[tuple[str, ...]], list[str]], why: str) -> Checker:
    """An optional tuple of strings, none of which ``bad_of`` picks out (``why`` says why)."""
    items = optional(tuple_of(text))

    def check(value: Any, key: str, errors: Errors) -> Any:
        n = len(errors)
        out = items(value, key, errors)
        if len(errors) == n and out is not None and (bad := bad_of(out)):
            errors.append((key, f"{', '.join(bad)}: {why}"))
        return out

    return check


def _name(value: Any, key: str, errors: Errors) -> Any:
    n = len(errors)
    text(value, key, errors)
    if len(errors) == n and (
        not value or len(value) > 128 or not all(c.isalnum() or c in "-_.:" for c in value)
    ):
        errors.append((key, f"bad model name {value!r}: use letters, digits and -_.:"))
    return value


#: ``(key, checker, default)`` of a model entry, in the order its errors are reported.
_ENTRY: tuple[tuple[str, Checker, Any], ...] = (
    ("name", _name, ...),
    ("kind", choice("anthropic", "compatible", "replay"), ...),
    ("upstream", text, ...),
    ("upstream_model", text, ""),
    ("key_env", optional(text), None),
    ("unsupported_fields", optional(tuple_of(text)), None),
    ("forward_beta", optional(boolean), None),
    ("count_tokens", optional(boolean), None),
    ("allowed_fields", _none_of(lambda v: sorted(set(v) & set(NETWORK_FIELDS)),
                                "would let the upstream reach the network"), None),
    ("allowed_block_types", _none_of(lambda v: sorted(set(v) & NETWORK_BLOCK_TYPES),
                                     "server tool blocks reach the network"), None),
    ("allowed_betas", _none_of(lambda v: [b for b in v if b.lower().startswith(
        NETWORK_BETA_PREFIXES)], "these betas reach the network"), None),
    ("image_tokens", lambda v, k, e: integer(v, k, e, ge=0), 5_000),
    ("document_tokens", lambda v, k, e: integer(v, k, e, ge=0), 1_800_000),
    ("cache_creation_weight", lambda v, k, e: number(v, k, e, ge=0), 1.25),
    ("cache_read_weight", lambda v, k, e: number(v, k, e, ge=0), 0.1),
    ("cache_creation_1h_weight", lambda v, k, e: number(v, k, e, ge=0), 2.0),
    ("price", Price.check, None),
    ("description", text, ""),
)  # fmt: skip


@dataclass(frozen=True)
class ModelEntry:
    """One model a client may choose by ``name``.

    Checked when made (:class:`~agentbox.gateway._check.Invalid`, a ``ValueError``,
    naming each key that is wrong); list values become tuples, numbers their type.
    """

    name: str
    kind: Kind
    upstream: str
    """Base URL (``https://…``, ``http://127.0.0.1:…``) or, for ``replay``, a script path."""
    upstream_model: str = ""
    """The model id sent upstream (``model`` is always rewritten to this); default: ``name``."""
    key_env: str | None = None
    """Host environment variable holding the upstream's API key (never seen by the sandbox)."""
    unsupported_fields: tuple[str, ...] | None = None
    """Top-level request fields stripped before forwarding; None: the kind's default list."""
    forward_beta: bool | None = None
    """Forward the client's ``anthropic-beta`` header; None: only to ``anthropic`` and replay."""
    count_tokens: bool | None = None
    """The upstream serves ``/v1/messages/count_tokens``; None: all but ``compatible``."""
    allowed_fields: tuple[str, ...] | None = None
    """Top-level request fields admitted (others stripped); None: the default list."""
    allowed_block_types: tuple[str, ...] | None = None
    """Content block types admitted (others refused); None: the default list."""
    allowed_betas: tuple[str, ...] | None = None
    """``anthropic-beta`` values forwarded (others dropped); None: the default list."""
    image_tokens: int = 5_000
    """Worst-case input tokens of one image, for the budget's reservation."""
    document_tokens: int = 1_800_000
    """Worst-case input tokens of one base64 PDF document, for the reservation."""
    cache_creation_weight: float = 1.25
    cache_read_weight: float = 0.1
    cache_creation_1h_weight: float = 2.0
    """Token-budget weight of a 1-hour cache write (5-minute ones: ``cache_creation_weight``)."""
    price: Price | None = None
    """US dollars per million tokens; None: the price is unknown (cost is never $0)."""
    description: str = ""

    def __post_init__(self) -> None:
        errors: Errors = []
        values = check_fields(
            {f.name: getattr(self, f.name) for f in dataclass_fields(self)}, _ENTRY, errors
        )
        if errors:
            raise Invalid(errors)
        for key, value in values.items():
            object.__setattr__(self, key, value)

    @classmethod
    def check(cls, raw: Mapping[str, Any]) -> tuple[ModelEntry | None, Errors]:
        """An entry from a registry table (``name`` included), or what is wrong with it."""
        errors: Errors = []
        values = check_fields(raw, _ENTRY, errors, what="a model entry")
        return (None if errors else cls(**values)), errors

    @property
    def stripped_fields(self) -> tuple[str, ...]:
        """The fields the gateway removes from requests for this model."""
        if self.unsupported_fields is not None:
            return self.unsupported_fields
        return KIND_UNSUPPORTED_FIELDS[self.kind]

    @property
    def policy(self) -> RequestPolicy:
        """The request allow-lists for this model (see :mod:`agentbox.gateway._policy`)."""
        return RequestPolicy(
            # The fields every request needs stay, whatever the entry lists.
            fields=frozenset(DEFAULT_FIELDS if self.allowed_fields is None else self.allowed_fields)
            | _REQUIRED_FIELDS,
            block_types=frozenset(
                DEFAULT_BLOCK_TYPES
                if self.allowed_block_types is None
                else self.allowed_block_types
            ),
            betas=frozenset(
                self.allowed_betas if self.allowed_betas is not None else DEFAULT_BETAS
            ),
            image_tokens=self.image_tokens,
            document_tokens=self.document_tokens,
        )

    @property
    def target_model(self) -> str:
        """The ``model`` value the upstream receives."""
        return self.upstream_model or self.name

    @property
    def has_count_tokens(self) -> bool:
        """Whether count_tokens is forwarded (else the gateway answers with its estimate)."""
        return self.count_tokens if self.count_tokens is not None else self.kind != "compatible"

    @property
    def passes_beta(self) -> bool:
        """Whether the client's ``anthropic-beta`` header is forwarded."""
        return self.forward_beta if self.forward_beta is not None else self.kind != "compatible"

    @property
    def replay_script(self) -> Path | None:
        """The script path of a replay entry."""
        return Path(self.upstream) if self.kind == "replay" else None

    @property
    def scripted(self) -> bool:
        """The replay model plays a script: no real model answers."""
        return self.kind == "replay"

    @property
    def retired(self) -> str | None:
        """The date the provider retired this entry's upstream model id, if it did."""
        return RETIRED_MODELS.get(self.target_model) if self.kind != "replay" else None

    def unavailable(self, environ: Mapping[str, str] | None = None) -> str | None:
        """Why a task cannot use this model here (its key is not set), or None."""
        env = os.environ if environ is None else environ
        if self.key_env and not env.get(self.key_env):
            return f"{self.key_env} is not set"
        return None


class Registry:
    """The models clients may choose, by name."""

    def __init__(
        self,
        entries: Mapping[str, ModelEntry],
        *,
        source: str = "built-in",
        default: str | None = None,
    ) -> None:
        self._entries = dict(entries)
        self.source = source
        self._default = default

    def default_for(self, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
        """The model a task gets when it names none, and why, given ``environ``'s keys.

        ``default`` in the file wins; else the first real (not replay) model that is
        available here (``sonnet`` first, then by name); else ``replay-demo`` if the
        registry has it; else the first name.
        """
        if self._default is not None:
            return self._default, f"set by `default` in {self.source}"
        real = [e for e in self if not e.scripted]
        real.sort(key=lambda e: (e.name != "sonnet", e.name))
        for e in real:
            if e.unavailable(environ) is None:
                how = f"{e.key_env} is set" if e.key_env else "it needs no key"
                return e.name, f"the first real model available: {how}"
        missing = sorted({e.key_env for e in real if e.key_env})
        why = f" ({', '.join(missing)} not set)" if missing else ""
        if DEFAULT_MODEL in self._entries:
            return DEFAULT_MODEL, f"the scripted demo: no real model is available{why}"
        first = (sorted(self._entries) or [""])[0]
        return first, f"the first by name: {self.source} sets no `default`{why}"

    @property
    def default(self) -> str:
        """The default model for this process's environment (see :meth:`default_for`)."""
        return self.default_for()[0]

    @property
    def default_reason(self) -> str:
        """Why :attr:`default` is the default."""
        return self.default_for()[1]

    def get(self, name: str) -> ModelEntry:
        """The entry named ``name``; :class:`ConfigError` naming the known ones otherwise."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise ConfigError(
                f"unknown model {name!r} in the model registry ({self.source}); known: {known}"
            ) from None

    def names(self) -> list[str]:
        """Model names, sorted."""
        return sorted(self._entries)

    def __iter__(self) -> Iterator[ModelEntry]:
        return iter(self._entries[n] for n in self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def _parse(data: Mapping[str, Any], *, base: Path | None, source: str) -> Registry:
    models = data.get("models")
    if not isinstance(models, Mapping) or not models:
        raise ConfigError(f"model registry {source}: needs a non-empty [models.<name>] table")
    default = data.get("default")
    if default is not None and (not isinstance(default, str) or default not in models):
        known = ", ".join(sorted(models))
        raise ConfigError(
            f"model registry {source}: default = {default!r:.60} names no entry (known: {known})"
        )
    entries: dict[str, ModelEntry] = {}
    for name, raw in models.items():
        if not isinstance(raw, Mapping):
            raise ConfigError(f"model registry {source}: [models.{name}] must be a table")
        fields = dict(raw)
        fields["name"] = name
        entry, errors = ModelEntry.check(fields)
        if entry is None:
            what = "; ".join(f"[models.{name}] {key}: {why}" for key, why in errors)
            raise ConfigError(f"model registry {source}: {what}")
        if entry.kind == "replay" and base is not None and not Path(entry.upstream).is_absolute():
            entry = replace(entry, upstream=str(base / entry.upstream))
        if entry.kind == "replay":
            check_script(Path(entry.upstream), f"model registry {source}: [models.{name}] upstream")
        elif not entry.upstream.startswith(("http://", "https://")):
            raise ConfigError(
                f"model registry {source}: [models.{name}] upstream must be an http(s) URL"
            )
        entries[name] = entry
    return Registry(entries, source=source, default=default)


def builtin_registry() -> Registry:
    """The registry used when no models file is configured."""
    return _parse({"models": BUILTIN}, base=None, source="built-in")


def load_registry(settings: Settings | None = None, path: Path | None = None) -> Registry:
    """The registry from ``path``, else ``settings.models_file``, else the built-in one.

    Any problem with the file (unreadable, not a regular file, over
    :data:`MAX_REGISTRY_BYTES`, not UTF-8, not TOML, nested too deeply, a bad entry)
    is a :class:`ConfigError` that names it; never a traceback.
    """
    path = path or (settings.models_file if settings is not None else None)
    if path is None:
        return builtin_registry()
    text = read_registry_file(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cannot read model registry {path}: {exc}") from exc
    except RecursionError:
        raise ConfigError(f"cannot read model registry {path}: nested too deeply") from None
    try:
        return _parse(data, base=path.parent, source=str(path))
    except RecursionError:
        raise ConfigError(f"model registry {path}: nested too deeply") from None


def scripted_note(model: str, settings: Settings | None = None) -> str | None:
    """The one line every front end prints when a task's model is scripted, else None.

    A new user with no key gets the offline demo model by default and could take its
    canned answers for a real agent's work: this says so, and how to get a real one.
    """
    try:
        entry = load_registry(settings).get(model)
    except ConfigError:
        return None
    if not entry.scripted:
        return None
    return (
        f"note: model {model!r} is scripted (the replay model plays a fixed script; no real "
        "model runs); for a real one set ANTHROPIC_API_KEY and pass --model sonnet "
        "(see `agentbox models`)"
    )
