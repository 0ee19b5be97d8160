"""The verdict of ``host.uid_own_range`` from host pids (issue 33 §9): pure, this process's
own /proc entries stand in for sandboxes' processes."""

from __future__ import annotations

import os
import subprocess

from agentbox.escape._uidrange import SENTRY_UID, verdict


def test_one_process_on_both_sides_shares_its_uid_and_fires() -> None:
    me = os.getpid()
    out = verdict([me], [me])
    assert out.status == "fail" and f"shared [{os.getuid()}]" in out.seen


def test_the_shared_range_root_is_said_not_hidden_as_a_pass() -> None:
    me = os.getpid()
    out = verdict([me], [me], one_root=os.getuid())
    assert out.status == "n/a" and "one remap range" in out.seen


def test_no_readable_thread_is_an_error_never_a_pass() -> None:
    with subprocess.Popen(["true"]) as p:
        p.wait()
    assert verdict([p.pid], [os.getpid()]).status == "error"


def test_standard_isolation_vmms_are_not_applicable() -> None:
    out = verdict([os.getpid()], [os.getpid()], applies=False)
    assert out.status == "n/a" and "your uid by design" in out.seen


def test_the_sentry_uid_is_the_nobody_of_runsc() -> None:
    assert SENTRY_UID == 65534
