"""The git-attack corpus: an agent that plants everything git could be tricked with.

Each attack is planted the way an agent would, with plain file operations in
its workspace (its own ``.git`` included). Every command an attack would make
git run drops a marker into ``outside/markers``; every file outside the
workspace holds a secret string. After collect + publish: no marker exists, no
secret is in any object of the shadow dir or the user's repo, the report names
what was skipped, and the user's repo changed only by the new branch.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_collect_support import Prepared, all_objects, git, make_repo, prepare_in, repo_state

from agentbox.collect import Collected, collect, publish

pytestmark = pytest.mark.timeout(180)

HOOKS = [
    "pre-commit", "post-commit", "post-index-change", "reference-transaction",
    "fsmonitor-watchman", "pre-auto-gc", "post-checkout", "post-merge", "pre-push",
    "post-rewrite", "prepare-commit-msg", "commit-msg", "push-to-checkout", "update",
    "pre-receive", "post-receive", "post-update", "proc-receive",
]  # fmt: skip


@dataclass
class Corpus:
    p: Prepared
    outside: Path
    markers: Path
    secrets: list[bytes]
    got: Collected
    before: dict[str, object]
    after: dict[str, object]


def _mark(markers: Path, name: str) -> str:
    return f"touch {markers}/{name}"


def _hook(path: Path, markers: Path, name: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{_mark(markers, name)}\ncat >/dev/null 2>&1\nexit 0\n")
    path.chmod(0o755)


def _outside(tmp: Path) -> tuple[Path, Path, list[bytes]]:
    outside = tmp / "outside"
    markers = outside / "markers"
    markers.mkdir(parents=True)
    secret = f"OUTSIDE-SECRET-{secrets.token_hex(8)}".encode()
    (outside / "secret.txt").write_bytes(secret + b"\n")
    hl_secret = f"HARDLINK-SECRET-{secrets.token_hex(8)}".encode()
    (outside / "hardlinked.txt").write_bytes(hl_secret + b"\n")
    repo_secret = f"HOSTREPO-SECRET-{secrets.token_hex(8)}"
    host = make_repo(outside / "hostrepo", {"secret.txt": repo_secret + "\n"})
    for hook in HOOKS:
        _hook(host / ".git/hooks" / hook, markers, f"hostrepo-{hook}")
    git(host, "config", "core.fsmonitor", _mark(markers, "hostrepo-fsmonitor"))
    included = outside / "included.config"
    included.write_text(f"[core]\n\tfsmonitor = {_mark(markers, 'included-fsmonitor')}\n"
                        f"\tpager = {_mark(markers, 'included-pager')}\n")  # fmt: skip
    found = [secret, hl_secret, repo_secret.encode()]
    shadow_file = Path("/etc/shadow")
    if shadow_file.exists():
        lines = [ln for ln in shadow_file.read_bytes().splitlines() if b":" in ln]
        found += [ln for ln in lines if len(ln) > 12][:3]
    return outside, markers, found


def _plant_config(gitdir: Path, outside: Path, markers: Path, ws: Path) -> None:
    m = lambda name: _mark(markers, name)  # noqa: E731
    cfg = f"""
