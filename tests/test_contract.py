"""One contract for every public call (docs/python-api.md, "Timeouts" and "Errors"), walked from
tables: Mesh, Window / SignalWindow, Agent, AgentConnection, Handle, compat and the C ABI.

- A timeout is None or 0 (the object's timeout), a number > 0, or inf (no limit). A negative
  number, NaN or a non-number raises InvalidArgument naming the call's timeout (compat: its
  FlagcxError with Result.InvalidArgument; C: FLAGCX_MESH_INVALID_ARGUMENT) before anything starts.
- A bad argument type raises InvalidArgument naming the argument.
- Any use after close() raises MeshClosed (compat: Result.InvalidUsage).
Any other exception, or a call that returns, fails the test.

Regressions (0.3): a mesh operation's timeout=None waited without limit where an agent's meant
its timeout; mesh timeouts of 0 were refused; C waits took a negative timeout as no limit;
Handle.wait("5") raised pybind11's TypeError; compat's batch_write_sync took any timeout when the
batch was empty. The agent-only tables (test_agent_timeouts.py, test_agent_types.py,
test_agent_after_close.py) hold the agents' finer cases."""

import ctypes
import math
import threading

import pytest

import flagcx_mesh
from flagcx_mesh import Agent, InvalidArgument, Mesh, MeshClosed, MeshTimeout, compat
from test_agent_timeouts import CALLS as AGENT_CALL_TIMEOUTS, pair  # noqa: F401 (pair: the fixture)

pytestmark = pytest.mark.timeout(120)

BAD_TIMEOUTS = [-1, -0.5, math.nan, -math.inf, "5", b"1", True, [1]]
BAD_IDS = ["-1", "-0.5", "nan", "-inf", "str", "bytes", "bool", "list"]


def _mesh(timeout=10):
    m = Mesh(1, flagcx_mesh.get_unique_id(), 0, timeout=timeout)
    win = m.alloc_window(4096)
    sig = m.signal_window(4)
    return m, win, sig


@pytest.fixture(scope="module")
def mesh():
    m, win, sig = _mesh()
    yield m, win, sig
    m.close()


# (name) -> call(mesh, win, sig, timeout)
MESH_TIMEOUTS = {
    "send": lambda m, w, s, t: m.send(0, b"x", timeout=t),
    "recv": lambda m, w, s, t: m.recv(0, timeout=t),
    "flush": lambda m, w, s, t: m.flush(timeout=t),
    "wait_counter": lambda m, w, s, t: m.wait_counter(0, timeout=t),
    "wait_signal": lambda m, w, s, t: m.wait_signal(0, 0, timeout=t, window=s),
    "SignalWindow.wait": lambda m, w, s, t: s.wait(0, 0, timeout=t),
    "allgather": lambda m, w, s, t: m.allgather(b"x", timeout=t),
    "barrier": lambda m, w, s, t: m.barrier(timeout=t),
}


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=BAD_IDS)
@pytest.mark.parametrize("call", sorted(MESH_TIMEOUTS))
def test_mesh_calls_refuse_a_bad_timeout_naming_it(mesh, call, bad):
    name = call.split(".")[-1] if call != "SignalWindow.wait" else "wait_signal"
    with pytest.raises(InvalidArgument, match=rf"{name}: timeout must be"):
        MESH_TIMEOUTS[call](*mesh, bad)


@pytest.mark.parametrize("good", [None, 0, 5, math.inf], ids=["None", "0", "5", "inf"])
@pytest.mark.parametrize("call", ["flush", "wait_counter", "wait_signal", "SignalWindow.wait", "allgather",
                                  "barrier"])
def test_mesh_calls_take_none_zero_seconds_and_inf(mesh, call, good):
    MESH_TIMEOUTS[call](*mesh, good)


