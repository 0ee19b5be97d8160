"""Issue 27: a dollar budget is refused at submit for a model with no prices."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.errors import PolicyRefused
from agentbox.gateway.registry import load_registry
from agentbox.launcher._validate import validate
from agentbox.launcher.api import TaskRequest


def _registry(tmp_path: Path) -> Path:
    (tmp_path / "s.yaml").write_text("turns: []\n")
    f = tmp_path / "models.toml"
    f.write_text(
        '[models.free]\nkind = "replay"\nupstream = "s.yaml"\n'
        '[models.paid]\nkind = "replay"\nupstream = "s.yaml"\n'
        "[models.paid.price]\ninput = 1\noutput = 2\n"
    )
    return f


def test_budget_usd_refused_for_a_model_without_prices(tmp_path: Path) -> None:
    reg = load_registry(path=_registry(tmp_path))
    settings = Settings(data_dir=tmp_path / "d", repos_root=tmp_path)
    req = TaskRequest(repo=str(tmp_path), task="t", model="free", budget_usd=1.5)
    with pytest.raises(PolicyRefused, match=r"model 'free' has no price.*\[models\.free\.price\]"):
        validate(req, settings, reg)
