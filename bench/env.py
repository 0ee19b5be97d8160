"""Task start to the agent's first command: no environment, a frozen one, a cold setup.

Usage: .venv/bin/python bench/env.py [--mb 200] [--runs 5] [--runtime runc]

Real podman sandboxes on the default image, each with a small workspace (and the
workspace disk limit, as tasks have). Times, in the same run and interleaved:

* **none**: a sandbox with no ``[setup]`` runs its first command;
* **frozen**: :func:`agentbox.env.prepare_env` finds the environment frozen (a
  ``node_modules`` of ``--mb`` MB in 2,000 files, made once by a cold setup
  beforehand), mounts it copy-on-write, and the sandbox runs its first command,
  which reads one file of the environment;
* **cold**: setup runs (writing the same ``node_modules`` locally, no network),
  is frozen, then the sandbox runs its first command (once per run: a new key).

"First command" is the moment the sandbox's command starts (``date +%s.%N``
inside; the host and the sandbox share a clock). Prints medians and the ratio
frozen/none (target <= 1.10: copy-on-write, never a copy).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from agentbox.backends import get_backend
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.env import EnvStore, prepare_env
from agentbox.gateway import gateway_identity
from agentbox.image import build_default
from agentbox.sandbox import spec_from_boxfile

FIRST = "date +%s.%N; test ! -e node_modules/pkg0/f0 || head -c 1 node_modules/pkg0/f0 >/dev/null"


def _setup_cmd(mb: int, nonce: str) -> str:
    per = max(1, mb * 1024 * 1024 // 2000)
    return (
        "python3 -c 'import os\n"
        f"for i in range(2000):\n"
        f'    d = "node_modules/pkg%d" % (i // 20); os.makedirs(d, exist_ok=True)\n'
        f'    open("%s/f%d" % (d, i % 20), "wb").write(os.urandom({per}))\n'
        f'open("node_modules/.nonce", "w").write("{nonce}")\''
    )


class Bench:
    def __init__(self, settings: Settings, runtime: str) -> None:
        self.settings = settings
        self.backend = get_backend("podman", settings)
        self.runtime = runtime
        self.base = Path(tempfile.mkdtemp(prefix="agentbox-bench-env-", dir="/var/tmp"))
        self.base.chmod(0o711)
        self.keys: set[str] = set()

    def task(self) -> tuple[Path, Path, Path]:
        root = Path(tempfile.mkdtemp(dir=self.base))
        root.chmod(0o711)
        ws, logs = root / "workspace", root / "logs"
        ws.mkdir()
        logs.mkdir()
        (ws / "package.json").write_text('{"name": "bench"}\n')
        (ws / "index.js").write_text("module.exports = 1\n")
        uid = self.settings.sandbox_host_uid
        for p in (ws, ws / "package.json", ws / "index.js"):
            os.chown(p, uid, uid)
        return root, ws, logs

    def box(self, setup_cmd: str | None) -> Boxfile:
        data: dict[str, object] = {"runtime": self.runtime, "resources": {"disk": "2GiB"}}
        if setup_cmd is not None:
            data["setup"] = {"run": [setup_cmd], "inputs": ["package.json"], "deadline": 600}
        return Boxfile.from_dict(data)

    def once(self, setup_cmd: str | None) -> float:
        root, ws, logs = self.task()
        box = self.box(setup_cmd)
        start = time.time()
        plan = None
        mounts: tuple[object, ...] = ()
        try:
            if box.setup is not None:
                plan = prepare_env(
                    self.settings,
                    box,
                    self.backend,
                    task_id=secrets.token_hex(4),
                    task_root=root,
                    workspace=ws,
                    log_dir=logs,
                    labels={},
                    proxy_identity=gateway_identity(self.settings),
                )
                assert not plan.failed, plan.report.output_tail
                self.keys.add(plan.report.key)
                mounts = plan.mounts
            spec = spec_from_boxfile(box, self.settings, workspace=ws)
            spec = spec.replace(mounts=(*spec.mounts, *mounts), deadline=120)
            res = self.backend.run(spec, ["/bin/sh", "-c", FIRST])
            assert res.exit_code == 0, res.stderr[-2000:]
            first = float(res.stdout.decode().split()[0])
            return first - start
        finally:
            if plan is not None:
                plan.release()
            shutil.rmtree(root, ignore_errors=True)

    def close(self) -> None:
        store = EnvStore(self.settings)
        for key in self.keys:
            store.remove(key, force=True)
        shutil.rmtree(self.base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--runtime", default="runc")
    args = ap.parse_args()
    settings = Settings()
    build_default(settings)
    bench = Bench(settings, args.runtime)
    frozen_cmd = _setup_cmd(args.mb, secrets.token_hex(4))
    times: dict[str, list[float]] = {"none": [], "frozen": [], "cold": []}
    try:
        made = bench.once(frozen_cmd)  # the cold setup that freezes the environment
        print(f"froze a {args.mb} MB node_modules in {made:.2f}s (first cold run, not counted)")
        for i in range(args.runs):
            times["none"].append(bench.once(None))
            times["frozen"].append(bench.once(frozen_cmd))
            times["cold"].append(bench.once(_setup_cmd(args.mb, secrets.token_hex(4))))
            print(f"run {i + 1}: " + " ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()))
    finally:
        bench.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nruntime {args.runtime}, node_modules {args.mb} MB, {args.runs} runs (median)")
    print(f"{'way':<8}{'start to first command':>26}{'vs none':>10}")
    for k in ("none", "frozen", "cold"):
        print(f"{k:<8}{med[k]:>25.2f}s{med[k] / med['none']:>9.2f}x")
    print(f"\nfrozen / none = {med['frozen'] / med['none']:.2f}x (target <= 1.10)")


if __name__ == "__main__":
    main()
