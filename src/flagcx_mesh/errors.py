"""The exception hierarchy of flagcx_mesh.

Every failure raised by the library is a :class:`MeshError` carrying

* ``code``  -- a stable integer (the same values as the C API's result codes),
* ``peer``  -- the rank the failure concerns, or ``-1`` when none,
* ``errno`` -- the operating-system error that decided it, or ``0``,
* ``peer_name`` -- the name of the agent the failure concerns, or ``""``
  when none (mesh errors, and agent errors that concern no one peer),

and a message that names the rank, the peer and what was being done.
"""

from __future__ import annotations

import builtins

OK = 0
INVALID_ARGUMENT = 1
TIMEOUT = 2
PEER_LOST = 3
PROTOCOL = 4
SYSTEM = 5
CLOSED = 6
INTERNAL = 7

CODE_NAMES = {
    OK: "ok",
    INVALID_ARGUMENT: "invalid argument",
    TIMEOUT: "timeout",
    PEER_LOST: "peer lost",
    PROTOCOL: "protocol error",
    SYSTEM: "system error",
    CLOSED: "closed",
    INTERNAL: "internal error",
}


class MeshError(RuntimeError):
    """Base class of every flagcx_mesh error."""

    code = INTERNAL

    def __init__(self, message: str, *, code: int | None = None, peer: int = -1, errno: int = 0,
                 peer_name: str = ""):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.peer = peer
        self.errno = errno
        self.peer_name = peer_name

    def __reduce__(self):
        return (_rebuild, (self.code, self.peer, self.errno, str(self), self.peer_name))


class InvalidArgument(MeshError, ValueError):
    """Bad input from the caller; nothing was changed anywhere."""

    code = INVALID_ARGUMENT


class MeshTimeout(MeshError, builtins.TimeoutError):
    """A deadline expired (mesh build, rendezvous, send/recv, collective)."""

    code = TIMEOUT


class PeerLost(MeshError, ConnectionError):
    """A peer, or the rendezvous root, failed or went away."""

    code = PEER_LOST


class ProtocolError(MeshError):
    """Malformed, foreign or inconsistent data on the wire."""

    code = PROTOCOL


class SystemCallError(MeshError, OSError):
    """A system call failed; ``errno`` says which way."""

    code = SYSTEM


class MeshClosed(MeshError):
    """The mesh was used after ``close()``."""

    code = CLOSED


_BY_CODE = {
    INVALID_ARGUMENT: InvalidArgument,
    TIMEOUT: MeshTimeout,
    PEER_LOST: PeerLost,
    PROTOCOL: ProtocolError,
    SYSTEM: SystemCallError,
    CLOSED: MeshClosed,
}


def _from_core(code: int, peer: int, errno: int, message: str, peer_name: str = "") -> MeshError:
    """Builds the exception for an error raised by the C++ core."""
    cls = _BY_CODE.get(code, MeshError)
    return cls(message, code=code, peer=peer, errno=errno, peer_name=peer_name)


def _rebuild(code: int, peer: int, errno: int, message: str, peer_name: str = "") -> MeshError:
    return _from_core(code, peer, errno, message, peer_name)
