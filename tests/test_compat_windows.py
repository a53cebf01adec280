"""flagcx_mesh.compat: get, barrier and flagcx.h's window/stream forms (comm_window_register,
put_signal_window, signal_peer, wait_signals), ranks as threads, host memory; the comm's
attributes. Device memory: tests/test_gpu_fake.py."""

from __future__ import annotations

import numpy as np
import pytest

from flagcx_mesh import compat as fc
from test_compat import comms, each, refused

pytestmark = pytest.mark.timeout(150)
R = fc.Result


def test_attributes_rank_nranks_mesh():
    cs = comms(3)

    def body(c):
        assert (c.nranks, c.mesh.rank, c.mesh.nranks) == (3, c.rank, 3)
        with pytest.raises(AttributeError):
            c.mesh = None  # read-only
        return c.rank
    assert sorted(each(cs, body)) == [0, 1, 2]


def test_get_pulls_the_peers_bytes_and_checks_both_ranges():
    cs = comms(2)

    def body(c):
        buf = np.full(4096, c.rank + 1, dtype=np.uint8)
        out = np.zeros(4096, dtype=np.uint8)
        src, dst = c.one_side_register(buf), c.one_side_register(out)
        c.barrier()
        peer = 1 - c.rank
        c.get(peer, 1024, 16, 100, src, dst)
        c.flush(timeout=30)
        with refused(R.InvalidArgument, "src_off 4000 + size 200 exceeds window 0 of peer"):
            c.get(peer, 4000, 0, 200, src, dst)
        with refused(R.InvalidArgument, "dst_off 4000 + size 200 exceeds window 1 of rank"):
            c.get(peer, 0, 4000, 200, src, dst)
        c.barrier()
        assert (out[16:116] == peer + 1).all() and not out[:16].any() and not out[116:].any()
        return c.read_counter()
    assert each(cs, body) == [1, 1]  # the refused gets were not issued


def test_barrier_waits_for_every_rank_and_refuses_a_destroyed_comm():
    cs = comms(3)
    order = []

    def body(c):
        if c.rank == 2:
            order.append("late rank arrives")
        c.barrier(stream=None, timeout=30)
        order.append(f"rank {c.rank} passed")
    each(cs, body)
    assert order[0] == "late rank arrives", order
    with refused(R.InvalidUsage, "barrier", "destroyed"):
        cs[0].barrier()


def test_window_forms_signal_the_senders_slot():
    """put_signal_window adds 1 to slot <sender's rank> at the target, after the data; signal_peer
    likewise without data; wait_signals waits per sender (tuples or FlagCX's field names)."""
    cs = comms(3)

    def body(c):
        buf = np.arange(1024, dtype=np.float32) + 1000 * c.rank
        win = c.comm_window_register(buf)
        assert (win.index, win.nbytes, win.flags) == (0, 4096, fc.FLAGCX_WIN_COLL_SYMMETRIC)
        c.signal_register(8 * c.nranks)
        c.barrier()
        if c.rank in (1, 2):  # both write 16 floats from buf[16:] into rank 0's window
            c.put_signal_window(buf[16:], 16, fc.flagcxFloat32, 0, win, 64 * c.rank, 0)
            c.signal_peer(0)
        else:
            c.wait_signals([(2, 1), {"opCnt": 2, "peer": 2}], timeout=30)
            got = [buf[16 * p:16 * p + 16].copy() for p in (1, 2)]
            slots = [c.read_signal(8 * p) for p in range(3)]
        c.barrier()
        if c.rank == 0:
            return slots, [g.tolist() for g in got]
    slots, got = each(cs, body)[0]
    assert slots == [0, 2, 2]
    assert got == [[1000.0 + 16 + i for i in range(16)], [2000.0 + 16 + i for i in range(16)]]


def test_window_forms_refuse_bad_input_naming_it():
    cs = comms(2)

    def body(c):
        with refused(R.InvalidArgument, "win_flags 0 lacks FLAGCX_WIN_COLL_SYMMETRIC"):
            c.comm_window_register(np.zeros(64, np.uint8), fc.FLAGCX_WIN_DEFAULT)
        buf = np.zeros(256, np.uint8)
        win = c.comm_window_register(buf)  # index 0: the refused one took none
        assert win.index == 0
        c.signal_register(16)
        other = np.zeros(64, np.uint8)
        with refused(R.InvalidArgument, "put_signal_window", "is in no registered window of this rank"):
            c.put_signal_window(other, 4, fc.flagcxUint8, 1 - c.rank, win, 0)
        with refused(R.InvalidArgument, "datatype 12 is not a flagcxDataType_t"):
            c.put_signal_window(buf, 4, 12, 1 - c.rank, win, 0)
        with refused(R.InvalidArgument, "exceeds window 0"):
            c.put_signal_window(buf[200:], 8, fc.flagcxInt64, 1 - c.rank, win, 0)
        with refused(R.InvalidArgument, "is not a window from comm_window_register()"):
            c.put_signal_window(buf, 4, fc.flagcxUint8, 1 - c.rank, 0, 0)
        with refused(R.InvalidArgument, "descriptor 0"):
            c.wait_signals([(1,)])
        c.wait_signals([])  # FlagCX: nDesc 0 is a valid no-op
        c.barrier()
        assert c.read_signal(8 * (1 - c.rank)) == 0 and not buf.any()  # nothing was sent
        c.comm_window_deregister(win)
        c.comm_window_deregister(None)
        with refused(R.InvalidUsage, "was deregistered"):
            c.put_signal_window(buf, 4, fc.flagcxUint8, 1 - c.rank, win, 0)
    each(cs, body)


def test_datatype_values_are_flagcx_headers():
    assert [int(getattr(fc, f"flagcx{n}")) for n in ("Int8", "Char", "Uint8", "Int32", "Int", "Uint32", "Int64",
            "Uint64", "Float16", "Half", "Float32", "Float", "Float64", "Double", "Bfloat16")] == \
        [0, 0, 1, 2, 2, 3, 4, 5, 6, 6, 7, 7, 8, 8, 9]
