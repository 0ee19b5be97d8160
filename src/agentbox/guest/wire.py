"""The microVM channel's wire format: frames, the control codec, the nonce proof.

Shared by both ends: the guest agent (:mod:`agentbox.guest.agent`, which runs in
the guest on the image's stdlib ``python3``) imports it as a sibling module from
the initramfs's read-only ``/opt/agentbox/vm``; the host (:mod:`agentbox.backends.microvm`)
imports it from here without pulling in the agent. Like the agent it imports
nothing of agentbox and only builtin C modules at import time (see
tests/integration/test_guest_agent_lean.py).

Wire format (both directions)::

    frame  = type:u8  stream:u32  length:u32  payload[length]     (big endian)
    CTRL   = 1   payload is one JSON object with an "op"
    STDOUT = 2   STDERR = 3   STDIN = 4   GW = 5   FILE = 6
    a zero-length data frame ends that direction of its stream (EOF)

The session built on it is described in :mod:`agentbox.guest.agent`.
"""

from __future__ import annotations

import struct

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only; never imported in the guest
    from collections.abc import Callable

try:  # a builtin in CPython 3.11 (no OpenSSL to load); hashlib elsewhere
    from _sha256 import sha256 as _sha256  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover - depends on the interpreter's build
    from hashlib import sha256 as _sha256

CTRL, STDOUT, STDERR, STDIN, GW, FILE = 1, 2, 3, 4, 5, 6
FRAME_TYPES = frozenset({CTRL, STDOUT, STDERR, STDIN, GW, FILE})
HEADER = struct.Struct(">BII")
#: Largest payload either side accepts; bigger is a protocol violation.
MAX_PAYLOAD = 256 * 1024
#: Largest JSON control payload.
MAX_CTRL = 64 * 1024
#: The label of the data disk (ext4) the host formats and the guest mounts at /data.
DATA_LABEL = "agentbox-data"
#: GW bytes the guest may send on one gateway stream beyond the credit the host
#: granted (the host holds at most this much per stream; see agentbox.guest.agent).
GW_WINDOW = 256 * 1024


class ProtocolError(Exception):
    """A frame that breaks the wire format."""


# ------------------------------------------------------------------ JSON
# The C scanner and string escaper of CPython's ``_json`` (what ``json`` itself
# uses) without importing ``json``. Where this interpreter's ``_json`` differs
# from what the self-test expects, the ``json`` module is used instead.


class _ScanContext:
    strict = True
    object_hook = None
    object_pairs_hook = None
    array_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> object:
        raise ValueError(f"{name} is not valid JSON")


def _dumps_fast(obj: object) -> str:
    if isinstance(obj, str):
        return _escape(obj)
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if isinstance(obj, int):
        return int.__repr__(obj)
    if isinstance(obj, float):
        if obj != obj or obj in (float("inf"), float("-inf")):
            raise ValueError("NaN and infinities are not JSON")
        return float.__repr__(obj)
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join([_dumps_fast(x) for x in obj]) + "]"
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"JSON object keys must be str, not {type(k).__name__}")
            items.append(_escape(k) + ":" + _dumps_fast(v))
        return "{" + ",".join(items) + "}"
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _loads_fast(text: str) -> object:
    try:
        obj, end = _scan(text, 0)  # type: ignore[misc]
    except StopIteration as exc:
        raise ValueError(f"no JSON value at {exc.value}") from None
    if end != len(text):
        raise ValueError(f"extra data at {end}")
    return obj


def _codec() -> tuple[object, object]:
    sample = {"op": "x", "l": [1, -2.5, '\u00e9\n"', True, False, None], "d": {}}
    try:
        import _json

        global _escape, _scan
        _escape = _json.encode_basestring_ascii
        _scan = _json.make_scanner(_ScanContext())  # type: ignore[arg-type]
        if _loads_fast(_dumps_fast(sample)) == sample:
            return _dumps_fast, _loads_fast
    except Exception:  # any mismatch: fall back to the json module
        pass
    import json

    return (
        lambda o: json.dumps(o, separators=(",", ":"), allow_nan=False),
        lambda t: json.loads(t, parse_constant=_ScanContext.parse_constant),
    )


_escape: Callable[[str], str] = str
_scan: Callable[[str, int], tuple[object, int]] | None = None
_dumps, _loads = _codec()


def encode_frame(ftype: int, stream: int, payload: bytes = b"") -> bytes:
    """One frame, header and payload."""
    if ftype not in FRAME_TYPES:
        raise ProtocolError(f"unknown frame type {ftype}")
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(ftype, stream, len(payload)) + payload


def encode_ctrl(msg: dict, stream: int = 0) -> bytes:  # type: ignore[type-arg]
    """A CTRL frame carrying ``msg`` as JSON."""
    data = _dumps(msg).encode()  # type: ignore[operator]
    if len(data) > MAX_CTRL:
        raise ProtocolError("control message too large")
    return encode_frame(CTRL, stream, data)


class FrameReader:
    """Incremental, defensive frame parser: feed bytes, get whole frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """Append ``data``; return the frames it completed. Raises ProtocolError."""
        self._buf += data
        out = []
        while len(self._buf) >= HEADER.size:
            ftype, stream, length = HEADER.unpack_from(self._buf)
            if ftype not in FRAME_TYPES:
                raise ProtocolError(f"unknown frame type {ftype}")
            limit = MAX_CTRL if ftype == CTRL else MAX_PAYLOAD
            if length > limit:
                raise ProtocolError(f"frame of {length} bytes exceeds {limit}")
            if len(self._buf) < HEADER.size + length:
                break
            payload = bytes(self._buf[HEADER.size : HEADER.size + length])
            del self._buf[: HEADER.size + length]
            out.append((ftype, stream, payload))
        return out


def decode_ctrl(payload: bytes) -> dict:  # type: ignore[type-arg]
    """Parse a CTRL payload: a JSON object with a string ``op``."""
    try:
        msg = _loads(payload.decode("utf-8"))  # type: ignore[operator]
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ProtocolError(f"control frame is not JSON: {exc}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("control frame is not an object with an op")
    return msg


def proof(token: str, nonce: str) -> str:
    """What the guest answers to a nonce: HMAC-SHA256(token, nonce), hex.

    RFC 2104 spelled out over ``sha256`` so the guest need not import ``hmac``
    (which loads OpenSSL); tests check it against :mod:`hmac`.
    """
    key = token.encode()
    if len(key) > 64:
        key = _sha256(key).digest()
    key = key.ljust(64, b"\0")
    inner = _sha256(bytes(b ^ 0x36 for b in key) + nonce.encode()).digest()
    return str(_sha256(bytes(b ^ 0x5C for b in key) + inner).hexdigest())
