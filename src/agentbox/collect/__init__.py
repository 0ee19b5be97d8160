"""Result collection: a trusted shadow git dir, never the agent's ``.git``.

::

    base = prepare(repo, workspace, shadow_git, base_index,
                   commit="HEAD", include_uncommitted=False, owner=None)  # -> Base
    # ... the agent runs in workspace, then its sandbox is stopped ...
    got = collect(workspace, shadow_git, base_index, base,
                  task_id="t-1", message="Fix the flaky test")         # -> Collected
    if got.changed:  # no changes: no commit, no branch, nothing to publish
        branch = publish(shadow_git, repo, task_id="t-1", commit=got.commit)  # "agentbox/t-1"
    report = Report(task_id="t-1", status="done"); report.add_collected(got)

See docs/explanation/result-collection.md for the threat model and decisions.
"""

from agentbox.collect._apply import apply_result
from agentbox.collect._collect import branch_name, collect
from agentbox.collect._git import RepoDir, as_owner, repo_owner, user_git
from agentbox.collect._model import Base, Collected, DiffStat, Limits, Skipped
from agentbox.collect._prepare import prepare, prepare_unsettled
from agentbox.collect._publish import publish
from agentbox.collect._risky import risky_reason
from agentbox.collect.report import Report, Tokens

__all__ = [
    "Base",
    "Collected",
    "DiffStat",
    "Limits",
    "RepoDir",
    "Report",
    "Skipped",
    "Tokens",
    "apply_result",
    "as_owner",
    "branch_name",
    "collect",
    "prepare",
    "prepare_unsettled",
    "publish",
    "repo_owner",
    "risky_reason",
    "user_git",
]
