"""The messages a decode and a prefill exchange as agent notifications.

Every message is ``MAGIC + kind (1 byte) + JSON``. Decode -> prefill:

- ``L`` layout: the decode's KV regions (descriptors) and each layer's block geometry; sent
  once per connection, before the first request on it.
- ``W`` want: "push the blocks of your request ``req`` into my blocks ``dst``" (``src``: the
  prefill's block ids the decode was told, ``tag``: the decode's own request id).
- ``A`` ack: the decode saw ``req``'s blocks land; the prefill may free them.
- ``C`` cancel: the decode will not take ``req`` (aborted); the prefill may free it.

Prefill -> decode, after the data of a push (notifications follow the data, in order):

- ``D`` done: every block of ``tag`` landed.
- ``F`` failed: ``tag`` will not be served (``why``: unknown or expired request, layout
  mismatch, ...); the decode reports its blocks as load errors.
"""

from __future__ import annotations

import base64
import json
from typing import Tuple

MAGIC = b"fxkv1"
KINDS = frozenset(b"LWACDF")


class ProtocolViolation(ValueError):
    """A notification that is not one of these messages."""


def encode(kind: str, **fields) -> bytes:
    k = kind.encode()
    if len(k) != 1 or k[0] not in KINDS:
        raise ValueError(f"unknown message kind {kind!r}")
    return MAGIC + k + json.dumps(fields, separators=(",", ":")).encode()


def decode(data: bytes) -> Tuple[str, dict]:
    if not data.startswith(MAGIC) or len(data) <= len(MAGIC):
        raise ProtocolViolation("not a KV transfer message")
    k = data[len(MAGIC)]
    if k not in KINDS:
        raise ProtocolViolation(f"unknown message kind {bytes([k])!r}")
    try:
        fields = json.loads(data[len(MAGIC) + 1:].decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolViolation(f"malformed message body: {e}") from None
    if not isinstance(fields, dict):
        raise ProtocolViolation("a message body must be a JSON object")
    return chr(k), fields


def b64(data: bytes) -> str:
    return base64.b64encode(bytes(data)).decode()


def unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text.encode(), validate=True)
    except (ValueError, AttributeError) as e:
        raise ProtocolViolation(f"bad base64 field: {e}") from None
