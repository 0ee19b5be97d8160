"""``agentbox node …`` and ``agentbox batch …``: scale out on a Ray cluster (``agentbox[ray]``).

* ``agentbox node keygen`` makes the cluster's secrets (Ray's token, the cluster key)
  in ``/etc/agentbox/cluster/``, root-only; copy them to every node and driver host.
* ``agentbox node start --address RAY_ADDR [--slots N]`` (or ``--head``) checks this
  host (podman, runtime, Claude Code, image: the doctor's probes; the secrets; the
  launcher's socket), runs ``ray start`` as the unprivileged user ``agentbox-node``
  with token authentication, advertising ``agentbox_slot: N``, and starts this host's
  node actor (a client of the host's root launcher, over its socket).
* ``agentbox node list`` shows the node actors, their slots and what runs on them.
* ``agentbox batch run tasks.jsonl`` runs a batch (a live table per node; ``--json``:
  one event per line), ``--batch ID`` resumes one; ``batch status|cancel BATCH``.
"""

from __future__ import annotations

import contextlib
import json
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

import typer
from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from agentbox.cli._table import Col, fit_table, print_table
from agentbox.config import load_settings
from agentbox.core.console import console as make_console
from agentbox.errors import ConfigError

_out = make_console()
_err = make_console(stderr=True)

node_app = typer.Typer(
    help="Join this host to a Ray cluster as an agentbox node.", no_args_is_help=True
)
batch_app = typer.Typer(help="Run batches of tasks on a Ray cluster.", no_args_is_help=True)


def _state_dir(given: str | None) -> Path:
    return Path(given) if given is not None else load_settings().data_dir / "batches"


def _cluster() -> Any:
    """agentbox.cluster with its Ray parts usable, or UnsupportedError saying how."""
    import agentbox.cluster as cluster

    cluster.RayExecutor  # noqa: B018 (imports Ray, or raises UnsupportedError with the fix)
    return cluster


@node_app.command("start")
def node_start(
    address: str | None = typer.Option(
        None, "--address", help="The Ray cluster to join (the head's host:port)."
    ),
    head: bool = typer.Option(False, "--head", help="Start the cluster's head on this host."),
    port: int = typer.Option(6379, "--port", help="With --head: the head's port."),
    slots: int = typer.Option(2, "--slots", min=1, max=256, help="Tasks this host runs at once."),
    name: str | None = typer.Option(None, "--name", help="The node's name (default host-id)."),
    ray_arg: list[str] | None = typer.Option(  # noqa: B008 (typer's idiom)
        None, "--ray-arg", help="An extra `ray start` argument (repeat), e.g. --num-cpus=4."
    ),
) -> None:
    """Check this host, run Ray here as the unprivileged node user (token auth on), and
    start its node actor."""
    if head == bool(address):
        raise ConfigError("give either --address HEAD:6379 (join) or --head (start the head)")
    _cluster()
    from agentbox.cluster import join

    got_name, where = join(
        load_settings(),
        slots=slots,
        name=name,
        address=address,
        head_port=port if head else None,
        ray_args=list(ray_arg or ()),
    )
    _out.print(
        Text(f"node {got_name} joined {where} with {slots} slots (Ray runs as agentbox-node)")
    )


@node_app.command("stop")
def node_stop() -> None:
    """Stop this host's Ray node (every Ray process of the node user)."""
    from agentbox.cluster import leave

    leave()
    _out.print(Text("this host's Ray node stopped"))


@node_app.command("keygen")
def node_keygen() -> None:
    """Make the cluster's secrets (Ray token, cluster key) in /etc/agentbox/cluster/ unless
    they exist; copy that directory (root-only) to every node and driver host."""
    from agentbox.cluster import keygen

    where = keygen()
    _out.print(Text(f"cluster secrets in {where} (0700, files 0600): copy them to every node "
                    "and driver host, e.g. `scp -rp` as root"))  # fmt: skip


