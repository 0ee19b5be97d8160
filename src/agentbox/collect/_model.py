"""Value objects of result collection: the base, the limits, what was collected."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Base(BaseModel):
    """The trusted starting point of a task, recorded by :func:`prepare`.

    ``base_commit`` is the parent of the result commit: the user's commit, or
    (with uncommitted changes included) a commit of ours on top of it that
    holds them. Serialisable (``model_dump_json``) so the launcher can store it.
    """

    model_config = ConfigDict(frozen=True)

    base_commit: str
    tree: str
    head_commit: str
    object_format: str = "sha1"
    include_uncommitted: bool = False
    untracked_not_copied: int = 0
    """Untracked files (not ignored) of the repo left out of the workspace: without
    ``include_uncommitted`` only committed files are copied."""
    untracked_sample: tuple[str, ...] = ()
    """The first few of them, as paths relative to the repo."""

    @property
    def untracked_note(self) -> str | None:
        """``2 untracked files not copied: pass --include-uncommitted``, or None."""
        n = self.untracked_not_copied
        if not n:
            return None
        return (
            f"{n} untracked file{'s' if n != 1 else ''} not copied "
            f"({', '.join(self.untracked_sample[:3])}{' …' if n > 3 else ''}): "
            "pass --include-uncommitted (MCP: include_uncommitted=true) to copy them"
        )


class Limits(BaseModel):
    """Caps on what collection reads and returns."""

    model_config = ConfigDict(frozen=True)

    max_file_size: int = Field(default=50 << 20, gt=0)
    """A changed file larger than this is skipped (reported)."""
    max_total_size: int = Field(default=500 << 20, gt=0)
    """New content read beyond this total is skipped (reported)."""
    max_files: int = Field(default=500_000, gt=0)
    """Entries walked beyond this stop the walk (reported; unseen base files are kept)."""
    max_diff_bytes: int = Field(default=1 << 20, gt=0)
    """The unified diff returned is cut here, with a truncation note (git is stopped there:
    the rest of the patch is never made)."""
    max_changed_files: int = Field(default=100_000, gt=0)
    """Changed or new files stored beyond this are not collected (one note says how many;
    modified ones keep their base version)."""
    max_seconds: float = Field(default=600.0, gt=0)
    """Collection's own time limit (the task's deadline ends at the agent's exit): files
    not yet stored when it passes are not collected (one note says how many)."""
    max_skip_notes: int = Field(default=200, gt=0)
    """Skipped paths listed one by one per reason; the rest of a reason are counted in one."""


class Skipped(BaseModel):
    """One path that was not collected as the agent left it, and why."""

    # Built on first use (defer_build): a plain ``agentbox run`` never uses it.
    model_config = ConfigDict(defer_build=True, frozen=True)

    path: str
    reason: str


class DiffStat(BaseModel):
    """Files changed, lines inserted and deleted between the base and the result."""

    model_config = ConfigDict(frozen=True)

    files_changed: int = 0
    insertions: int = 0
    deletions: int = 0

    def __str__(self) -> str:
        return (
            f"{self.files_changed} file(s) changed, "
            f"{self.insertions} insertion(s)(+), {self.deletions} deletion(s)(-)"
        )


class Collected(BaseModel):
    """What :func:`collect` produced in the shadow dir.

    ``changed`` False means **no changes**: the agent left the base tree as it was;
    then ``commit`` and ``branch`` are empty, the diff is empty and there is
    nothing to publish.
    """

    model_config = ConfigDict(frozen=True)

    commit: str
    """The result commit ("" when nothing changed)."""
    branch: str
    """``agentbox/<task-id>`` in the shadow dir ("" when nothing changed)."""
    base_commit: str
    tree: str
    """The tree the workspace holds (the base's own tree when nothing changed)."""
    changed: bool
    diffstat: DiffStat
    diff: str
    diff_truncated: bool = False
    skipped: list[Skipped] = Field(default_factory=list)
    notes: list[Skipped] = Field(default_factory=list)
    """Paths collected with a change of ours (setuid dropped, hard links)."""
    files_seen: int = 0
    files_ignored: int = 0
    """New files left out because the workspace's ``.gitignore`` ignores them."""
    files_read: int = 0
    bytes_read: int = 0
