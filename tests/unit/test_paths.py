"""Task ids and derived paths: clients name tasks, never paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.core.paths import TaskPaths, check_inside, new_task_id, validate_task_id
from agentbox.errors import PathRefused, TaskIdRefused


@pytest.mark.parametrize("good", ["a", "t-1", "0" * 64, "fix-flaky-test-42"])
def test_good_ids(good: str) -> None:
    assert validate_task_id(good) == good


@pytest.mark.parametrize(
    "bad",
    ["", "..", "a/b", "../x", "Upper", "a" * 65, "a b", "a\n", "ä", "a_b", "a.b", None, 5, b"ab"],
)
def test_bad_ids_refused(bad: object) -> None:
    with pytest.raises(TaskIdRefused):
        validate_task_id(bad)


def test_new_ids_are_valid_and_distinct() -> None:
    ids = {new_task_id() for _ in range(100)}
    assert len(ids) == 100
    for i in ids:
        validate_task_id(i)


def test_task_paths_live_inside_the_data_dir(tmp_path: Path) -> None:
    p = TaskPaths(tmp_path, "t-1")
    for path in (p.workspace, p.gateway_socket, p.shadow_git, p.usage_file, p.report_file):
        assert tmp_path.resolve() in path.parents


def test_task_paths_refuse_bad_id(tmp_path: Path) -> None:
    with pytest.raises(TaskIdRefused):
        TaskPaths(tmp_path, "../etc")


def test_task_dir_symlinked_out_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "tasks").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (data / "tasks" / "t-evil").symlink_to(outside)
    with pytest.raises(PathRefused):
        _ = TaskPaths(data, "t-evil").workspace


def test_check_inside(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "in").mkdir()
    assert check_inside(tmp_path / "root", tmp_path / "root" / "in") == (tmp_path / "root/in")
    with pytest.raises(PathRefused):
        check_inside(tmp_path / "root", tmp_path / "root" / ".." / "x")
    (tmp_path / "root" / "link").symlink_to("/etc")
    with pytest.raises(PathRefused):
        check_inside(tmp_path / "root", tmp_path / "root" / "link")
