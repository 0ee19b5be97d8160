"""The setup phase and frozen environments on real podman sandboxes (issue 12), without the agent.

Each test runs :func:`agentbox.env.prepare_env` as the launcher does, in a task dir
of its own, then (where it matters) a sandbox with the plan's mounts as the agent's
would get them. Commands carry a nonce so their keys are this run's own; every
environment made is removed at the end. Every sandbox (the setup phase's and the
agent's) goes through the leak guard (``sandbox_factory``, via ``SandboxTracker.proxy``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends import get_backend
from agentbox.backends.base import Backend
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.env import EnvPlan, EnvStore, prepare_env
from agentbox.gateway import gateway_identity
from agentbox.sandbox import spec_from_boxfile
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(os.geteuid() != 0, reason="the overlay and the proxy need root"),
]


class Task:
    """One task dir: ``root/workspace`` (the sandbox's) and ``root/logs``."""

    def __init__(self, settings: Settings, files: dict[str, str], boxes: SandboxTracker) -> None:
        self.settings = settings
        self.backend = boxes.proxy()  # every sandbox made is checked for survivors
        self.root = Path(tempfile.mkdtemp(prefix="envtask-", dir=settings.data_dir))
        self.root.chmod(0o711)
        self.ws = self.root / "workspace"
        self.logs = self.root / "logs"
        self.ws.mkdir()
        self.logs.mkdir()
        uid = settings.sandbox_host_uid
        for rel, text in files.items():
            p = self.ws / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        for top, dirs, names in os.walk(self.ws):
            for n in [*dirs, *names, "."]:
                os.chown(Path(top, n), uid, uid)
        self.plan: EnvPlan | None = None

    def prepare(self, box: Boxfile, **scope: object) -> EnvPlan:
        self.plan = prepare_env(
            self.settings if "settings" not in scope else scope.pop("settings"),  # type: ignore[arg-type]
            box,
            self.backend,
            task_id=f"t{secrets.token_hex(4)}",
            task_root=self.root,
            workspace=self.ws,
            log_dir=self.logs,
            labels={},
            proxy_identity=gateway_identity(self.settings),
            **scope,  # type: ignore[arg-type]
        )
        return self.plan

    def run(self, box: Boxfile, script: str) -> tuple[int, str]:
        """Run ``script`` in a sandbox with the plan's mounts (the agent's view), no egress."""
        assert self.plan is not None
        spec = spec_from_boxfile(box, self.settings, workspace=self.ws)
        spec = spec.replace(mounts=(*spec.mounts, *self.plan.mounts), deadline=120)
        res = self.backend.run(spec, ["/bin/sh", "-c", script])
        return res.exit_code, (res.stdout + res.stderr).decode(errors="replace")

    def close(self) -> None:
        if self.plan is not None:
            self.plan.release()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def tasks(
    sandbox_settings: Settings,
    default_image: str,
    sandbox_factory: Callable[[Backend, Settings], SandboxTracker],
) -> Iterator[Callable[[dict[str, str]], Task]]:
    made: list[Task] = []
    boxes = sandbox_factory(get_backend("podman", sandbox_settings), sandbox_settings)

    def make(files: dict[str, str]) -> Task:
        t = Task(sandbox_settings, files, boxes)
        made.append(t)
        return t

    yield make
    store = EnvStore(sandbox_settings)
    keys = {t.plan.report.key for t in made if t.plan is not None}
    for t in made:
        t.close()
    for key in keys:
        store.remove(key, force=True)


def _box(
    image: str, run: list[str], runtime: str = "runc", env: dict[str, str] | None = None,
    **setup: object,
) -> Boxfile:  # fmt: skip
    return Boxfile.from_dict(
        {
            "image": image,
            "runtime": runtime,
            "resources": {"disk": "256MiB"},
            "env": {"set": env or {}},
            "setup": {"run": run, **setup},
        }
    )


def _index_url() -> str:
    from agentbox.egress import host_registries

    pip = [(sch, h, p) for src, sch, h, p in host_registries() if src == "pip" and sch == "https"]
    if not pip:
        pytest.skip("this host's pip names no https index")
    _, host, port = pip[0]
    try:
        socket.create_connection((host, port), timeout=10).close()
    except OSError as exc:
        pytest.skip(f"pip's index is unreachable from this host: {exc}")
    return f"https://{host}:{port}/simple/"


FETCH = (
    "python3 -c 'import sys, urllib.request as u; "
    'r = u.urlopen(sys.argv[1], timeout=20); print("GOT-%d" % r.status)\' {url}'
)


def test_a_failed_setup_reports_its_output_and_freezes_nothing(
    tasks: Callable[[dict[str, str]], Task], default_image: str
) -> None:
    nonce = secrets.token_hex(4)
    t = tasks({"README": "x\n"})
    box = _box(
        default_image, [f"echo about to fail {nonce}", "mkdir .venv", "exit 3", "echo never"]
    )
    plan = t.prepare(box)
    assert plan.failed and plan.report.cache == "failed" and plan.report.ran
    assert plan.report.exit_code == 3 and not plan.report.timed_out
    assert f"about to fail {nonce}" in plan.report.output_tail
    assert "never" not in plan.report.output_tail.replace("echo never", "")
    assert plan.mounts == () and plan.report.egress is None
    assert EnvStore(t.settings).get(plan.report.key) is None
    assert f"about to fail {nonce}" in (t.logs / "setup.log").read_text()


def test_a_setup_killed_by_a_signal_says_so(
    tasks: Callable[[dict[str, str]], Task], default_image: str
) -> None:
    """Issue 34 item 3: exit 137 is said as a SIGKILL, with why (here none of ours)."""
    t = tasks({"README": "x\n"})
    plan = t.prepare(_box(default_image, ["kill -KILL $$"]))
    assert plan.failed and plan.report.exit_code == 137, plan.report
    assert plan.report.exit_words.startswith("exit 137: killed by SIGKILL ("), plan.report
    assert (
        plan.report.exit_words.endswith(
            "(not by agentbox's deadline or cancel, and no OOM kill was counted)"
        )
        or "OOM killer" in plan.report.exit_words
    )  # another process's OOM meanwhile


def test_setup_past_its_deadline_fails(
    tasks: Callable[[dict[str, str]], Task], default_image: str
) -> None:
    t = tasks({"README": "x\n"})
    plan = t.prepare(_box(default_image, ["sleep 60"], deadline=3))
    assert plan.failed and plan.report.timed_out


def test_miss_freezes_what_setup_made_and_a_hit_mounts_it_copy_on_write(
    tasks: Callable[[dict[str, str]], Task], default_image: str
) -> None:
    nonce = secrets.token_hex(4)
    files = {"req.txt": "pkg==1\n", "sub/keep.py": "print('repo')\n"}
    run = [
        "mkdir -p .venv/bin sub/node_modules/pkg",
        f"echo tool-{nonce} > .venv/bin/tool",
        "echo module > sub/node_modules/pkg/index.js",
        "echo loose > sub/loose.txt",
    ]
    box = _box(default_image, run, inputs=["req.txt"])
    first = tasks(files)
    plan = first.prepare(box)
    assert plan.report.cache == "miss", plan.report.output_tail
    assert sorted(plan.report.roots) == [".venv", "sub/node_modules"]
    assert plan.report.dropped == ["sub/loose.txt"] and plan.report.files == 2
    # The host workspace keeps empty mount points only: nothing for collection to see.
    assert sorted(os.listdir(first.ws)) == [".venv", "req.txt", "sub"]
    assert os.listdir(first.ws / ".venv") == [] and os.listdir(first.ws / "sub/node_modules") == []
    assert not (first.ws / "sub/loose.txt").exists()
    # The agent's view has it in place, and may write there: into its own layer.
    code, out = first.run(
        box,
        "cat .venv/bin/tool && echo changed > .venv/bin/tool && rm sub/node_modules/pkg/index.js"
        " && touch .venv/new && cat .venv/bin/tool",
    )
    assert code == 0 and f"tool-{nonce}\nchanged" in out, out
    first.plan.release() if first.plan else None
    frozen = EnvStore(first.settings).tree(plan.report.key)
    assert (frozen / ".venv/bin/tool").read_text() == f"tool-{nonce}\n"
    assert (frozen / "sub/node_modules/pkg/index.js").is_file()
    assert not (frozen / ".venv/new").exists()
    assert not (first.root / "env").exists()  # the task's layer went with it
    # Same key: a hit, no setup run, the frozen files as setup left them.
    second = tasks(files)
    plan2 = second.prepare(box)
    assert plan2.report.cache == "hit" and not plan2.report.ran
    assert plan2.report.key == plan.report.key
    assert not (second.logs / "setup.log").exists()
    code, out = second.run(box, "cat .venv/bin/tool; ls sub/node_modules/pkg; ls .venv")
    assert code == 0 and f"tool-{nonce}" in out and "index.js" in out and "new" not in out
    # Another input content: another key, a miss.
    third = tasks({**files, "req.txt": "pkg==2\n"})
    assert third.prepare(box).report.key != plan.report.key


def test_setup_without_network_has_no_way_out(
    tasks: Callable[[dict[str, str]], Task], default_image: str
) -> None:
    url = _index_url()
    t = tasks({"README": "x\n"})
    plan = t.prepare(
        _box(default_image, ["test ! -e /run/agentbox/gw/egress.sock", FETCH.format(url=url)])
    )
    assert plan.failed and plan.report.exit_code != 0
    assert "URLError" in plan.report.output_tail and "GOT-200" not in plan.report.output_tail
    assert plan.report.egress is None  # no proxy ran


def test_setup_reaches_the_registry_through_the_proxy_and_nothing_else(
    tasks: Callable[[dict[str, str]], Task], default_image: str
) -> None:
    url = _index_url()
    nonce = secrets.token_hex(4)
    t = tasks({"README": "x\n"})
    run = [
        f"mkdir -p .deps && echo {nonce} > .deps/stamp",
        FETCH.format(url=url),
        # A host the host's clients do not use: refused by the proxy (403), logged.
        f"{FETCH.format(url='https://example.org/')} || echo REFUSED-AS-EXPECTED",
    ]
    plan = t.prepare(_box(default_image, run, network="registries"))
    tail = plan.report.output_tail
    assert plan.report.cache == "miss", tail
    assert "GOT-200" in tail and "REFUSED-AS-EXPECTED" in tail
    egress = plan.report.egress
    assert egress is not None
    hosts = {h["host"]: h for h in egress["hosts"]}
    assert any(h["allowed"] for h in hosts.values())
    assert hosts["example.org"]["denied"] >= 1 and hosts["example.org"]["allowed"] == 0
    assert "not-allowed" in hosts["example.org"]["denied_rules"]


@pytest.mark.skipif(not _host.podman_runtime("runsc").ok, reason="runsc is not usable here")
def test_setup_through_the_proxy_and_a_hit_under_gvisor(
    tasks: Callable[[dict[str, str]], Task], default_image: str
) -> None:
    url = _index_url()
    nonce = secrets.token_hex(4)
    run = [f"mkdir -p .deps && echo {nonce} > .deps/stamp", FETCH.format(url=url)]
    box = _box(default_image, run, runtime="runsc", network="registries")
    first = tasks({"README": "x\n"})
    plan = first.prepare(box)
    assert plan.report.cache == "miss" and "GOT-200" in plan.report.output_tail, plan.report
    second = tasks({"README": "x\n"})
    assert second.prepare(box).report.cache == "hit"
    code, out = second.run(box, "cat .deps/stamp && echo more > .deps/stamp && cat .deps/stamp")
    assert code == 0 and f"{nonce}\nmore" in out, out
    assert (EnvStore(second.settings).tree(plan.report.key) / ".deps/stamp").read_text() == (
        f"{nonce}\n"
    )


def test_keep_paths_under_home_are_frozen_and_mounted_back(
    tasks: Callable[[dict[str, str]], Task], default_image: str
) -> None:
    nonce = secrets.token_hex(4)
    run = [
        "mkdir -p .venv ~/.cache/tool/bin",
        f"echo {nonce} > ~/.cache/tool/bin/data",
        "echo lost > ~/not-kept",
    ]
    box = _box(default_image, run, keep=["~/.cache/tool", "~/.absent"])
    first = tasks({"README": "x\n"})
    plan = first.prepare(box)
    assert plan.report.cache == "miss", plan.report.output_tail
    assert plan.report.roots == [".venv", "~/.cache/tool"]
    assert not (first.ws / ".agentbox-keep").exists()  # never in the workspace
    second = tasks({"README": "x\n"})
    assert second.prepare(box).report.cache == "hit"
    code, out = second.run(
        box,
        "cat ~/.cache/tool/bin/data && ls ~ && echo agent > ~/.cache/tool/bin/data "
        "&& cat ~/.cache/tool/bin/data",
    )
    assert code == 0 and f"{nonce}\n" in out and "agent" in out and "not-kept" not in out, out
    tree = EnvStore(second.settings).tree(plan.report.key)
    assert (tree / ".agentbox-keep/.cache/tool/bin/data").read_text() == f"{nonce}\n"


def test_writes_into_the_environment_are_bounded_by_the_disk_limit(
    tasks: Callable[[dict[str, str]], Task], default_image: str
) -> None:
    """The agent's layer over a frozen environment lives on an image of the task's disk
    limit (256 MiB here): a write past it fails inside with ENOSPC, the host is unharmed
    (the layer's image holds at most the limit) and everything goes with the task."""
    nonce = secrets.token_hex(4)
    box = _box(default_image, [f"mkdir .venv && echo {nonce} > .venv/f"])
    t = tasks({"README": "x\n"})
    plan = t.prepare(box)
    assert plan.report.cache == "miss", plan.report.output_tail
    layer = t.root / "env" / "layer"
    free = shutil.disk_usage(t.settings.data_dir).free
    code, out = t.run(
        box,
        "dd if=/dev/zero of=.venv/big bs=1M count=400 2>&1; echo DD-EXIT=$?; "
        "rm .venv/big; cat .venv/f; echo small > .venv/ok && echo STILL-WRITABLE",
    )
    assert code == 0, out
    assert "No space left on device" in out and "DD-EXIT=1" in out, out
    assert nonce in out and "STILL-WRITABLE" in out
    assert os.path.ismount(layer)
    image = t.root / "env" / "layer.img"
    assert image.stat().st_blocks * 512 <= 256 * 1024**2 + (8 << 20)
    # The host's disk lost at most the limit (and other writers' noise), not 400 MiB.
    assert free - shutil.disk_usage(t.settings.data_dir).free < 300 * 1024**2
    assert plan.overlay is not None
    plan.overlay.release()
    assert not os.path.ismount(layer) and not (t.root / "env").exists()
    assert (EnvStore(t.settings).tree(plan.report.key) / ".venv" / "f").read_text() == f"{nonce}\n"


def test_the_default_image_makes_a_venv_with_pip(
    tasks: Callable[[dict[str, str]], Task], default_image: str
) -> None:
    """The how-to's plain recipe works on the default image, no Containerfile: it has
    ``python3-venv`` (venv + ensurepip + pip's bundled wheel), so ``python3 -m venv``
    makes a venv with pip, offline; the frozen venv runs in the agent's sandbox."""
    nonce = secrets.token_hex(4)
    t = tasks({"README": "x\n"})
    box = _box(default_image, [f"echo {nonce}", "python3 -m venv .venv", ".venv/bin/pip --version"])
    plan = t.prepare(box)
    assert plan.report.cache == "miss", plan.report.output_tail
    assert "pip " in plan.report.output_tail and "ensurepip" not in plan.report.output_tail
    code, out = t.run(box, ".venv/bin/python -c 'import sys; print(sys.prefix)'; .venv/bin/pip -V")
    assert code == 0 and "/workspace/.venv" in out, out


def test_one_repo_never_seeds_another_repos_or_another_users_environment(
    tasks: Callable[[dict[str, str]], Task], default_image: str, tmp_path: Path
) -> None:
    """Issue 33 §2, the reproduction: two repos with the same [setup] and requirements.txt
    but another build.sh (run by setup, not an input) and another [env] set. Each gets a
    setup of its own (a miss) and its agent sees its own .venv; so does one user after
    another on identical repos, unless the host shares environments across users."""
    nonce = secrets.token_hex(4)
    run = ["sh build.sh"]
    req = {"requirements.txt": f"attrs=={nonce}\n"}
    build = 'mkdir -p .venv && echo "$MARK-{who}" > .venv/marker{extra}\n'
    good = {**req, "build.sh": build.format(who="good", extra="")}
    evil = {**req, "build.sh": build.format(who="evil", extra=" && echo x > .venv/evil.py")}
    repo_a, repo_b = tmp_path / "a", tmp_path / "b"
    repo_a.mkdir()
    repo_b.mkdir()
    # key = "inputs" narrows the files to requirements.txt, as the reproduction's
    # Boxfile did; the repo, the variables and the user still key it.
    box_evil = _box(default_image, run, env={"MARK": "e"}, inputs=["requirements.txt"],
                    key="inputs")  # fmt: skip
    box_good = _box(default_image, run, env={"MARK": "g"}, inputs=["requirements.txt"],
                    key="inputs")  # fmt: skip
    first = tasks(evil)
    assert first.prepare(box_evil, user=1000, repo=repo_a).report.cache == "miss"
    second = tasks(good)
    plan = second.prepare(box_good, user=1000, repo=repo_b)
    assert plan.report.cache == "miss" and plan.report.ran, plan.report.output_tail
    code, out = second.run(box_good, "cat .venv/marker; ls .venv")
    assert code == 0 and "g-good" in out and "evil" not in out, out
    # Only [env] set differs (the same repo and files): a miss too.
    third = tasks(evil)
    box_evil_g = _box(default_image, run, env={"MARK": "g"}, inputs=["requirements.txt"],
                      key="inputs")  # fmt: skip
    assert third.prepare(box_evil_g, user=1000, repo=repo_a).report.cache == "miss"
    # The default key (the whole tree): build.sh alone differs, same repo path: a miss.
    tree_evil, tree_good = _box(default_image, run), _box(default_image, run)
    fourth = tasks(evil)
    assert fourth.prepare(tree_evil, user=1000, repo=repo_a).report.cache == "miss"
    fifth = tasks(good)
    plan = fifth.prepare(tree_good, user=1000, repo=repo_a)
    assert plan.report.cache == "miss", plan.report.output_tail
    code, out = fifth.run(tree_good, "cat .venv/marker; ls .venv")
    assert code == 0 and "-good" in out and "evil" not in out, out
    # Another user, identical repo path and files: a miss, its own environment.
    sixth = tasks(evil)
    plan = sixth.prepare(tree_evil, user=1001, repo=repo_a)
    assert plan.report.cache == "miss", plan.report.output_tail
    # The same user again: a hit (the key is stable).
    seventh = tasks(evil)
    assert seventh.prepare(tree_evil, user=1001, repo=repo_a).report.cache == "hit"
    # Shared across users only when the host says so: then the other user hits.
    shared = first.settings.model_copy(update={"env_shared_across_users": True})
    eighth = tasks(evil)
    assert eighth.prepare(tree_evil, user=1000, repo=repo_a, settings=shared).report.cache == "miss"
    ninth = tasks(evil)
    plan = ninth.prepare(tree_evil, user=1001, repo=repo_a, settings=shared)
    assert plan.report.cache == "hit"
    assert EnvStore(shared).get(plan.report.key).user is None  # type: ignore[union-attr]
