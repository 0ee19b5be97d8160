"""What a gateway template gives a fork request's ``posture``: no more than its own.

The values come from the requester's process (a command the front end forked, which
took on its caller's), but whoever holds a channel may send anything: each bound is
checked here against a template posture made up for the test, and the mount namespace
a request attaches must be one (``ioctl_ns``).
"""

from __future__ import annotations

import copy
import os
import resource
from typing import Any

import pytest

from agentbox.gateway._template import LIMITS, Posture, _mount_ns, own_posture, parse_posture

INF = resource.RLIM_INFINITY


def _own() -> Posture:
    limits = {int(r): (1024, 4096) for r in LIMITS}
    limits[int(resource.RLIMIT_CORE)] = (0, INF)
    return Posture(nice=2, affinity=frozenset({0, 1}), oom_score_adj=100, limits=limits,
                   umask=0o022)  # fmt: skip


def _request() -> dict[str, Any]:
    return {
        "nice": 5,
        "affinity": [1],
        "oom_score_adj": 300,
        "limits": {str(r): [512, 2048] for r in LIMITS} | {str(int(resource.RLIMIT_CORE)): [0, 0]},
        "umask": 0o027,
    }


def test_a_request_within_the_templates_own_is_taken() -> None:
    got = parse_posture(_request(), _own())
    assert got.nice == 5 and got.affinity == {1} and got.oom_score_adj == 300
    assert got.umask == 0o027
    assert got.limits[int(resource.RLIMIT_NOFILE)] == (512, 2048)
    # Infinity is the largest: an unlimited soft and hard under an unlimited hard.
    req = _request()
    req["limits"][str(int(resource.RLIMIT_CORE))] = [INF, INF]
    assert parse_posture(req, _own()).limits[int(resource.RLIMIT_CORE)] == (INF, INF)


def test_own_posture_is_taken_by_a_template_of_the_same() -> None:
    mine = own_posture()
    assert parse_posture(copy.deepcopy(mine), Posture.of(mine)) == Posture.of(mine)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("nice", 1),  # a higher priority than the template's
        ("nice", -20),
        ("nice", 20),
        ("nice", True),  # a bool is no nice value
        ("nice", 5.0),
        ("nice", "5"),
        ("oom_score_adj", 99),  # less likely to be killed than the template
        ("oom_score_adj", -1000),
        ("oom_score_adj", 1001),
        ("affinity", [2]),  # a CPU the template may not run on
        ("affinity", []),
        ("affinity", [0, "1"]),
        ("affinity", list(range(1 << 17))),
        ("umask", 0o1777),
        ("umask", -1),
        ("limits", {}),
    ],
)
def test_more_than_the_templates_own_is_refused(key: str, value: object) -> None:
    req = _request()
    req[key] = value
    with pytest.raises(ValueError, match="posture"):
        parse_posture(req, _own())


@pytest.mark.parametrize(
    "pair",
    [
        [512, 8192],  # a hard limit above the template's
        [512, INF],
        [INF, 2048],  # soft above hard
        [4096, 2048],
        [-2, 2048],
        [512, 1 << 64],
        [512],
        "512 2048",
        [512, None],
    ],
)
def test_a_limit_above_the_templates_hard_limit_is_refused(pair: object) -> None:
    req = _request()
    req["limits"][str(int(resource.RLIMIT_NOFILE))] = pair
    with pytest.raises(ValueError, match="posture"):
        parse_posture(req, _own())


def test_every_limit_named_and_no_other() -> None:
    req = _request()
    del req["limits"][str(int(resource.RLIMIT_STACK))]
    with pytest.raises(ValueError, match="every resource limit"):
        parse_posture(req, _own())
    req = _request()
    req["limits"]["9999"] = [0, 0]
    with pytest.raises(ValueError, match="every resource limit"):
        parse_posture(req, _own())
    req = _request()
    req["extra"] = 1
    with pytest.raises(ValueError, match="posture: not a map"):
        parse_posture(req, _own())
    with pytest.raises(ValueError, match="posture: not a map"):
        parse_posture(None, _own())


def test_the_mount_namespace_sent_must_be_one() -> None:
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match="no namespace"):
            _mount_ns(r)
    finally:
        os.close(r)
        os.close(w)
    fd = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="not a mount namespace"):
            _mount_ns(fd)
    finally:
        os.close(fd)
    fd = os.open("/proc/self/ns/mnt", os.O_RDONLY)
    try:
        assert _mount_ns(fd) is None  # this process's own: nothing to join
    finally:
        os.close(fd)
