"""The secret store (set/ls/rm/resolve, shared, ownership, permissions) and ``${secret:}``
references, on a store in a tmp dir."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.errors import InvalidValue, SecretNotFound, SecretStoreError
from agentbox.secrets import (
    PLACEHOLDER,
    SecretStore,
    expand,
    find_refs,
    resolve_for_task,
)

ALICE, BOB = 1001, 1002
VALUE = "s3cr3t-value-do-not-print"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data")


@pytest.fixture
def store(settings: Settings) -> SecretStore:
    return SecretStore(settings)


def test_set_list_resolve_remove(store: SecretStore) -> None:
    info = store.set("TOKEN", VALUE, ALICE)
    assert (info.name, info.owner_uid, info.shared) == ("TOKEN", ALICE, False)
    [listed] = store.list(ALICE)
    assert (listed.name, listed.owner_uid, listed.shared) == ("TOKEN", ALICE, False)
    assert listed.set_at == pytest.approx(info.set_at)
    assert VALUE not in repr(listed)
    assert store.resolve(["TOKEN"], ALICE) == {"TOKEN": VALUE}
    store.set("TOKEN", "second", ALICE)
    assert store.resolve(["TOKEN"], ALICE) == {"TOKEN": "second"}
    store.remove("TOKEN", ALICE)
    assert store.list(ALICE) == []
    with pytest.raises(SecretNotFound) as err:
        store.resolve(["TOKEN"], ALICE)
    assert err.value.name == "TOKEN" and err.value.uid == ALICE
    assert "agentbox secret set TOKEN" in str(err.value)
    with pytest.raises(SecretNotFound):
        store.remove("TOKEN", ALICE)


def test_one_users_secret_is_not_anothers(store: SecretStore) -> None:
    store.set("TOKEN", VALUE, ALICE)
    assert store.list(BOB) == []
    with pytest.raises(SecretNotFound):
        store.resolve(["TOKEN"], BOB)
    with pytest.raises(SecretNotFound):
        store.remove("TOKEN", BOB)
    assert store.resolve(["TOKEN"], ALICE) == {"TOKEN": VALUE}  # untouched by bob's attempts
    # root's own (unshared) secrets are root's alone
    store.set("ROOTS", "root-only", 0)
    with pytest.raises(SecretNotFound):
        store.resolve(["ROOTS"], ALICE)
    assert [i.name for i in store.list(ALICE)] == ["TOKEN"]


def test_shared_secrets_are_roots_and_a_users_own_comes_first(store: SecretStore) -> None:
    with pytest.raises(InvalidValue):
        store.set("TEAM", VALUE, ALICE, shared=True)
    store.set("TEAM", "team-value", 0, shared=True)
    assert store.resolve(["TEAM"], BOB) == {"TEAM": "team-value"}
    [seen] = store.list(BOB)
    assert (seen.name, seen.owner_uid, seen.owner_name, seen.shared) == ("TEAM", 0, "root", True)
    store.set("TEAM", "alices-own", ALICE)
    assert store.resolve(["TEAM"], ALICE) == {"TEAM": "alices-own"}
    assert [(i.owner_uid, i.shared) for i in store.list(ALICE)] == [(ALICE, False)]
    # a user cannot remove root's shared one
    with pytest.raises(SecretNotFound):
        store.remove("TEAM", BOB)
    assert store.resolve(["TEAM"], BOB) == {"TEAM": "team-value"}
    everyone = store.list(0, all_users=True)
    assert {(i.name, i.owner_uid) for i in everyone} == {("TEAM", 0), ("TEAM", ALICE)}


def test_the_store_is_private_and_atomic(store: SecretStore) -> None:
    store.set("TOKEN", VALUE, ALICE)
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    f = store.root / f"{ALICE}.json"
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    data = json.loads(f.read_text())
    assert data["format"] == 1 and data["uid"] == ALICE
    assert data["secrets"]["TOKEN"]["value"] == VALUE
    assert not [p for p in store.root.iterdir() if p.name.endswith(".tmp")]
    # a dir opened up is closed again, a file opened up too
    store.root.chmod(0o755)
    f.chmod(0o644)
    store.resolve(["TOKEN"], ALICE)
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    # the last secret removed removes the file
    store.remove("TOKEN", ALICE)
    assert not f.exists()


def test_a_link_or_a_garbled_file_is_refused_without_quoting_it(
    store: SecretStore, tmp_path: Path
) -> None:
    store.set("TOKEN", VALUE, ALICE)
    f = store.root / f"{ALICE}.json"
    f.write_text('{"format": 1, "uid": 1001, "secrets": {"TOKEN": {"value": "' + VALUE + '"')
    with pytest.raises(SecretStoreError) as err:
        store.resolve(["TOKEN"], ALICE)
    assert VALUE not in str(err.value) and VALUE not in repr(err.value.__cause__)
    f.unlink()
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"format": 1, "uid": ALICE, "secrets": {}}))
    os.symlink(target, f)
    with pytest.raises(SecretStoreError):
        store.list(ALICE)
    # another uid's file under this uid's name is not read as this uid's
    f.unlink()
    f.write_text(
        json.dumps({"format": 1, "uid": BOB, "secrets": {"X": {"value": "v", "set_at": 1}}})
    )
    with pytest.raises(SecretStoreError):
        store.resolve(["X"], ALICE)


def test_a_store_dir_that_is_a_link_is_refused(settings: Settings, tmp_path: Path) -> None:
    settings.data_dir.mkdir()
    (tmp_path / "other").mkdir()
    os.symlink(tmp_path / "other", settings.data_dir / "secrets")
    with pytest.raises(SecretStoreError):
        SecretStore(settings).set("TOKEN", VALUE, ALICE)
    assert list((tmp_path / "other").iterdir()) == []


@pytest.mark.parametrize(
    "name", ["", "token", "1TOKEN", "TOK-EN", "A" * 65, "TOK\nEN", "TOK EN", "É"]
)
def test_bad_names_are_refused(store: SecretStore, name: str) -> None:
    with pytest.raises(InvalidValue):
        store.set(name, VALUE, ALICE)
    with pytest.raises(InvalidValue):
        find_refs("${secret:" + name + "}")


@pytest.mark.parametrize(
    "value", ["", "two\nlines", "cr\rlf", "nul\0", "tab\there", "del\x7f", "x" * 8193, "é" * 4097]
)
def test_bad_values_are_refused_without_quoting_them(store: SecretStore, value: str) -> None:
    with pytest.raises(InvalidValue) as err:
        store.set("TOKEN", value, ALICE)
    if value:
        assert value not in str(err.value)
    assert store.list(ALICE) == []


def test_longest_value_is_kept(store: SecretStore) -> None:
    store.set("TOKEN", "x" * 8192, ALICE)
    assert store.resolve(["TOKEN"], ALICE)["TOKEN"] == "x" * 8192


def test_find_refs_and_expand() -> None:
    assert find_refs("Bearer ${secret:X}") == ["X"]
    assert find_refs("${secret:A}:${secret:B_2}/${secret:A}") == ["A", "B_2"]
    assert find_refs("no refs, ${other:X} and $secret:X") == []
    for broken in ("Bearer ${secret:X", "${secret:}", "${secret:x}", "${secret:A}${secret:"):
        with pytest.raises(InvalidValue):
            find_refs(broken)
    assert expand("Bearer ${secret:X}", {"X": "v"}) == "Bearer v"
    assert expand("${secret:A}:${secret:B}", {"A": "u", "B": "p"}) == "u:p"
    # one pass: a value that looks like a reference stays as it is
    assert expand("${secret:A}", {"A": "${secret:B}", "B": "no"}) == "${secret:B}"
    with pytest.raises(SecretNotFound):
        expand("${secret:MISSING}", {})
    assert PLACEHOLDER == "agentbox-brokered"


def test_resolve_for_task_scopes_to_the_owner(settings: Settings, store: SecretStore) -> None:
    store.set("A_TOKEN", "alice-a", ALICE)
    store.set("TEAM", "team", 0, shared=True)
    templates = ["Bearer ${secret:A_TOKEN}", "${secret:TEAM}:${secret:A_TOKEN}", "plain"]
    assert resolve_for_task(settings, ALICE, templates) == {"A_TOKEN": "alice-a", "TEAM": "team"}
    with pytest.raises(SecretNotFound) as err:
        resolve_for_task(settings, BOB, templates)
    assert err.value.name == "A_TOKEN" and err.value.uid == BOB
    assert resolve_for_task(settings, BOB, ["plain"]) == {}
