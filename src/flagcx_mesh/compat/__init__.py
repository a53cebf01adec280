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

Signal offsets (``sig_off``) are BYTE offsets into the signal buffer, as in FlagCX:
they must be multiples of 8 and name the 64-bit slot ``sig_off // 8``.
"""

from ._comm import Comm
from ._create import comm_init_from_env, comm_init_rank, get_unique_id
from ._errors import SLOT_BYTES, UNIQUE_ID_BYTES, FlagcxError, Result, get_error_string, get_last_error
from ._errors import _translate  # noqa: F401 - the error mapping, for tests

# flagcxSuccess, flagcxInvalidArgument, ... as module constants, as in the C header.
globals().update({f"flagcx{r.name}": r for r in Result})

__all__ = [
    "Result", "FlagcxError", "Comm", "get_unique_id", "comm_init_rank", "comm_init_from_env",
    "get_error_string", "get_last_error", "UNIQUE_ID_BYTES", "SLOT_BYTES",
] + [f"flagcx{r.name}" for r in Result]
