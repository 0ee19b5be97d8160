"""agentbox: run AI coding agents in sandboxes that assume the worst.

The public surface is small; implementation lives in subpackages. The names below
are imported on first use (PEP 562): importing any ``agentbox.x`` module imports
this package first, and the per-task gateway (``python -m agentbox.gateway``) must
not pay for the Boxfile model and the settings loader it never uses.
"""

from __future__ import annotations

# Not typing's: ``typing`` costs the front end's client 15 ms (agentbox.front.client).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from agentbox.boxfile import Boxfile, load_boxfile
    from agentbox.config import Settings, load_settings
    from agentbox.errors import AgentboxError
    from agentbox.sdk import AsyncClient, AsyncSandbox, Client, Sandbox

__version__ = "0.1.0"

__all__ = [
    "AgentboxError",
    "AsyncClient",
    "AsyncSandbox",
    "Boxfile",
    "Client",
    "Sandbox",
    "Settings",
    "__version__",
    "load_boxfile",
    "load_settings",
]

_LAZY = {
    "Boxfile": "agentbox.boxfile",
    "load_boxfile": "agentbox.boxfile",
    "Settings": "agentbox.config",
    "load_settings": "agentbox.config",
    "AgentboxError": "agentbox.errors",
    # The SDK (docs/reference/sdk.md): imported only when named.
    "Sandbox": "agentbox.sdk",
    "AsyncSandbox": "agentbox.sdk",
    "Client": "agentbox.sdk",
    "AsyncClient": "agentbox.sdk",
}


def __getattr__(name: str) -> Any:
    """The public names, imported on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agentbox' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