[core]
\tfsmonitor = {m("fsmonitor")}
\thooksPath = {ws / ".githooks"}
\tpager = {m("pager")}
\teditor = {m("editor")}
\taskPass = {m("askpass")}
\tsshCommand = {m("ssh")}
\tgitProxy = {m("gitproxy")}
\talternateRefsCommand = {m("alternaterefs")}
\tworktree = {outside}
\tuntrackedCache = true
\tsymlinks = false
\tprotectNTFS = false
[include]
\tpath = {outside / "included.config"}
[includeIf "gitdir:/"]
\tpath = {outside / "included.config"}
[filter "evil"]
\tclean = sh -c '{m("filter-clean")}; cat'
\tsmudge = sh -c '{m("filter-smudge")}; cat'
\tprocess = sh -c '{m("filter-process")}'
\trequired = true
[diff]
\texternal = sh -c '{m("diff-external")}'
[diff "evil"]
\ttextconv = sh -c '{m("textconv")}; cat'
\tcommand = sh -c '{m("diff-command")}'
[merge "evil"]
\tdriver = sh -c '{m("merge-driver")}'
[uploadpack]
\tpackObjectsHook = sh -c '{m("packobjectshook")}'
[credential]
\thelper = !{m("credential")}
[remote "origin"]
\turl = ext::sh -c {m("ext-remote").replace(" ", "% ")}
[gc]
\tauto = 1
[alias]
\tstatus = !{m("alias")}
\tadd = !{m("alias-add")}
[user]
\tname = agent
\temail = agent@example.com
"""
    with open(gitdir / "config", "a") as f:
        f.write(cfg)
    for hook in HOOKS:
        _hook(gitdir / "hooks" / hook, markers, f"hook-{hook}")
        _hook(ws / ".githooks" / hook, markers, f"hookspath-{hook}")
    (gitdir / "objects/info").mkdir(parents=True, exist_ok=True)
    (gitdir / "objects/info/alternates").write_text(f"{outside / 'hostrepo/.git/objects'}\n")
    (gitdir / "info").mkdir(exist_ok=True)
    (gitdir / "info/attributes").write_text("* filter=evil diff=evil merge=evil\n")
    (gitdir / "info/exclude").write_text("*\n")  # would hide every new file if we read it


def _plant_files(ws: Path, outside: Path, markers: Path, *, fifo_gitignore: bool = True) -> None:
    (ws / ".gitattributes").write_text("* filter=evil diff=evil merge=evil text eol=crlf\n")
    (ws / "src/app.py").write_text("def f():\n    return 42\n")
    (ws / "added.txt").write_text("a new file\n")
    # Links out of the workspace, absolute and relative, to files and directories.
    os.symlink("/etc/shadow", ws / "shadow-link")
    os.symlink(outside / "secret.txt", ws / "secret-link")
    os.symlink(os.path.relpath(outside / "secret.txt", ws), ws / "rel-secret-link")
    os.symlink(outside, ws / "escape-dir")
    os.symlink("/proc/self/root/etc/shadow", ws / "magic-link")
    subprocess.run(["rm", "-rf", str(ws / "lib")], check=True)
    os.symlink(outside, ws / "lib")  # a tracked directory replaced by a link out
    # Hard links: one to a file outside (same filesystem), one pair inside.
    os.link(outside / "hardlinked.txt", ws / "hardlink-out.txt")
    (ws / "h1.txt").write_text("inside pair\n")
    os.link(ws / "h1.txt", ws / "h2.txt")
    # Special files.
    os.mkfifo(ws / "fifo")
    (ws / "nested").mkdir()
    if fifo_gitignore:
        os.mkfifo(ws / "nested/.gitignore")  # opening it would block git forever
    (ws / "nested/kept.txt").write_text("kept\n")
    os.mknod(ws / "null-dev", 0o666 | 0o020000, os.makedev(1, 3))
    os.mknod(ws / "loop-dev", 0o660 | 0o060000, os.makedev(7, 0))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(ws / "sock"))
    sock.close()
    # setuid / setgid.
    (ws / "suid.sh").write_text("#!/bin/sh\nid\n")
    (ws / "suid.sh").chmod(0o4755)
    (ws / "sgid.txt").write_text("g\n")
    (ws / "sgid.txt").chmod(0o2644)
    # An embedded repository with its own hooks and fsmonitor.
    emb = ws / "vendor/lib"
    emb.mkdir(parents=True)
    git(emb, "init", "-q")
    (emb / "code.py").write_text("EMBEDDED = 1\n")
    git(emb, "add", "code.py")
    git(emb, "commit", "-q", "-m", "embedded")
    git(emb, "config", "core.fsmonitor", _mark(markers, "embedded-fsmonitor"))
    for hook in HOOKS:
        _hook(emb / ".git/hooks" / hook, markers, f"embedded-{hook}")
    # .git look-alikes and a symlinked .gitmodules.
    (ws / ".GIT").mkdir()
    (ws / ".GIT/config").write_text("[core]\n\tfsmonitor = x\n")
    (ws / "sub").mkdir()
    (ws / "sub/git~1").write_text("ntfs\n")
    os.symlink(outside / "secret.txt", ws / ".gitmodules")
    # Hostile names.
    for name in ["new\nline.txt", "tab\tname.txt", "esc\x1b[31mred.txt", "cr\rname.txt",
                 "del\x7f.txt"]:  # fmt: skip
        (ws / name).write_text("bad name\n")
    (ws / "ctl\ndir").mkdir()
    (ws / "ctl\ndir/inner.txt").write_text("inner\n")
    (ws / os.fsdecode(b"latin-\xe9.txt")).write_text("latin-1 name\n")
    # A 10 GiB sparse file.
    with open(ws / "huge.bin", "wb") as f:
        f.truncate(10 << 30)


@pytest.fixture(scope="module", params=["git-oracle", "fallback"])
def corpus(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Corpus]:
    """The planted workspace, collected and published (with git's stat oracle, and without)."""
    from agentbox.collect import _collect as cmod

    mp = pytest.MonkeyPatch()
    if request.param == "fallback":
        mp.setattr(cmod, "_git_changed", lambda *a: None)
    tmp = tmp_path_factory.mktemp("attacks")
    outside, markers, found = _outside(tmp)
    repo = make_repo(
        tmp / "user",
        {"src/app.py": "def f():\n    return 1\n", "lib/x.py": "X = 1\n", "README": "r\n"},
    )
    p = prepare_in(tmp / "task", repo)
    # The agent first uses its own git normally (before it turns hostile) ...
    (p.ws / "agent-note.txt").write_text("note\n")
    git(p.ws, "add", "-A")
    git(p.ws, "commit", "-q", "-m", "agent's own commit")
    # ... then plants everything.
    _plant_config(p.ws / ".git", outside, markers, p.ws)
    _plant_files(p.ws, outside, markers)
    assert list(markers.iterdir()) == [], "planting must not have run anything"
    before = repo_state(repo)
    got = collect(p.ws, p.shadow, p.index, p.base, task_id="attack", message="hostile")
    publish(p.shadow, repo, task_id="attack", commit=got.commit)
    mp.undo()
    yield Corpus(p, outside, markers, found, got, before, repo_state(repo))


def _tree(c: Corpus) -> dict[str, tuple[str, str]]:
    out = git(c.p.shadow, "--git-dir", str(c.p.shadow), "ls-tree", "-r", "-z", c.got.commit)
    tree = {}
    for rec in out.split("\0"):
        if rec:
            meta, path = rec.split("\t", 1)
            mode, _, oid = meta.split(" ")
            tree[path] = (mode, oid)
    return tree


def _blob(c: Corpus, oid: str) -> bytes:
    return subprocess.run(["git", f"--git-dir={c.p.shadow}", "cat-file", "blob", oid],
                          capture_output=True, check=True).stdout  # fmt: skip


def test_nothing_executed(corpus: Corpus) -> None:
    assert sorted(os.listdir(corpus.markers)) == []


def test_no_secret_in_any_object(corpus: Corpus) -> None:
    # Control: the scan does find a secret where it is.
    assert corpus.secrets[2] in all_objects(corpus.outside / "hostrepo/.git")
    for where in (corpus.p.shadow, corpus.p.repo / ".git"):
        blob = all_objects(where)
        assert blob, where
        for s in corpus.secrets:
            assert s not in blob, (where, s[:20])


def test_user_repo_changed_only_by_the_branch(corpus: Corpus) -> None:
    assert corpus.before == corpus.after
    assert git(corpus.p.repo, "rev-parse", "agentbox/attack").strip() == corpus.got.commit


def test_links_recorded_as_links(corpus: Corpus) -> None:
    tree = _tree(corpus)
    links: list[tuple[str, str | bytes]] = [
        ("shadow-link", b"/etc/shadow"),
        ("escape-dir", str(corpus.outside)),
        ("lib", str(corpus.outside)),
        ("magic-link", b"/proc/self/root/etc/shadow"),
        ("secret-link", str(corpus.outside / "secret.txt")),
    ]
    for name, target in links:
        mode, oid = tree[name]
        assert mode == "120000", name
        want = target if isinstance(target, bytes) else target.encode()
        assert _blob(corpus, oid) == want
    assert tree["rel-secret-link"][0] == "120000"
    assert not any(p.startswith(("lib/", "escape-dir/")) for p in tree)


def test_special_files_skipped_and_reported(corpus: Corpus) -> None:
    reasons = {s.path: s.reason for s in corpus.got.skipped}
    assert "fifo" in reasons["fifo"]
    assert "fifo" in reasons["nested/.gitignore"]
    assert "device" in reasons["null-dev"] and "device" in reasons["loop-dev"]
    assert "socket" in reasons["sock"]
    assert "per-file cap" in reasons["huge.bin"]
    assert "outside the workspace" in reasons["hardlink-out.txt"]
    assert "nested .git" in reasons["vendor/lib/.git"]
    assert "nested .git" in reasons[".GIT"] and "nested .git" in reasons["sub/git~1"]
    assert ".gitmodules" in reasons[".gitmodules"]
    for shown in ["new\\nline.txt", "tab\\tname.txt", "esc\\x1b[31mred.txt", "cr\\rname.txt",
                  "del\\x7f.txt", "ctl\\ndir"]:  # fmt: skip
        assert "control character" in reasons[shown], shown
    tree = _tree(corpus)
    for name in ["fifo", "null-dev", "loop-dev", "sock", "huge.bin", "hardlink-out.txt",
                 ".gitmodules", ".GIT/config", "sub/git~1", "ctl\ndir/inner.txt"]:  # fmt: skip
        assert name not in tree, name
    assert not any("\n" in p or "\t" in p or "\x1b" in p for p in tree)


def test_modes_and_ordinary_content(corpus: Corpus) -> None:
    tree = _tree(corpus)
    assert tree["suid.sh"][0] == "100755" and tree["sgid.txt"][0] == "100644"
    notes = {s.path: s.reason for s in corpus.got.notes}
    assert "setuid" in notes["suid.sh"] and "setuid" in notes["sgid.txt"]
    assert _blob(corpus, tree["src/app.py"][1]) == b"def f():\n    return 42\n"
    assert _blob(corpus, tree["vendor/lib/code.py"][1]) == b"EMBEDDED = 1\n"
    assert "h1.txt" in tree and tree["h1.txt"] == tree["h2.txt"]
    assert "nested/kept.txt" in tree and "added.txt" in tree and "agent-note.txt" in tree
    # A name that is not UTF-8 is refused like a control character (issue 11.5).
    assert os.fsdecode(b"latin-\xe9.txt") not in tree
    assert "not valid UTF-8" in {s.path: s.reason for s in corpus.got.skipped}["latin-\\xe9.txt"]
    # The filter named in .gitattributes never ran: the file is collected as written.
    assert _blob(corpus, tree[".gitattributes"][1]).startswith(b"* filter=evil")
    assert not any(p == ".git" or p.startswith(".git/") for p in tree)
    assert not any(p.startswith("vendor/lib/.git") for p in tree)


@pytest.mark.parametrize("variant", ["gitfile", "gitsymlink", "gitdir-swap"])
def test_dot_git_pointing_outside(variant: str, tmp_path: Path) -> None:
    outside, markers, found = _outside(tmp_path)
    repo = make_repo(tmp_path / "user", {"a.txt": "a\n"})
    p = prepare_in(tmp_path / "task", repo)
    subprocess.run(["rm", "-rf", str(p.ws / ".git")], check=True)
    host_git = outside / "hostrepo/.git"
    if variant == "gitfile":
        (p.ws / ".git").write_text(f"gitdir: {host_git}\n")
    elif variant == "gitsymlink":
        os.symlink(host_git, p.ws / ".git")
    else:  # the agent's .git is a real dir whose commondir/objects point outside
        (p.ws / ".git").mkdir()
        (p.ws / ".git/commondir").write_text(f"{host_git}\n")
        os.symlink(host_git / "objects", p.ws / ".git/objects")
        os.symlink(host_git / "config", p.ws / ".git/config")
    (p.ws / "a.txt").write_text("changed\n")
    before = repo_state(repo)
    got = collect(p.ws, p.shadow, p.index, p.base, task_id="gitfile", message="m")
    publish(p.shadow, repo, task_id="gitfile", commit=got.commit)
    assert os.listdir(markers) == []
    for where in (p.shadow, repo / ".git"):
        blob = all_objects(where)
        assert not any(s in blob for s in found)
    assert repo_state(repo) == before
    assert got.diffstat.files_changed == 1


def test_positive_control_naive_git_runs_the_attacks(tmp_path: Path) -> None:
    """The planted corpus is live: git run the naive way (in the agent's repo) fires it."""
    outside, markers, _ = _outside(tmp_path)
    repo = make_repo(tmp_path / "user", {"src/app.py": "x\n", "lib/x.py": "X = 1\n"})
    p = prepare_in(tmp_path / "task", repo)
    _plant_config(p.ws / ".git", outside, markers, p.ws)
    _plant_files(p.ws, outside, markers, fifo_gitignore=False)
    env = {"GIT_CONFIG_GLOBAL": "/dev/null"}
    for args in (["status"], ["add", "-A"], ["commit", "-q", "-m", "x"], ["diff", "HEAD~1"]):
        subprocess.run(["git", *args], cwd=p.ws, env={**os.environ, **env}, timeout=60,
                       capture_output=True, check=False)  # fmt: skip
    fired = set(os.listdir(markers))
    # include.path comes last in the config, so its fsmonitor wins; process beats clean.
    want = {"included-fsmonitor", "filter-process", "hookspath-pre-commit",
            "hookspath-post-index-change", "hookspath-reference-transaction"}  # fmt: skip
    assert want <= fired, fired
