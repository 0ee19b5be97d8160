"""The channel's wire format lives in ``agentbox.guest.wire``, shared by both ends.

The host's channel and session import it without the guest agent; the agent
re-exports the same objects (one definition of the frames and codec).
"""

from __future__ import annotations

import subprocess
import sys

from agentbox.guest import agent, wire


def test_host_channel_does_not_import_the_guest_agent() -> None:
    code = (
        "import sys, agentbox.microvm._channel, agentbox.microvm._guest; "
        "print('agentbox.guest.agent' in sys.modules, 'agentbox.guest.wire' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert out == ["False", "True"]


def test_the_agent_uses_the_same_wire_objects() -> None:
    for name in ("CTRL", "GW_WINDOW", "MAX_PAYLOAD", "FrameReader", "ProtocolError", "proof",
                 "encode_frame", "encode_ctrl", "decode_ctrl"):  # fmt: skip
        assert getattr(agent, name) is getattr(wire, name), name
    frame = agent.encode_ctrl({"op": "ready"}, 3)
    assert wire.FrameReader().feed(frame) == [(wire.CTRL, 3, b'{"op":"ready"}')]