@pytest.mark.parametrize("none", [None, 0], ids=["None", "0"])
def test_none_or_zero_on_a_mesh_wait_is_the_meshs_timeout(none):
    """recv(timeout=None) waited for ever (and 0 was refused): it is the mesh's timeout now."""
    m, _, _ = _mesh(timeout=2)
    raised = []

    def wait():
        try:
            m.recv(0, timeout=none)
        except Exception as e:  # noqa: BLE001 - the test checks which
            raised.append(e)

    try:
        t = threading.Thread(target=wait, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "recv(timeout=None) did not end by the mesh's timeout"
        assert len(raised) == 1 and isinstance(raised[0], MeshTimeout), raised
    finally:
        m.close()


# (name, argument) -> call(mesh, win, sig) with that argument of a wrong type
MESH_TYPES = {
    ("send", "peer"): lambda m, w, s: m.send("0", b"x"),
    ("send", "data"): lambda m, w, s: m.send(0, 12345),
    ("allgather", "data"): lambda m, w, s: m.allgather(5),
    ("recv", "peer"): lambda m, w, s: m.recv("0", timeout=1),
    ("put", "peer"): lambda m, w, s: m.put("0", w, 0, w, 0, 8),
    ("put", "size"): lambda m, w, s: m.put(0, w, 0, w, 0, "8"),
    ("put_signal", "slot"): lambda m, w, s: m.put_signal(0, w, 0, w, 0, 8, "1", signal_window=s),
    ("signal", "value"): lambda m, w, s: m.signal(0, 0, "1", signal_window=s),
    ("get", "dst_off"): lambda m, w, s: m.get(0, w, 0, w, 1.5, 8),
    ("flush", "peer"): lambda m, w, s: m.flush("0"),
    ("wait_counter", "value"): lambda m, w, s: m.wait_counter("1", timeout=1),
    ("read_signal", "slot"): lambda m, w, s: m.read_signal("0", window=s),
    ("wait_signal", "expected"): lambda m, w, s: m.wait_signal(0, "0", timeout=1, window=s),
    ("SignalWindow.read", "slot"): lambda m, w, s: s.read("0"),
    ("alloc_window", "nbytes"): lambda m, w, s: m.alloc_window("64"),
    ("signal_window", "nslots"): lambda m, w, s: m.signal_window("4"),
    ("register_window", "buffer"): lambda m, w, s: m.register_window(b"read-only"),
}


@pytest.mark.parametrize("call,arg", sorted(MESH_TYPES), ids=[f"{c}-{a}" for c, a in sorted(MESH_TYPES)])
def test_mesh_calls_refuse_a_bad_type_naming_the_argument(mesh, call, arg):
    with pytest.raises(InvalidArgument) as e:
        MESH_TYPES[(call, arg)](*mesh)
    assert arg in str(e.value) or (arg == "buffer" and "buffer" in str(e.value).lower()), str(e.value)


MESH_AFTER_CLOSE = {
    "send": lambda m, w, s: m.send(0, b"x"),
    "recv": lambda m, w, s: m.recv(0, timeout=1),
    "put": lambda m, w, s: m.put(0, w, 0, w, 0, 8),
    "put_signal": lambda m, w, s: m.put_signal(0, w, 0, w, 0, 8, 0, signal_window=s),
    "signal": lambda m, w, s: m.signal(0, 0, signal_window=s),
    "get": lambda m, w, s: m.get(0, w, 0, w, 8, 8),
    "batch_put": lambda m, w, s: m.batch_put(0, w, w, [(0, 8, 8)]),
    "flush": lambda m, w, s: m.flush(),
    "read_counter": lambda m, w, s: m.read_counter(),
    "wait_counter": lambda m, w, s: m.wait_counter(0),
    "read_signal": lambda m, w, s: m.read_signal(0, window=s),
    "wait_signal": lambda m, w, s: m.wait_signal(0, 0, window=s),
    "SignalWindow.wait": lambda m, w, s: s.wait(0, 0),
    "allgather": lambda m, w, s: m.allgather(b"x"),
    "barrier": lambda m, w, s: m.barrier(),
    "alloc_window": lambda m, w, s: m.alloc_window(64),
    "register_window": lambda m, w, s: m.register_window(bytearray(64)),
    "signal_window": lambda m, w, s: m.signal_window(1),
}


@pytest.fixture(scope="module")
def closed_mesh():
    m, win, sig = _mesh()
    m.close()
    return m, win, sig


@pytest.mark.parametrize("call", sorted(MESH_AFTER_CLOSE))
def test_every_mesh_call_after_close_raises_closed(closed_mesh, call):
    with pytest.raises(MeshClosed, match="closed"):
        MESH_AFTER_CLOSE[call](*closed_mesh)


# -- agents: every call that takes a timeout, with the types test_agent_timeouts.py leaves out


# test_agent_timeouts.py's calls (its `pair` fixture: two agents, a connection, a region each),
# and the two that take a timeout beside them
AGENT_TIMEOUTS = {
    **AGENT_CALL_TIMEOUTS,
    "deregister": lambda a, b, c, m, t, to: a.deregister(m, to),
    "Region.deregister": lambda a, b, c, m, t, to: m.deregister(to),
}


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=BAD_IDS)
@pytest.mark.parametrize("call", sorted(AGENT_TIMEOUTS))
def test_agent_calls_refuse_a_bad_timeout_naming_it(pair, call, bad):
    with pytest.raises(InvalidArgument, match=r"timeout must be"):
        AGENT_TIMEOUTS[call](*pair, bad)


