"""What a task's gateway usage says about it: its tokens and cost, and the errors a
task ends with when the gateway refused for budget or the upstream has no such model."""

from __future__ import annotations

import contextlib
from typing import Any

from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.errors import AgentboxError
from agentbox.gateway import Usage, read_usage
from agentbox.launcher.api import TokenUsage


def task_tokens(paths: TaskPaths) -> tuple[TokenUsage, dict[str, Any]]:
    try:
        u = read_usage(paths.usage_file)
    except AgentboxError:
        return TokenUsage(), {}
    t = TokenUsage(input=u.input, output=u.output, cache_creation=u.cache_creation,
                   cache_read=u.cache_read, cost_usd=u.cost_usd)  # fmt: skip
    extra: dict[str, Any] = {"budget": u.budget, "budget_usd": u.budget_usd, "cost_usd": u.cost_usd,
             "weighted_total": u.weighted_total, "exhausted": u.exhausted,
             "requests": u.requests, "refusals": dict(u.refusals),
             "clamped": u.clamped}  # fmt: skip
    if u.upstream_errors or u.upstream_down:
        extra["upstream_errors"] = u.upstream_errors
        extra["upstream_error"] = u.upstream_error
        extra["upstream_down"] = u.upstream_down or None
    return t, extra


def model_fields(settings: Settings, model: str) -> dict[str, Any]:
    """The report's ``model_scripted`` and, for a scripted model, the line that says so."""
    from agentbox.gateway.registry import scripted_note

    note = scripted_note(model, settings)
    out: dict[str, Any] = {"model_scripted": note is not None}
    if note is not None:
        out["model_note"] = note.removeprefix("note: ")
    return out


def model_error(settings: Settings, usage: Usage) -> str | None:
    """The task's error when the upstream said it has no such model or retired it."""
    if not usage.model_error:
        return None
    from agentbox.gateway.registry import load_registry

    upstream = "?"
    with contextlib.suppress(AgentboxError):
        upstream = load_registry(settings).get(usage.model).target_model
    return (
        f"the upstream does not serve model {upstream!r} of registry entry "
        f"{usage.model!r} (it answered: {usage.model_error}); update the registry "
        f"(agentbox models; docs/reference/models.md)"
    )


def upstream_down(paths: TaskPaths) -> str | None:
    """The task's error when its gateway gave up on the model's upstream (failures in a
    row, :data:`agentbox.gateway._forward.UPSTREAM_DOWN_AFTER`), else None."""
    try:
        down = read_usage(paths.usage_file).upstream_down
    except AgentboxError:
        return None
    return f"the model's upstream is down: {down}" if down else None


def budget_error(usage: Usage) -> str | None:
    """The task's error when the gateway refused for budget ("budget exhausted after N of M
    tokens"), else None."""
    refused = sum(usage.refusals.get(k, 0) for k in ("budget_exhausted", "over_budget"))
    if not usage.exhausted and not refused:
        return None
    if (
        usage.budget_usd is not None
        and usage.cost_usd is not None
        and usage.weighted_total < usage.budget
    ):
        from agentbox.gateway import format_usd

        return (
            f"dollar budget exhausted after {format_usd(usage.cost_usd)} of "
            f"{format_usd(usage.budget_usd)} (the gateway refused {refused} request(s) for "
            f"budget)"
        )
    return (
        f"budget exhausted after {usage.weighted_total:,.0f} of {usage.budget:,} tokens "
        f"(the gateway refused {refused} request(s) for budget)"
    )
