"""The messages a decode and a prefill exchange as agent notifications.

Every message is ``MAGIC + kind (1 byte) + JSON``. Decode -> prefill:

- ``L`` layout: the decode's KV regions (descriptors) and each layer's block geometry; sent
  once per connection, before the first request on it.
- ``W`` want: "push the blocks of your request ``req`` into my blocks ``dst``" (``src``: the
  prefill's block ids the decode was told, ``tag``: the decode's own request id; ``part``, where
  the two sides run another tensor-parallel size: ``[si, sn, di, dn]``, slice ``si`` of ``sn``
  of each of your blocks' heads into slice ``di`` of ``dn`` of mine; ``readers``: how many decode
  agents read this request from you, each acknowledging its own; ``groups``, where the model has
  several KV cache groups: how many of ``dst`` are each group's, in order; ``n``: this fetch's
  nonce, an integer >= 0 unique per fetch of the decode agent, echoed in the answer).
- ``w`` want, binary (after a prefill's layout that carried ``w``): the same want, laid out for
  the prefill's core to serve without its Python thread (csrc/agent/want.h: the request id, the
  exact ``D`` the decode awaits, which the prefill sends back as it is, ``part``, ``readers``, the
  groups' counts and ``dst`` as 64-bit integers). Decoded here into a ``W``'s fields (``tag`` and
  ``n`` read from its ``D``); one the core did not serve comes to the transfer thread as any ``W``.
- ``A`` ack: the decode saw ``req``'s blocks land; the prefill may free them (``readers``, where
  the decode read them itself: how many decode agents read this request, each acknowledging its
  own, as a want's ``readers``).
- ``C`` cancel: the decode will not take ``req`` (aborted); the prefill may free it.

Prefill -> decode:

- ``L`` layout: the prefill's own, once per connection, in answer to the decode's (with it the
  decode may read blocks itself: transfer.py). Either side's layout may carry ``w`` (1: it takes
  binary wants); a decode sends ``w`` only to a prefill whose layout said so, ``W`` otherwise.

After the data of a push (notifications follow the data, in order):

- ``D`` done: every block of ``tag`` landed.
- ``F`` failed: ``tag`` will not be served (``why``: unknown, expired or released request, also
  one released while the want awaited the prefill's hold, layout mismatch, ...); the decode
  reports its blocks as load errors.

Both carry the want's ``n`` where it had one. The decode takes an answer that carries ``n`` only
for the fetch of ``tag`` whose want carried that ``n`` (a late answer to an earlier fetch of the
same ``tag``, one the decode gave up on, is dropped); one without ``n`` (from a prefill of before
the nonce, which ignores the field in the want) is matched by ``tag`` alone, as before. A decode
of before the nonce sends none, and is answered without it.

:func:`decode` takes any bytes a peer may send: whatever is not one of these messages with
fields of the right types (too long, not UTF-8, not JSON, nested too deep, a number that is
not an integer, an integer of more than 20 digits, a missing or mistyped field) raises
:class:`ProtocolViolation` and nothing else.
"""

from __future__ import annotations

import base64
import json
from typing import Tuple

from .. import _core

MAGIC = b"fxkv1"
KINDS = frozenset(b"LWACDF")
MAX_MESSAGE_BYTES = 4 << 20  # a layout of hundreds of layers is tens of KiB; a want of 100k blocks 0.7 MiB
MAX_INT_DIGITS = 20          # every integer of a message fits 64 bits
MAX_ID_CHARS = 4096          # a request id or tag (vLLM's are tens of characters)
_INT_LIMIT = 10 ** MAX_INT_DIGITS

# The fields each kind must carry, and those it may carry (more are ignored): "str" (an id: at
# most MAX_ID_CHARS), "text" (a string), "ints" (a list of integers >= 0), "strs" (a list of
# strings), "lists" (a list of lists), "count" (an integer >= 0).
FIELDS = {
    "L": {"regions": "strs", "layers": "lists"},
    "W": {"req": "str", "tag": "str", "dst": "ints"},
    "A": {"req": "str"},
    "C": {"req": "str"},
    "D": {"tag": "str"},
    "F": {"tag": "str"},
}
OPTIONAL = {"L": {"w": "count"}, "W": {"src": "ints", "part": "ints", "groups": "ints", "readers": "count", "n": "count"},
            "A": {"readers": "count"}, "D": {"n": "count"}, "F": {"why": "text", "n": "count"}}
WHAT = {"str": f"a string of at most {MAX_ID_CHARS} characters", "text": "a string", "ints": "a list of integers >= 0", "strs": "a list of strings", "lists": "a list of lists", "count": "an integer >= 0"}


class ProtocolViolation(ValueError):
    """A notification that is not one of these messages."""


def encode(kind: str, **fields) -> bytes:
    k = kind.encode()
    if len(k) != 1 or k[0] not in KINDS:
        raise ValueError(f"unknown message kind {kind!r}")
    return MAGIC + k + json.dumps(fields, separators=(",", ":")).encode()


WANT_PREFIX = bytes(_core.WANT_PREFIX)  # MAGIC + "w": a binary want (csrc/agent/want.h)
assert WANT_PREFIX == MAGIC + b"w"


