"""FlagCX-shaped one-sided API on top of :class:`flagcx_mesh.Mesh`.

This module offers the calls a FlagCX KV connector makes, with FlagCX's argument
order, result codes and semantics, so a connector can switch with a thin shim::

    from flagcx_mesh import compat as fc

    uid = fc.get_unique_id()                       # on one process; send the 256 bytes
    comm = fc.comm_init_rank(nranks, uid, rank)    # collective, blocks until all arrive
    kv = comm.one_side_register(kv_buffer)         # window index = registration order
    comm.signal_register(8 * nslots)               # the signal slots (library memory)
    comm.put_signal(peer, src_off, dst_off, size, sig_off, kv, kv, 1)
    comm.wait_signal(peer, sig_off, expected=1)    # on the target
    comm.destroy()

Every failure raises :class:`FlagcxError` carrying ``.code`` (a :class:`Result`,
FlagCX's ``flagcxResult_t`` value), ``.peer``, ``.errno`` and a message naming the
rank, the call, the peer and the window or slot concerned.

Beside these (the forms FlagCX's Python wrapper binds), the window- and stream-based forms
that ``flagcx.h`` declares: ``comm_window_register``, ``put_signal_window``, ``signal_peer``,
``wait_signals``; and ``get`` and ``barrier``.

Signal offsets (``sig_off``) are BYTE offsets into the signal buffer, as in FlagCX:
they must be multiples of 8 and name the 64-bit slot ``sig_off // 8``.
"""

from ._comm import Comm
from ._create import comm_init_from_env, comm_init_rank, get_unique_id
from ._errors import SLOT_BYTES, UNIQUE_ID_BYTES, FlagcxError, Result, get_error_string, get_last_error
from ._errors import _translate  # noqa: F401 - the error mapping, for tests
from ._windows import FLAGCX_WIN_COLL_SYMMETRIC, FLAGCX_WIN_DEFAULT, CommWindow, DataType

# flagcxSuccess, flagcxInvalidArgument, ... as module constants, as in the C header.
globals().update({f"flagcx{r.name}": r for r in Result})
# flagcxInt8, flagcxFloat16, ... (aliases too: flagcxChar, flagcxHalf, ...).
globals().update({f"flagcx{name}": t for name, t in DataType.__members__.items()})

__all__ = [
    "Result", "FlagcxError", "Comm", "get_unique_id", "comm_init_rank", "comm_init_from_env",
    "get_error_string", "get_last_error", "UNIQUE_ID_BYTES", "SLOT_BYTES",
    "CommWindow", "DataType", "FLAGCX_WIN_DEFAULT", "FLAGCX_WIN_COLL_SYMMETRIC",
] + [f"flagcx{r.name}" for r in Result] + [f"flagcx{name}" for name in DataType.__members__]
