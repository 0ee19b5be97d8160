"""The per-task model gateway and the replay model.

One gateway per task, on its own unix socket: it lets only ``POST /v1/messages``
and ``/v1/messages/count_tokens`` through, only with the task's one-time token,
pins the model, strips what the upstream does not take, meters every token and
enforces a budget that concurrent requests and dropped streams cannot overdraw.

What the launcher calls::

    handle = spawn_gateway(socket_path=…, token_file=…, model="replay-demo",
                           budget=20_000_000, usage_file=…, settings=settings)
    …
    usage = read_usage(handle.usage_file)
    handle.stop()
"""

from typing import TYPE_CHECKING, Any

from agentbox.gateway._budget import GROUP_BUDGET_FILE as GROUP_BUDGET_FILE
from agentbox.gateway._handshake import HANDSHAKE_VERSION as HANDSHAKE_VERSION
from agentbox.gateway._handshake import read_handshake as read_handshake
from agentbox.gateway._price import Price as Price
from agentbox.gateway._price import format_usd as format_usd
from agentbox.gateway._reqlog import read_requests as read_requests
from agentbox.gateway._usage import Usage, read_usage
from agentbox.gateway.registry import (
    DEFAULT_MODEL,
    DEMO_SCRIPT,
    ModelEntry,
    Registry,
    load_registry,
)

if TYPE_CHECKING:
    from agentbox.gateway._cli import gateway as _gateway_command
    from agentbox.gateway._forkspawn import adopt_channel as adopt_channel
    from agentbox.gateway._process import GatewayHandle, gateway_identity, spawn_gateway
    from agentbox.gateway._process import start_template as start_template
    from agentbox.gateway._run import run_replay as run_replay

    gateway_command = _gateway_command

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_MODEL",
    "DEMO_SCRIPT",
    "GatewayHandle",
    "ModelEntry",
    "Registry",
    "Usage",
    "gateway_identity",
    "load_registry",
    "read_usage",
    "spawn_gateway",
]

#: The default per-task token budget.
DEFAULT_BUDGET = 20_000_000


def __getattr__(name: str) -> Any:
    """``gateway_command`` (the ``agentbox gateway`` command) and ``run_replay``, on first use;
    ``start_template`` and ``adopt_channel`` (the front end's shared gateway template).

    For the CLI; not in ``__all__`` (the library surface), which stays as pinned.
    The spawning side (:mod:`._process`: subprocess, the settings model) is also
    imported on first use: the gateway process itself, which imports this package
    first, never spawns a gateway.
    """
    if name in ("GatewayHandle", "gateway_identity", "spawn_gateway"):
        from agentbox.gateway import _process

        return getattr(_process, name)
    if name == "start_template":  # for the front end's fork server
        from agentbox.gateway._process import start_template

        return start_template
    if name == "adopt_channel":  # for a command the front end forked
        from agentbox.gateway._forkspawn import adopt_channel

        return adopt_channel
    if name == "gateway_command":
        from agentbox.gateway._cli import gateway

        return gateway
    if name == "run_replay":
        from agentbox.gateway._run import run_replay

        return run_replay
    raise AttributeError(name)