def test_agent_constructor_refuses_a_bad_timeout():
    for bad in BAD_TIMEOUTS:
        with pytest.raises(InvalidArgument, match="timeout"):
            Agent("contract-c", "s", timeout=bad)


# -- compat: FlagcxError with Result.InvalidArgument naming the timeout, InvalidUsage after destroy


@pytest.fixture(scope="module")
def comm():
    c = compat.comm_init_rank(1, compat.get_unique_id(), 0, timeout=10)
    c.signal_register(64)
    c.one_side_register(bytearray(4096))
    yield c
    c.destroy()


COMPAT_TIMEOUTS = {
    "wait_signal": lambda c, t: c.wait_signal(0, 0, 0, timeout=t),
    "wait_signals": lambda c, t: c.wait_signals([(0, 0)], timeout=t),
    "flush": lambda c, t: c.flush(timeout=t),
    "wait_counter": lambda c, t: c.wait_counter(0, timeout=t),
    "barrier": lambda c, t: c.barrier(timeout=t),
}


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=BAD_IDS)
@pytest.mark.parametrize("call", sorted(COMPAT_TIMEOUTS))
def test_compat_calls_refuse_a_bad_timeout_naming_it(comm, call, bad):
    with pytest.raises(compat.FlagcxError) as e:
        COMPAT_TIMEOUTS[call](comm, bad)
    assert e.value.code == compat.Result.InvalidArgument and "timeout must be" in str(e.value), str(e.value)


@pytest.mark.parametrize("good", [None, 0, 5, math.inf], ids=["None", "0", "5", "inf"])
@pytest.mark.parametrize("call", sorted(COMPAT_TIMEOUTS))
def test_compat_calls_take_none_zero_seconds_and_inf(comm, call, good):
    COMPAT_TIMEOUTS[call](comm, good)


def test_compat_after_destroy_is_invalid_usage():
    c = compat.comm_init_rank(1, compat.get_unique_id(), 0, timeout=10)
    c.signal_register(64)
    c.destroy()
    for name, call in COMPAT_TIMEOUTS.items():
        with pytest.raises(compat.FlagcxError) as e:
            call(c, None)
        assert e.value.code == compat.Result.InvalidUsage, (name, str(e.value))


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=BAD_IDS)
def test_p2p_batch_write_sync_refuses_a_bad_timeout_even_when_empty(bad):
    from flagcx_mesh.compat import p2p

    with p2p.engine_create(secret="s", timeout=10) as a, p2p.engine_create(secret="s", timeout=10) as b:
        b.start_rpc_server()
        conn = a.get_conn(f"{b.host}:{b.get_rpc_port()}")
        with pytest.raises(compat.FlagcxError) as e:
            conn.batch_write_sync([], [], [], timeout=bad)
        assert e.value.code == compat.Result.InvalidArgument and "timeout" in str(e.value), str(e.value)


# -- the C ABI: the same rule through ctypes


class Config(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("contexts", ctypes.c_int), ("timeout_s", ctypes.c_double),
                ("max_inflight", ctypes.c_int)]


@pytest.fixture(scope="module")
def lib():
    lib = ctypes.CDLL(flagcx_mesh.get_library())
    lib.flagcx_mesh_last_error.restype = ctypes.c_char_p
    d, u32, u64, vp = ctypes.c_double, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    lib.flagcx_mesh_barrier.argtypes = [vp, d]
    lib.flagcx_mesh_wait_signal.argtypes = [vp, u32, u64, u64, d]
    lib.flagcx_mesh_wait_signal_on_stream.argtypes = [vp, u32, u64, u64, vp, d]
    lib.flagcx_mesh_flush.argtypes = [vp, ctypes.c_int, d]
    lib.flagcx_mesh_wait_counter.argtypes = [vp, u64, d]
    lib.flagcx_mesh_agent_create.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_char_p, d]
    lib.flagcx_mesh_agent_notification.argtypes = [vp, d, ctypes.c_char_p, ctypes.c_size_t, vp,
                                                   ctypes.POINTER(ctypes.c_size_t)]
    lib.flagcx_mesh_agent_wait_notification.argtypes = [vp, ctypes.c_char_p, vp, ctypes.c_size_t, d, vp,
                                                        ctypes.POINTER(ctypes.c_size_t)]
    lib.flagcx_mesh_agent_destroy.argtypes = [vp]
    return lib