def encode_want(want: dict, answer: bytes) -> bytes:
    """The binary form (``w``) of a ``W``'s fields, with ``answer``: the ``D`` its push is
    answered with (encode("D", ...) of the want's tag and nonce), which the prefill sends back."""
    dst = want["dst"]
    return bytes(_core._encode_want(want["req"], answer, tuple(want.get("part", (0, 1, 0, 1))),
                                    want.get("readers", 0), list(want.get("groups", [len(dst)])), dst))


def _decode_want(data: bytes) -> dict:
    """A binary want's fields, as a ``W``'s (ProtocolViolation for anything that is not one)."""
    try:
        req, answer, part, readers, counts, dst = _core._parse_want(bytes(data))
    except ValueError as e:
        raise ProtocolViolation(f"a malformed w message: {str(e)[:200]}") from None
    kind, named = decode(answer)
    if kind != "D" or len(req) > MAX_ID_CHARS:
        raise ProtocolViolation("a w message whose answer is not a D" if kind != "D" else
                                f"a w message whose 'req' is not {WHAT['str']}")
    f = dict(req=req, tag=named["tag"], dst=list(dst), part=list(part), groups=list(counts))
    if "n" in named:
        f["n"] = named["n"]
    if readers:
        f["readers"] = readers
    return f


def _no_float(text: str):
    raise ProtocolViolation(f"a number that is not an integer ({text[:24]})")


def _long_int(v) -> bool:
    """Whether a parsed message holds an integer of more than MAX_INT_DIGITS digits anywhere
    (checked after parsing, lists of numbers at C speed: a hook per integer in the parser cost
    ~0.2 ms for a want of 512 blocks; Python's own limit on digits bounds the parse)."""
    t = type(v)
    if t is int:
        return not -_INT_LIMIT < v < _INT_LIMIT
    if t is list:
        try:
            return bool(v) and (max(v) >= _INT_LIMIT or min(v) <= -_INT_LIMIT)
        except TypeError:  # not all numbers
            return any(_long_int(x) for x in v)
    if t is dict:
        return any(_long_int(x) for x in v.values())
    return False


def is_count(v) -> bool:
    """An integer >= 0 (not a bool)."""
    return type(v) is int and v >= 0


def _counts(v) -> bool:
    """A list of integers >= 0 (no bools), checked at C speed (a want names hundreds of blocks)."""
    return isinstance(v, list) and (not v or (set(map(type, v)) == {int} and min(v) >= 0))


def _fits(v, want: str) -> bool:
    if want == "count":
        return is_count(v)
    if want in ("str", "text"):
        return isinstance(v, str) and (want == "text" or len(v) <= MAX_ID_CHARS)
    if want == "ints":
        return _counts(v)
    return isinstance(v, list) and all(
        is_count(x) if want == "ints" else isinstance(x, str if want == "strs" else list) for x in v)


def _check(kind: str, fields: dict) -> None:
    for name, want in FIELDS[kind].items():
        if name not in fields:
            raise ProtocolViolation(f"a {kind} message without {name!r}")
        if not _fits(fields[name], want):
            raise ProtocolViolation(f"a {kind} message whose {name!r} is not {WHAT[want]}")
    for name, want in OPTIONAL.get(kind, {}).items():
        if name in fields and not _fits(fields[name], want):
            raise ProtocolViolation(f"a {kind} message whose {name!r} is not {WHAT[want]}")


def decode(data: bytes) -> Tuple[str, dict]:
    """(kind, fields) of a message; ProtocolViolation for anything else (see the module)."""
    if not isinstance(data, (bytes, bytearray)) or not data.startswith(MAGIC) or len(data) <= len(MAGIC):
        raise ProtocolViolation("not a KV transfer message")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolViolation(f"a message of {len(data)} bytes (at most {MAX_MESSAGE_BYTES})")
    k = data[len(MAGIC)]
    if data.startswith(WANT_PREFIX):
        return "W", _decode_want(data)
    if k not in KINDS:
        raise ProtocolViolation(f"unknown message kind {bytes([k])!r}")
    try:
        fields = json.loads(bytes(data[len(MAGIC) + 1:]).decode(), parse_float=_no_float, parse_constant=_no_float)
        if _long_int(fields):
            raise ProtocolViolation(f"an integer of more than {MAX_INT_DIGITS} digits")
    except ProtocolViolation:
        raise
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolViolation(f"malformed message body: {str(e)[:200]}") from None
    except RecursionError:
        raise ProtocolViolation("malformed message body: nested too deep") from None
    except Exception as e:  # noqa: BLE001 - whatever else the parser may raise on a peer's bytes
        raise ProtocolViolation(f"malformed message body: {type(e).__name__}") from None
    if not isinstance(fields, dict):
        raise ProtocolViolation("a message body must be a JSON object")
    _check(chr(k), fields)
    return chr(k), fields


def b64(data: bytes) -> str:
    return base64.b64encode(bytes(data)).decode()


def unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text.encode(), validate=True)
    except (ValueError, AttributeError) as e:
        raise ProtocolViolation(f"bad base64 field: {e}") from None
