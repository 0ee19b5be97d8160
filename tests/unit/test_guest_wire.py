"""The channel's wire format lives in ``agentbox.guest.wire``, shared by both ends.

The host's channel and session import it without the guest agent; the agent
re-exports the same objects (one definition of the frames and codec).
"""

from __future__ import annotations

import json
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from agentbox.guest import agent, wire


def test_host_channel_does_not_import_the_guest_agent() -> None:
    code = (
        "import sys, agentbox.backends.microvm._channel, agentbox.backends.microvm._guest; "
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


# ---------------------------------------------------------------- the fast JSON codec
# The guest parses and writes control frames without the json module (start-up cost);
# these hold its codec to json's, on values and texts hypothesis makes up.


_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


def _same(a: object, b: object) -> bool:
    # json.dumps tells 1 from 1.0 and True from 1, which == does not.
    return json.dumps(a) == json.dumps(b)


@settings(max_examples=400, deadline=None)
@given(_values)
def test_fast_dumps_is_jsons_compact_ascii_output(value: object) -> None:
    want = json.dumps(value, separators=(",", ":"), allow_nan=False)
    assert wire._dumps(value) == want  # type: ignore[operator]


@settings(max_examples=400, deadline=None)
@given(_values, st.booleans(), st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]))
def test_fast_loads_reads_what_json_writes(
    value: object, ascii_only: bool, seps: tuple[str, str]
) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, separators=seps)
    assert _same(wire._loads(text), json.loads(text))  # type: ignore[operator]


@settings(max_examples=600, deadline=None)
@given(st.text(alphabet='{}[]",:0123456789.eE+-truefalsnNI \\u\n\xe9', max_size=40))
def test_fast_loads_accepts_nothing_json_refuses(text: str) -> None:
    try:
        ours = wire._loads(text)  # type: ignore[operator]
    except (ValueError, RecursionError):
        return  # stricter than json is fine (no leading/trailing whitespace, no NaN)
    assert _same(ours, json.loads(text))


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.text(), _values, max_size=4), st.text(min_size=1), st.integers(0, 2**32 - 1)
)
def test_ctrl_frames_round_trip(fields: dict[str, object], op: str, stream: int) -> None:
    msg = {**fields, "op": op}
    try:
        frame = wire.encode_ctrl(msg, stream)
    except wire.ProtocolError:
        return  # over MAX_CTRL: refused on the way out
    [(ftype, got_stream, payload)] = wire.FrameReader().feed(frame)
    assert (ftype, got_stream) == (wire.CTRL, stream)
    assert _same(wire.decode_ctrl(payload), json.loads(payload))
    assert _same(wire.decode_ctrl(payload), msg)


def test_a_hello_without_extra_sockets_imports_no_socket_module() -> None:
    # As the guest runs it (python3 -I -S, the agent's dir on the path): socket and the
    # enum classes it builds cost a cold boot's hello ~0.13 s under TCG.
    guest_dir = str(agent.__file__).rsplit("/", 1)[0]
    code = (
        f"import sys; sys.path.insert(0, {guest_dir!r}); import agent, _agent_streams; "
        "before = 'socket' in sys.modules; _agent_streams.Streams.start_sockets(None, []); "
        "print(before, 'socket' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["False", "False"], out.stderr[-500:]