@pytest.fixture(scope="module")
def c_comm(lib):
    uid = ctypes.create_string_buffer(256)
    assert lib.flagcx_mesh_get_unique_id(uid) == 0
    comm = ctypes.c_void_p()
    cfg = Config(ctypes.sizeof(Config), 1, 10.0, 64)
    assert lib.flagcx_mesh_comm_init(ctypes.byref(comm), 1, uid, 0, ctypes.byref(cfg)) == 0
    sig = ctypes.c_uint32()
    assert lib.flagcx_mesh_signal_window(comm, ctypes.c_uint64(1), ctypes.byref(sig)) == 0
    yield comm, sig.value
    lib.flagcx_mesh_comm_destroy(comm)


C_MESH = {
    "flagcx_mesh_barrier": lambda lib, c, s, t: lib.flagcx_mesh_barrier(c, t),
    "flagcx_mesh_wait_signal": lambda lib, c, s, t: lib.flagcx_mesh_wait_signal(c, s, 0, 0, t),
    "flagcx_mesh_flush": lambda lib, c, s, t: lib.flagcx_mesh_flush(c, -1, t),
    "flagcx_mesh_wait_counter": lambda lib, c, s, t: lib.flagcx_mesh_wait_counter(c, 0, t),
}


@pytest.mark.parametrize("bad", [-1.0, -0.5, math.nan, -math.inf], ids=["-1", "-0.5", "nan", "-inf"])
@pytest.mark.parametrize("call", sorted(C_MESH))
def test_c_mesh_calls_refuse_a_negative_or_nan_timeout(lib, c_comm, call, bad):
    assert C_MESH[call](lib, *c_comm, bad) == 1  # FLAGCX_MESH_INVALID_ARGUMENT
    assert b"timeout must be" in lib.flagcx_mesh_last_error(), lib.flagcx_mesh_last_error()


@pytest.mark.parametrize("good", [0.0, 5.0, math.inf], ids=["0", "5", "inf"])
@pytest.mark.parametrize("call", sorted(C_MESH))
def test_c_mesh_calls_take_zero_seconds_and_inf(lib, c_comm, call, good):
    assert C_MESH[call](lib, *c_comm, good) == 0, lib.flagcx_mesh_last_error()


@pytest.fixture(scope="module")
def c_agent(lib):
    agent = ctypes.c_void_p()
    assert lib.flagcx_mesh_agent_create(ctypes.byref(agent), b"contract-c-agent", b"s", 10.0) == 0
    yield agent
    lib.flagcx_mesh_agent_destroy(agent)


C_AGENT = {
    "flagcx_mesh_agent_notification": lambda lib, a, t: lib.flagcx_mesh_agent_notification(
        a, t, ctypes.create_string_buffer(64), 64, ctypes.create_string_buffer(64),
        ctypes.byref(ctypes.c_size_t(64))),
    "flagcx_mesh_agent_wait_notification": lambda lib, a, t: lib.flagcx_mesh_agent_wait_notification(
        a, b"nobody", None, 0, t, ctypes.create_string_buffer(64), ctypes.byref(ctypes.c_size_t(64))),
}


@pytest.mark.parametrize("bad", [-1.0, math.nan, -math.inf], ids=["-1", "nan", "-inf"])
@pytest.mark.parametrize("call", sorted(C_AGENT))
def test_c_agent_calls_refuse_a_negative_or_nan_timeout(lib, c_agent, call, bad):
    assert C_AGENT[call](lib, c_agent, bad) == 1
    assert b"timeout must be" in lib.flagcx_mesh_last_error(), lib.flagcx_mesh_last_error()


@pytest.mark.parametrize("bad", [-1.0, math.nan, -math.inf], ids=["-1", "nan", "-inf"])
def test_c_agent_create_refuses_a_negative_or_nan_timeout(lib, bad):
    agent = ctypes.c_void_p()
    assert lib.flagcx_mesh_agent_create(ctypes.byref(agent), b"contract-c-bad", b"s", bad) == 1
    assert b"timeout" in lib.flagcx_mesh_last_error(), lib.flagcx_mesh_last_error()


def test_the_core_connect_refuses_a_timeout_of_the_wrong_type_in_a_child():
    """The core's connect (Agent.connect's binding) with a str timeout ended the process with
    SIGSEGV in 0.3, where pybind11 refused the argument; run in a child, so that the old crash
    fails this test and not the test run."""
    import subprocess
    import sys

    prog = ("from flagcx_mesh import Agent, InvalidArgument\n"
            "with Agent('core-a', 's', timeout=5) as a, Agent('core-b', 's', timeout=5) as b:\n"
            "    for call in (lambda: a._core.connect(b.metadata(), '5'),\n"
            "                 lambda: a._core.connect_address(b.address, [1])):\n"
            "        try:\n"
            "            call()\n"
            "        except InvalidArgument as e:\n"
            "            print('refused:', e)\n")
    p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert p.stdout.count("refused: connect: timeout must be a number of seconds or None") == 2, p.stdout