@node_app.command("list")
def node_list(
    address: str | None = typer.Option(None, "--address", help="The Ray cluster."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """The node actors of the cluster: slots and the attempts running on each."""
    cluster = _cluster()
    cluster.connect(address)
    nodes = cluster.RayExecutor().nodes()
    if as_json:
        print(json.dumps({"nodes": nodes}))
        return
    rows: list[list[RenderableType]] = [
        [Text(str(n["node"])), Text(str(n["slots"])), Text(" ".join(n["active"]) or "-")]
        for n in nodes
    ]
    cols = [Col("node", keep=True), Col("slots", keep=True), Col("running", ratio=1)]
    print_table(_out, fit_table(_out, cols, rows))


_COUNTS = ("running", "done", "failed", "lost", "skipped", "tokens")


class Tally:
    """Counts per node for the live display: queued, running, done, failed, tokens."""

    def __init__(self) -> None:
        self.queued = 0
        self.nodes: dict[str, Counter[str]] = {}
        self.where: dict[str, str] = {}
        self.lost = 0

    def add(self, ev: Any) -> None:
        if ev.event == "batch":
            self.queued = int(ev.detail.split()[0]) if ev.detail else 0
        elif ev.event == "placed" and ev.node and self.where.get(ev.attempt_id) != ev.node:
            if ev.attempt_id not in self.where:
                self.queued -= 1
            self.where[ev.attempt_id] = ev.node
            self.nodes.setdefault(ev.node, Counter())["running"] += 1
        elif ev.event == "placed" and ev.attempt_id not in self.where:
            self.where[ev.attempt_id] = ""
            self.queued -= 1
        elif ev.event in ("finished", "lost"):
            node = ev.node or self.where.get(ev.attempt_id, "") or "?"
            c = self.nodes.setdefault(node, Counter())
            if self.where.get(ev.attempt_id):
                c["running"] -= 1
            if ev.event == "lost":
                self.lost += 1
                self.queued += 1
                c["lost"] += 1
            else:
                c["done" if ev.status == "done" else "failed"] += 1
                c["tokens"] += ev.tokens
        elif ev.event == "skipped":
            self.queued -= 1
            self.nodes.setdefault("(not placed)", Counter())["skipped"] += 1

    def table(self, console: Console) -> RenderableType:
        cols = [
            Col(h, keep=True)
            for h in ("node", "running", "done", "failed", "lost", "skipped", "tokens")
        ]
        rows: list[list[RenderableType]] = [
            [Text(n), *(Text(str(c[k])) for k in _COUNTS)] for n, c in sorted(self.nodes.items())
        ]
        queued: list[RenderableType] = [Text("queued", style="dim"), Text(str(max(self.queued, 0)))]
        rows.append(queued + [Text("")] * 5)
        return fit_table(console, cols, rows)


@batch_app.command("run")
def batch_run(
    tasks: str = typer.Argument(..., help="tasks.jsonl: one {repo, task, …} per line."),
    address: str | None = typer.Option(None, "--address", help="The Ray cluster."),
    batch_id: str | None = typer.Option(None, "--batch", help="Resume (or name) this batch."),
    max_in_flight: int | None = typer.Option(None, "--max-in-flight", min=1),
    model: str | None = typer.Option(None, "--model", help="Model name (each node's registry)."),
    budget: int | None = typer.Option(None, "--budget", min=1, help="The batch's token budget."),
    budget_usd: float | None = typer.Option(
        None, "--budget-usd", min=0.0001, help="Each task's dollar budget (priced models only)."
    ),
    task_budget: int | None = typer.Option(None, "--task-budget", min=1),
    deadline: float | None = typer.Option(None, "--deadline", help="Seconds, per task."),
    boxfile: str | None = typer.Option(None, "--boxfile", help="A Boxfile (TOML) for all tasks."),
    state_dir: str | None = typer.Option(None, "--state-dir", help="Where batch state lives."),
    as_json: bool = typer.Option(False, "--json", help="One JSON event per line."),
    pr: bool = typer.Option(
        False, "--pr", help="Push each result to its repo's remote and open a pull request."
    ),
    draft: bool = typer.Option(False, "--draft", help="With --pr: draft pull requests."),
    remote: str = typer.Option("origin", "--remote", help="With --pr: the remote to push to."),
) -> None:
    """Run every task of TASKS on the cluster; each result lands as agentbox/<id> in its repo
    (with --pr: pushed to the repo's remote, with a pull request)."""
    if draft and not pr:
        raise typer.BadParameter("--draft goes with --pr")
    cluster = _cluster()
    box: dict[str, Any] | None = None
    if boxfile is not None:
        try:
            box = tomllib.loads(Path(boxfile).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read the Boxfile {boxfile}: {exc}") from exc
    if budget_usd is not None:
        # Each task's gateway keeps it (Boxfile budget_usd); a node refuses it for a model
        # without prices, as `agentbox run --budget-usd` does.
        box = {**(box or {}), "budget_usd": budget_usd}
    batch_id = batch_id or cluster.new_batch_id()
    cluster.connect(address)
    tally = Tally()
    kw: dict[str, Any] = {
        "executor": cluster.RayExecutor(),
        "state_dir": _state_dir(state_dir),
        "batch_id": batch_id,
        "model": model,
        "budget": budget,
        "task_budget": task_budget,
        "deadline": deadline,
        "boxfile": box,
        "max_in_flight": max_in_flight,
        "pr": pr,
        "draft": draft,
        "remote": remote,
    }
    exists = (cluster.batch_dir(kw["state_dir"], batch_id) / "batch.db").is_file()
    task_list = None if exists else list(cluster.read_tasks(Path(tasks)))
    results = []
    if as_json:
        kw["on_event"] = lambda ev: print(ev.model_dump_json(), flush=True)
        results = list(cluster.run_batch(task_list, **kw))
    else:
        _err.print(Text(f"batch {batch_id}" + (" (resumed)" if exists else "")))
        from agentbox.gateway.registry import load_registry, scripted_note

        with contextlib.suppress(ConfigError):  # the nodes' registries decide; this one hints
            settings = load_settings()
            note = scripted_note(model or load_registry(settings).default, settings)
            if note is not None:
                _err.print(Text(note), soft_wrap=True)
        with Live(tally.table(_err), console=_err, refresh_per_second=4) as live:

            def show(ev: Any) -> None:
                tally.add(ev)
                live.update(tally.table(_err))

            kw["on_event"] = show
            results = list(cluster.run_batch(task_list, **kw))
        for r in results:
            line = f"{r.key}\t{r.status}\t{r.branch or '-'}\t{_pick(r)}{r.error[:200]}"
            _out.print(Text(line.rstrip()), highlight=False, soft_wrap=True)
    if any(r.status != "done" for r in results):
        raise typer.Exit(1)


def _pick(r: Any) -> str:
    """A best-of-N line's group: ``pick K of N (id status tests, …)`` and a tab; "" else."""
    if not r.group:
        return ""
    words = {None: "-", True: "pass", False: "FAIL"}
    rows = [f"{a.get('id')} {a.get('status')} {words.get(a.get('tests_passed'), '-')}"
            for a in r.group.get("attempts", [])]  # fmt: skip
    head = f"pick {r.pick}" if r.pick else "no pick"
    return f"{head} of {len(rows)} ({', '.join(rows)})\t"


@batch_app.command("status")
def batch_status(
    batch_id: str = typer.Argument(..., help="The batch id."),
    state_dir: str | None = typer.Option(None, "--state-dir", help="Where batch state lives."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Where every task of a batch stands (read from its state file; Ray not needed)."""
    from agentbox.cluster import BatchState, batch_dir
    from agentbox.gateway import format_usd

    path = batch_dir(_state_dir(state_dir), batch_id) / "batch.db"
    if not path.is_file():
        raise ConfigError(f"no batch {batch_id} in {path.parent.parent}")
    st = BatchState(path)
    try:
        meta, rows = st.batch(), st.tasks()
        committed = st.committed()
    finally:
        st.close()
    if as_json:
        costs = [r.cost_usd for r in rows if r.status]
        out = {
            **meta,
            "committed_tokens": committed,
            # Dollars of the finished tasks; null when any of them has no price.
            "cost_usd_total": None if None in costs else sum(c or 0.0 for c in costs),
            "tasks": [
                {
                    "key": r.key,
                    "state": r.state,
                    "status": r.status,
                    "attempt_id": r.attempt_id,
                    "node": r.node,
                    "branch": r.branch,
                    "tokens": r.tokens,
                    "cost_usd": r.cost_usd,
                    "lost": list(r.lost),
                    "error": r.error,
                }
                for r in rows
            ],
        }
        print(json.dumps(out))
        return
    cols = [
        Col("key", keep=True),
        Col("state", keep=True),
        Col("status", keep=True),
        Col("node"),
        Col("tokens"),
        Col("cost"),
        Col("branch"),
        Col("error", ratio=1),
    ]
    cells: list[list[RenderableType]] = [
        [
            Text(r.key),
            Text(r.state),
            Text(r.status or "-"),
            Text(r.node or "-"),
            Text(str(r.tokens)),
            Text(format_usd(r.cost_usd) if r.status else "-"),
            Text(r.branch or "-"),
            Text(r.error[:300]),
        ]
        for r in rows
    ]
    print_table(_out, fit_table(_out, cols, cells))
    cap = f" of {meta['budget']}" if meta["budget"] else ""
    costs = [r.cost_usd for r in rows if r.status]
    known = sum(c for c in costs if c is not None)
    unknown = sum(1 for c in costs if c is None)
    cost = f"; cost {format_usd(known)}"
    if unknown:
        cost += f" ({unknown} task(s) price unknown)"
    _out.print(
        Text(
            f"tokens committed: {committed}{cap}{cost if costs else ''}"
            + ("; cancel requested" if meta["cancel_requested"] else "")
        )
    )


@batch_app.command("cancel")
def batch_cancel(
    batch_id: str = typer.Argument(..., help="The batch id."),
    state_dir: str | None = typer.Option(None, "--state-dir", help="Where batch state lives."),
) -> None:
    """Ask the driver running BATCH to stop: queued tasks are skipped, running ones cancelled."""
    from agentbox.cluster import BatchState, batch_dir

    path = batch_dir(_state_dir(state_dir), batch_id) / "batch.db"
    if not path.is_file():
        raise ConfigError(f"no batch {batch_id} in {path.parent.parent}")
    st = BatchState(path)
    try:
        st.request_cancel()
    finally:
        st.close()
    _out.print(Text(f"batch {batch_id}: cancel requested"))


def register(app: typer.Typer) -> None:
    """Add ``agentbox node`` and ``agentbox batch`` to the CLI."""
    app.add_typer(node_app, name="node")
    app.add_typer(batch_app, name="batch")
