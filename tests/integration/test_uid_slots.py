"""A host uid range of its own per sandbox (issue 33 §9): the pool of uid slots.

Pure: slot records are files in a temporary data dir; concurrency is real processes.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from agentbox.backends import _uidslots as slots
from agentbox.backends.microvm._recover import vmm_uid
from agentbox.backends.oci._args import ImageFacts, run_args
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.errors import SandboxError
from agentbox.gateway import gateway_identity
from agentbox.sandbox import spec_from_boxfile

TINI = ImageFacts("img", "sha256:abc", ("/usr/bin/tini", "--"))


def _ranges(settings: Settings, slot: int) -> range:
    base = slots.slot_base(settings, slot)
    return range(base, base + slots.SLOT_IDS)


def test_slots_are_disjoint_from_each_other_range_zero_and_the_service_uids(
    settings: Settings,
) -> None:
    seen: set[int] = set()
    for k in range(settings.uid_slots):
        r = _ranges(settings, k)
        assert r.start not in seen and r.start >= settings.subid_base + 2 * slots.SLOT_IDS
        seen.add(r.start)
    first = _ranges(settings, 0)
    assert settings.subid_base + 64000 not in first  # range 0 (no slot, docker's remap)
    assert settings.subid_base + 65536 + 1 not in first  # a slot-less strict VMM
    assert settings.subid_base + 65536 + 2 not in first  # the gateways
    last = _ranges(settings, settings.uid_slots - 1)
    assert last.stop <= 2**32 - 1


def test_settings_for_a_slot_map_the_sandbox_into_it(settings: Settings) -> None:
    s3 = settings.for_slot(3)
    assert s3.sandbox_subid_base == slots.slot_base(settings, 3)
    assert s3.sandbox_host_uid == slots.slot_base(settings, 3) + settings.sandbox_uid
    assert settings.sandbox_host_uid == settings.subid_base + settings.sandbox_uid
    # What is not the sandbox's stays where it was: the gateway's uid, the pool base.
    assert s3.subid_base == settings.subid_base


def test_run_args_map_the_sandbox_onto_its_slot(settings: Settings, tmp_path: Path) -> None:
    spec = spec_from_boxfile(Boxfile(), settings)
    a = run_args(spec, settings.for_slot(0), TINI, detach=False, env_file=tmp_path / "e")
    b = run_args(spec, settings.for_slot(1), TINI, detach=False, env_file=tmp_path / "e")
    assert f"0:{slots.slot_base(settings, 0)}:65536" in a
    assert f"0:{slots.slot_base(settings, 1)}:65536" in b
    assert f"0:{settings.subid_base}:65536" not in a + b


def test_the_strict_vmm_runs_as_its_slots_uid(settings: Settings) -> None:
    one, two = vmm_uid(settings.for_slot(0), "strict"), vmm_uid(settings.for_slot(1), "strict")
    assert one != two
    assert one == settings.for_slot(0).sandbox_host_uid
    assert vmm_uid(settings, "strict") == settings.subid_base + 65536 + 1


def test_the_gateway_uid_lies_in_no_slot(settings: Settings) -> None:
    if os.geteuid() != 0:
        pytest.skip("gateway_identity is None unless root")
    ident = gateway_identity(settings.for_slot(0))
    assert ident is not None
    assert all(ident[0] not in _ranges(settings, k) for k in range(settings.uid_slots))


def test_claim_gives_distinct_slots_and_the_same_one_again_to_its_owner(
    settings: Settings,
) -> None:
    a = slots.claim(settings, "agentbox-task-a")
    b = slots.claim(settings, "agentbox-task-b")
    assert a != b
    assert slots.claim(settings, "agentbox-task-a") == a  # re-adoption keeps it
    assert slots.slot_of(settings, "agentbox-task-b") == b
    assert slots.held(settings)[a]["owner"] == "agentbox-task-a"
    assert (slots.slots_dir(settings).stat().st_mode & 0o777) == 0o700


def test_release_frees_the_slot_for_the_next_sandbox(settings: Settings) -> None:
    a = slots.claim(settings, "one")
    assert slots.release(settings, "one") == a
    assert slots.release(settings, "one") is None  # idempotent
    assert slots.slot_of(settings, "one") is None
    assert slots.claim(settings, "two") == a


def test_a_full_pool_refuses_with_the_fix(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path / "data", uid_slots=2)
    slots.claim(s, "x")
    slots.claim(s, "y")
    with pytest.raises(SandboxError, match="AGENTBOX_UID_SLOTS"):
        slots.claim(s, "z")


def test_transfer_hands_a_pooled_slot_to_the_task(settings: Settings) -> None:
    k = slots.claim(settings, "agentbox-pool-abc")
    assert slots.transfer(settings, "agentbox-pool-abc", "agentbox-task-t") == k
    assert slots.slot_of(settings, "agentbox-task-t") == k
    assert slots.slot_of(settings, "agentbox-pool-abc") is None


def _claim_in_child(data_dir: str, owner: str, q: multiprocessing.Queue[int]) -> None:
    q.put(slots.claim(Settings(data_dir=Path(data_dir)), owner))


def test_concurrent_claimers_never_share_a_slot(settings: Settings) -> None:
    ctx = multiprocessing.get_context("fork")
    q: multiprocessing.Queue[int] = ctx.Queue()
    procs = [
        ctx.Process(target=_claim_in_child, args=(str(settings.data_dir), f"s{i}", q))
        for i in range(12)
    ]
    for p in procs:
        p.start()
    got = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
    q.close()
    q.join_thread()
    assert sorted(got) == list(range(12))  # twelve claimers, twelve different slots
    assert {r["owner"] for r in slots.held(settings).values()} == {f"s{i}" for i in range(12)}


def test_reap_frees_only_dead_holders_of_gone_sandboxes(settings: Settings) -> None:
    ctx = multiprocessing.get_context("fork")
    q: multiprocessing.Queue[int] = ctx.Queue()
    for owner in ("gone", "still-running"):
        p = ctx.Process(target=_claim_in_child, args=(str(settings.data_dir), owner, q))
        p.start()
        q.get(timeout=60)
        p.join(60)
    q.close()
    q.join_thread()
    mine = slots.claim(settings, "held-by-a-live-process")
    freed = slots.reap(settings, live={"still-running"})
    assert len(freed) == 1
    assert slots.slot_of(settings, "gone") is None
    assert slots.slot_of(settings, "still-running") is not None  # a re-adopted sandbox
    assert slots.slot_of(settings, "held-by-a-live-process") == mine


def test_reown_moves_only_the_old_uids_entries_and_follows_no_link(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    top = tmp_path / "ws"
    (top / "d").mkdir(parents=True)
    (top / "d" / "f").write_text("x")
    (top / "other").write_text("y")
    outside = tmp_path / "outside"
    outside.write_text("z")
    (top / "link").symlink_to(outside)
    for p in (top, top / "d", top / "d" / "f", top / "link"):
        os.chown(p, 1000, 1000, follow_symlinks=False)
    os.chown(top / "other", 1234, 1234)
    os.chown(outside, 1000, 1000)
    slots.reown(top, 1000, 2000)
    for p in (top, top / "d", top / "d" / "f", top / "link"):
        assert p.lstat().st_uid == 2000 and p.lstat().st_gid == 2000
    assert (top / "other").stat().st_uid == 1234
    assert outside.stat().st_uid == 1000


def test_docker_gets_a_uid_of_its_own_inside_the_daemons_one_range(settings: Settings) -> None:
    from agentbox.backends import slot_settings
    from agentbox.errors import UnsupportedError

    d0, d3 = slot_settings("docker", settings, 0), slot_settings("docker", settings, 3)
    assert (d0.sandbox_uid, d3.sandbox_uid) == (64001, 64004)
    assert d3.sandbox_host_uid == settings.subid_base + 64004  # the remap range's id
    assert d3.uid_slot is None and d3.sandbox_subid_base == settings.subid_base
    assert settings.sandbox_host_uid not in (d0.sandbox_host_uid, d3.sandbox_host_uid)
    p3 = slot_settings("podman", settings, 3)
    assert p3.sandbox_host_uid == slots.slot_base(settings, 3) + 64000
    with pytest.raises(UnsupportedError, match="AGENTBOX_UID_SLOTS"):
        slot_settings("docker", settings, 65536 - 64001)
