"""The fake backend's detached sandboxes: ``launch``, ``follow``, ``adoptable``, in process.

Faithful to the podman backend's contract where a test above the backend can
tell: a launched sandbox runs its :class:`~agentbox.backends.fake.FakeScript` on
a thread of its own (no caller attached), writes its output to the caller's log
in conmon's ``k8s-file`` format (the same reader reads it back), honours its
deadline without anyone following, and is found again by *another*
``FakeBackend`` built on the same data dir: that is how a launcher restart is
simulated in unit tests. Its record lives in ``data_dir/fake-detached/<name>.json``
(labels, the process that hosts it); a backend of another data dir finds no
record and refuses it, and a record whose hosting process is not this one is a
sandbox that died with that process.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from agentbox.backends._k8slog import LogReader, format_output, read_exit, write_exit
from agentbox.backends.base import (
    LABEL,
    OWNER_DATA_LABEL,
    Exited,
    OutputCallback,
    SandboxSpec,
    data_dir_label,
)
from agentbox.config import Settings
from agentbox.errors import ConfigError, SandboxError, SandboxGone

if TYPE_CHECKING:
    from agentbox.backends.fake import FakeSandbox


class FakeDetached:
    """Mixed into :class:`~agentbox.backends.fake.FakeBackend`: the detached verbs."""

    settings: Settings

    if TYPE_CHECKING:

        def check(self, spec: SandboxSpec) -> None: ...

    def _records(self) -> Path:
        return self.settings.data_dir / "fake-detached"

    def _record(self, name: str) -> dict[str, object] | None:
        try:
            rec = json.loads((self._records() / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) else None

    def _drop_record(self, name: str) -> None:
        (self._records() / f"{name}.json").unlink(missing_ok=True)

    def _hosted(self, name: str) -> FakeSandbox | None:
        """The live sandbox behind this data dir's record ``name``, if it lives here."""
        from agentbox.backends.fake import FakeBackend

        rec = self._record(name)
        if rec is None or rec.get("pid") != os.getpid():
            return None
        box = FakeBackend.live(name)
        return box if box is not None and box.detached else None

    def detaches(self, runtime: str) -> bool:
        """True: a fake sandbox can run with no caller attached (on its own thread)."""
        del runtime
        return True

    def launch(self, spec: SandboxSpec, argv: Sequence[str], *, log: Path) -> None:
        """Start the script on a thread of its own, its output going to ``log``."""
        from agentbox.backends.fake import FakeBackend, FakeSandbox

        if not argv:
            raise ConfigError("launch needs a command")
        if not log.is_absolute() or not log.parent.is_dir():
            raise ConfigError(f"the sandbox log must be an absolute path in a directory: {log}")
        script = FakeBackend.script_for(spec.name)
        self.check(spec)
        script.raise_if("launch", spec.name)
        labels = {
            LABEL: "1",
            **spec.labels,
            OWNER_DATA_LABEL: data_dir_label(self.settings.data_dir),
        }
        box = FakeSandbox(cast("FakeBackend", self), spec.replace(labels=labels), script)
        box.detached = True
        with FakeBackend._lock:
            if spec.name in FakeBackend._live:
                raise SandboxError("a sandbox of that name is live", sandbox=spec.name)
            FakeBackend._live[spec.name] = box
            FakeBackend.events.append(("launch", spec.name))
        self._records().mkdir(parents=True, exist_ok=True)
        rec = {"labels": labels, "pid": os.getpid(), "log": str(log)}
        (self._records() / f"{spec.name}.json").write_text(json.dumps(rec))
        for stale in (log, log.with_name(log.name + ".exit")):
            stale.unlink(missing_ok=True)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        lock = threading.Lock()

        def sink(stream: str) -> OutputCallback:
            def write(data: bytes) -> None:
                with lock:
                    os.write(fd, format_output(stream, data))

            return write

        def main() -> None:
            try:
                res = box.exec(argv, on_stdout=sink("stdout"), on_stderr=sink("stderr"))
                box.exited = Exited(res.exit_code, res.timed_out)
            except Exception:  # a scripted failure of exec: the sandbox died
                box.exited = Exited(-1, False)
            finally:
                os.close(fd)
                box.done.set()

        threading.Thread(target=main, name=f"fake-{spec.name}", daemon=True).start()

    def follow(
        self,
        name: str,
        *,
        log: Path,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        poll: float = 0.2,
    ) -> Exited:
        """Stream ``log`` from its start until the sandbox ended; then remove it."""
        from agentbox.backends.fake import FakeBackend

        FakeBackend.script_for(name).raise_if("follow", name)
        FakeBackend.record("follow", name)
        box = self._hosted(name)
        if box is None:
            ended = read_exit(log)
            self._drop_record(name)
            if ended is None:
                raise SandboxGone("no such detached sandbox", sandbox=name)
            with LogReader(log, on_stdout, on_stderr) as reader:
                reader.pump()
            return ended
        with LogReader(log, on_stdout, on_stderr) as reader:
            while not box.done.is_set():
                reader.pump()
                box.done.wait(poll)
            reader.pump()
        assert box.exited is not None
        write_exit(log, box.exited)
        FakeBackend.forget(box)
        self._drop_record(name)
        return box.exited

    def adoptable(self, name: str, *, labels: Mapping[str, str]) -> bool:
        """Whether ``name`` is a sandbox this data dir launched that is still here
        (running or exited, not followed to its end) and carries ``labels``."""
        box = self._hosted(name)
        if box is None:
            return False
        have = box.spec.labels
        return have.get(OWNER_DATA_LABEL) == data_dir_label(self.settings.data_dir) and all(
            have.get(k) == v for k, v in labels.items()
        )

    def detached_names(self) -> list[str]:
        """Sandboxes launched under this data dir that still live in this process."""
        try:
            names = [p.stem for p in self._records().glob("*.json")]
        except OSError:
            return []
        return sorted(n for n in names if self._hosted(n) is not None)
