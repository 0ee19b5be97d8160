"""A hostile result (many small files) is collected in bounded time and memory, and the
report says the real totals (issue 33 §7: 200,000 files kept a root ``agentbox run``
busy for 6 minutes after the agent exited and ``diff --stat`` said "1 file(s) changed").

A smaller but still hostile count with smaller caps: the same code paths.
"""

from __future__ import annotations

from pathlib import Path

from test_collect_support import make_repo, prepare_in

from agentbox.collect import Limits, Report, collect


def _flood(ws: Path, n: int) -> None:
    for d in range(0, n, 500):
        sub = ws / f"flood{d // 500:03}"
        sub.mkdir()
        for i in range(min(500, n - d)):
            (sub / f"f{i:03}.txt").write_text(f"line {d + i}\n")


def test_a_flood_of_files_is_capped_counted_and_said(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"README.md": "hi\n"})
    p = prepare_in(tmp_path / "task", repo)
    _flood(p.ws, 2000)
    limits = Limits(max_changed_files=500, max_skip_notes=20, max_diff_bytes=4096)
    got = collect(p.ws, p.shadow, p.index, p.base, task_id="t-1", message="m", limits=limits)
    assert got.files_read == 500
    capped = [s for s in got.skipped if "over the cap of 500 changed files" in s.reason]
    assert len(capped) == 21  # 20 listed, then one line with the count of the rest
    assert capped[-1].path == "(1480 more paths)"
    # The diff is cut (git stopped at the cap) but the totals are the whole commit's.
    assert got.diff_truncated and len(got.diff) < 8192
    assert got.diffstat.files_changed == 500 and got.diffstat.insertions == 500
    report = Report(task_id="t-1", status="done")
    report.add_collected(got)
    text = report.to_text()
    assert "500 file(s) changed" in text and "1480 more paths" in text


def test_collection_has_a_time_limit_of_its_own(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"README.md": "hi\n"})
    p = prepare_in(tmp_path / "task", repo)
    _flood(p.ws, 600)
    (p.ws / "README.md").write_text("changed\n")
    limits = Limits(max_seconds=1e-9, max_skip_notes=5)
    got = collect(p.ws, p.shadow, p.index, p.base, task_id="t-1", message="m", limits=limits)
    assert got.files_read == 0 and not got.changed  # nothing stored past the limit
    late = [s for s in got.skipped if "time limit" in s.reason]
    assert late[-1].path == "(596 more paths)"  # 601 changed files: 5 listed, 596 counted
