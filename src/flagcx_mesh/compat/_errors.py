"""compat's result codes, its one exception type and the translation of flagcx_mesh errors."""

from __future__ import annotations

import enum
import threading
from typing import Optional

from .. import errors

UNIQUE_ID_BYTES = 256
SLOT_BYTES = 8
_U64 = 1 << 64


class Result(enum.IntEnum):
    """FlagCX's result codes (``flagcxResult_t`` in FlagCX's ``flagcx.h``), with the same values
    (checked one by one against FlagCX 0c721293)."""

    Success = 0
    UnhandledDeviceError = 1
    SystemError = 2
    InternalError = 3
    InvalidArgument = 4
    InvalidUsage = 5
    RemoteError = 6
    InProgress = 7
    UnhandledCCLError = 8
    NotSupported = 9



_DESCRIPTIONS = {
    Result.Success: "no error",
    Result.UnhandledDeviceError: "unhandled device error: a device (GPU) runtime call failed",
    Result.SystemError: "system error: a system call failed (see errno), or memory ran out",
    Result.InternalError: "internal error: a library invariant was broken (please report it)",
    Result.InvalidArgument: "invalid argument: a rank, window index, offset, size or signal offset "
                            "was out of range or malformed; nothing was changed",
    Result.InvalidUsage: "invalid usage: a call out of order (communicator destroyed, signal buffer "
                         "missing or registered twice, window deregistered)",
    Result.RemoteError: "remote error: a peer failed, exited, sent malformed data, or did not join "
                        "a collective in time",
    Result.InProgress: "in progress: the awaited signal, counter or flush had not completed when the "
                       "timeout expired; the operation may still complete, the wait can be retried",
    Result.UnhandledCCLError: "unhandled CCL error: a call into a vendor collective library failed "
                              "(flagcx_mesh itself never returns it)",
    Result.NotSupported: "not supported: the request needs something this build does not provide "
                         "(e.g. device memory)",
}


def get_error_string(code: int) -> str:
    """A description of result ``code`` (any integer; unknown values say so)."""
    try:
        return _DESCRIPTIONS[Result(int(code))]
    except (ValueError, TypeError):
        return f"unknown result code {code!r}: not a flagcxResult_t value (0..{len(Result) - 1})"


class FlagcxError(RuntimeError):
    """The one exception type of this module.

    ``code`` is a :class:`Result`; ``peer`` the rank concerned or -1; ``errno`` the
    operating-system error or 0; ``rank`` the rank that raised it or -1. ``str()``
    is the message followed by the code's name and value.
    """

    def __init__(self, code: int, message: str, *, peer: int = -1, errno: int = 0, rank: int = -1):
        self.code = Result(code)
        self.peer, self.errno, self.rank = peer, errno, rank
        self.message = message
        super().__init__(f"{message} [flagcx{self.code.name} ({int(self.code)})]")

    def __reduce__(self):
        return (_rebuild, (int(self.code), self.message, self.peer, self.errno, self.rank))


def _rebuild(code: int, message: str, peer: int, errno: int, rank: int) -> FlagcxError:
    return FlagcxError(code, message, peer=peer, errno=errno, rank=rank)


# flagcx_mesh error class -> FlagCX code. MeshTimeout depends on the call (see _code_of).
_CODE_OF = (
    (errors.InvalidArgument, Result.InvalidArgument),
    (errors.MeshClosed, Result.InvalidUsage),
    (errors.PeerLost, Result.RemoteError),
    (errors.ProtocolError, Result.RemoteError),
    (errors.SystemCallError, Result.SystemError),
)


def _code_of(e: BaseException, timeout_code: Result) -> Result:
    if isinstance(e, errors.MeshTimeout):
        return timeout_code
    for cls, code in _CODE_OF:
        if isinstance(e, cls):
            return code
    if isinstance(e, (ValueError, TypeError, OverflowError)):
        return Result.InvalidArgument
    if isinstance(e, (MemoryError, OSError)):
        return Result.SystemError
    return Result.InternalError


_last = threading.local()


def get_last_error(comm: Optional["Comm"] = None) -> str:
    """The message of the last failure of ``comm``, or, without one, of the calling thread
    (also failures outside any communicator, such as ``comm_init_rank``); "" if none."""
    if comm is not None:
        return comm.get_last_error()
    return getattr(_last, "text", "")


def _raise(comm: Optional["Comm"], code: Result, message: str, *, peer: int = -1, errno: int = 0,
           cause: Optional[BaseException] = None):
    rank = comm.rank if comm is not None else -1
    err = FlagcxError(code, message, peer=peer, errno=errno, rank=rank)
    _last.text = str(err)
    if comm is not None:
        comm._last_error = str(err)
    raise err from cause


def _translate(comm: Optional["Comm"], e: BaseException, what: str,
               timeout_code: Result = Result.InProgress, rank: Optional[int] = None):
    """Raises the FlagcxError for a flagcx_mesh (or Python) exception ``e`` raised in ``what``.

    The message is "rank R: WHAT: DETAIL"; the rank comes from the comm, else from ``rank``
    (and is taken off the front of the detail, where the core put it)."""
    text = str(e) or type(e).__name__
    code, peer = _code_of(e, timeout_code), getattr(e, "peer", -1)
    rank = comm.rank if comm is not None else rank
    if rank is not None:
        head = f"rank {rank}: "
        what = head + what
        text = text[len(head):] if text.startswith(head) else text
    if comm is not None:
        if code == Result.InvalidArgument and 0 <= peer != comm.rank and "could not register" in text:
            code = Result.RemoteError  # another rank's registration failed, not this rank's arguments
    _raise(comm, code, f"{what}: {text}", peer=peer, errno=getattr(e, "errno", 0) or 0, cause=e)

