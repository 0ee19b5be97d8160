"""Value objects of the escape suite: what a probe is, what it saw, and the report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

#: ``pass``: confinement held. ``fail``: the probe found a way out (on a control run
#: that is what we want: the control "fired"). ``n/a``: the probe does not apply to this
#: backend or kernel, said explicitly. ``error``: the probe could not run (counts as fail).
Status = Literal["pass", "fail", "n/a", "error"]
Where = Literal["inside", "host"]
Applies = Literal["all", "container", "vm"]


@dataclass(frozen=True)
class ProbeSpec:
    """One probe: where it runs, what it tries, what confinement looks like, and its control."""

    id: str
    where: Where
    tried: str
    expected: str
    control: str
    """Which weakening of the sandbox makes this probe fire (see ``_controls``)."""
    applies: Applies = "all"
    source: str = ""
    """Which list asked for it: seed A, seed B, the audit tools' union."""


@dataclass(frozen=True)
class Outcome:
    """One probe's result on one sandbox."""

    id: str
    where: Where
    tried: str
    expected: str
    seen: str
    status: Status

    @property
    def fired(self) -> bool:
        """The probe reported a way out (what a positive control must do)."""
        return self.status in ("fail", "error")


@dataclass
class Report:
    """A run of the suite on one backend/runtime (and, with ``controls``, its controls)."""

    backend: str
    runtime: str
    isolation: str
    outcomes: list[Outcome] = field(default_factory=list)
    controls: list[Outcome] = field(default_factory=list)
    """On control runs: ``status`` is ``pass`` when the control *fired* as it must."""
    facts: dict[str, object] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def failures(self) -> list[Outcome]:
        """Probes that failed on the real sandbox, and controls that did not fire."""
        bad = [o for o in self.outcomes if o.status in ("fail", "error")]
        return bad + [c for c in self.controls if c.status in ("fail", "error")]

    @property
    def ok(self) -> bool:
        """Every probe passed (or is explicitly n/a) and every control run fired."""
        return bool(self.outcomes) and not self.failures

    def to_dict(self) -> dict[str, object]:
        """The JSON shape printed by ``agentbox escape-test --json``."""
        counts: dict[str, int] = {}
        for o in self.outcomes:
            counts[o.status] = counts.get(o.status, 0) + 1
        return {
            "backend": self.backend,
            "runtime": self.runtime,
            "isolation": self.isolation,
            "ok": self.ok,
            "seconds": round(self.seconds, 2),
            "counts": counts,
            "probes": [asdict(o) for o in self.outcomes],
            "controls": [asdict(c) for c in self.controls],
            "facts": self.facts,
        }
