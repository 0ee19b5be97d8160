"""Best-of-N from the CLI: ``run --attempts N``, ``show GROUP``, ``publish GROUP --pick K``.

``run --attempts N`` (N 1..8) queues one group of N attempts in an in-process
launcher (:meth:`agentbox.launcher.Launcher.submit_group`: ids ``<group>-a1`` …,
each its own sandbox, gateway and branch ``agentbox/<group>-aK``, the budget split
``budget // N`` each or, ``--budget-split shared``, drawn by all from one ledger),
runs them at once, waits for all, scores them (:mod:`agentbox.launcher.attempts`)
and publishes the pick as ``agentbox/<group>``.
Ctrl-C cancels every attempt (their partial results are still collected).
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from agentbox.boxfile import Boxfile
from agentbox.launcher.api import TaskRequest
from agentbox.launcher.attempts import AttemptScore, GroupView


def run_group(
    req: TaskRequest,
    box: Boxfile | None,
    *,
    attempts: int,
    pick_by: str,
    as_json: bool,
    overrides: dict[str, str] | None = None,
    budget_split: str = "split",
) -> None:
    """Run ``attempts`` attempts of ``req`` in the foreground; print the group; exit 0 when
    an attempt was picked, 1 when none qualified. ``budget_split``: ``split`` (each
    attempt ``budget // N``) or ``shared`` (one budget for all, never passed in total)."""
    from agentbox.cli._client import in_process
    from agentbox.cli._view import err, safe
    from agentbox.cli.reap import exit_on_signals

    launcher = in_process(max(1, attempts))
    with exit_on_signals():
        try:
            infos = launcher.submit_group(req, attempts, boxfile=box, overrides=overrides,
                                          budget_split=budget_split)  # fmt: skip
            group = infos[0].group
            assert group is not None
            if not as_json:
                err.print(safe(f"group {group}: {attempts} attempt(s) "
                               f"{', '.join(i.id for i in infos)}"))  # fmt: skip
            try:
                for info in infos:
                    launcher.wait(info.id)
            except KeyboardInterrupt:
                err.print(safe("cancelling every attempt; collecting the partial results…"))
                for info in infos:
                    launcher.cancel(info.id)
                for info in infos:
                    launcher.wait(info.id)
            view = launcher.group_view(group, by=pick_by)
            if view.pick is not None and req.publish:
                launcher.publish_pick(group, view.pick)
                view = launcher.group_view(group, by=pick_by)
        finally:
            launcher.close()
    print_group(view, as_json=as_json)
    raise typer.Exit(0 if view.pick is not None else 1)


def publish_group(group: str, k: int | None, *, pick_by: str, as_json: bool) -> None:
    """``publish GROUP [--pick K]``: attempt ``K`` (default: the group's pick) as
    ``agentbox/<group>``."""
    from agentbox.cli._client import in_process
    from agentbox.cli._view import console, safe

    launcher = in_process(1)
    try:
        view = launcher.group_view(group, by=pick_by)
        chosen = k if k is not None else view.pick
        if chosen is None:
            raise typer.BadParameter(
                f"no attempt of {group} qualifies by {pick_by!r} (none ended done with its "
                "tests passing): choose one with --pick K",
                param_hint="--pick",
            )
        if not 1 <= chosen <= len(view.attempts):
            raise typer.BadParameter(f"{group} has attempts 1..{len(view.attempts)}")
        info = launcher.publish_pick(group, chosen)
    finally:
        launcher.close()
    if as_json:
        from agentbox.cli._view import dump

        dump({"group": group, "pick": chosen, "id": info.id, "branch": info.branch})
        return
    console.print(safe(f"published {info.branch} (attempt {chosen}, {info.id}) in {info.repo}"))


def _tests(s: AttemptScore) -> str:
    if s.tests_passed is None:
        return "-"
    return f"{'pass' if s.tests_passed else 'FAIL'} ({s.test_exit})"


def print_group(view: GroupView, *, as_json: bool) -> None:
    """The comparison table (or the group as JSON)."""
    if as_json:
        from agentbox.cli._view import dump

        dump(view.model_dump(mode="json"))
        return
    from agentbox.cli._table import Col, fit_table, print_table
    from agentbox.cli._view import console, safe

    cols = [Col("#", keep=True), Col("id", keep=True), Col("status", keep=True),
            Col("tests", keep=True), Col("diff"), Col("files"), Col("flagged"),
            Col("tokens"), Col("cost"), Col("time"), Col("branch")]  # fmt: skip
    rows: list[list[Any]] = []
    for s in view.attempts:
        mark = "*" if s.attempt == view.pick else ""
        rows.append([
            safe(f"{s.attempt}{mark}"), safe(s.id), safe(s.status), safe(_tests(s)),
            safe(f"{s.diff_lines}"), safe(f"{s.files_changed}"), safe(f"{s.flagged}"),
            safe(f"{s.tokens.total:,}"),
            safe("-" if s.cost_usd is None else f"${s.cost_usd:.4f}"),
            safe("-" if s.duration_s is None else f"{s.duration_s:.1f}s"),
            safe(s.branch or "-"),
        ])  # fmt: skip
    print_table(console, fit_table(console, cols, rows))
    if view.pick is None:
        how = f"agentbox publish {view.group} --pick K"
        line = f"no pick by {view.pick_by!r}: publish one with `{how}`"
    else:
        where = view.branch or "not published"
        line = f"pick: attempt {view.pick} ({view.pick_id}) by {view.pick_by!r} -> {where}"
    console.print(safe(line))
    if view.budget_split == "shared":
        spent = "-" if view.group_spent is None else f"{view.group_spent:,.0f}"
        console.print(safe(f"budget shared by the attempts: {spent} weighted tokens spent"))
    sys.stdout.flush()
