"""A task whose submitter is not recorded never gets the launcher's (root's) secrets."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.egress.rules import Inject, NetworkRule
from agentbox.env._egress import rule_secrets
from agentbox.errors import PolicyRefused


def test_an_unknown_owner_is_refused_not_taken_for_root(tmp_path: Path) -> None:
    inject = Inject(header="Authorization", value="Bearer ${secret:TOKEN}")
    rule = NetworkRule(host="pypi.corp.example", inject=inject)
    settings = Settings(data_dir=tmp_path / "data")
    with pytest.raises(PolicyRefused, match="TOKEN"):
        rule_secrets(settings, [rule], None)
    # brokered values given by the host need no owner
    assert rule_secrets(settings, [rule], None, known={"TOKEN": "v"}) == {"TOKEN": "v"}
