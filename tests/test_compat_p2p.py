"""compat.p2p: FlagCX's P2P engine calls (flagcxP2pRpc*) on flagcx_mesh agents.

The connector's sequence in two processes (tests/p2p_prog.py: metadata over a socket, register,
get_conn by host:port, batch write, completion, every byte checked, the refusals with nothing
written), and in one process: adjacent registrations, the table asked again after a later
registration, registration refusals, sessions, a peer that is no engine or answers garbage, a
destroyed engine or peer, and device memory handed to the agent (on the fake CUDA driver)."""

import os
import py_compile
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import fakecuda
from flagcx_mesh import Agent
from flagcx_mesh.compat import FlagcxError, Result
from flagcx_mesh.compat import _p2p_table as table
from flagcx_mesh.compat import p2p

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "p2p_prog.py")
SECRET = "p2p-test-secret"

pytestmark = pytest.mark.timeout(120)


def addr(a: np.ndarray) -> int:
    return a.ctypes.data


@pytest.fixture
def pair():
    """A written-to engine (serving) and a writer, in this process."""
    target = p2p.engine_create(secret=SECRET, timeout=10)
    writer = p2p.engine_create(secret=SECRET, timeout=10)
    target.start_rpc_server()
    yield target, writer
    writer.destroy()
    target.destroy()


def session(engine) -> str:
    return f"{engine.host}:{engine.get_rpc_port()}"


def refused(code, match, call, *args):
    with pytest.raises(FlagcxError, match=match) as e:
        call(*args)
    assert e.value.code == code, e.value
    return e.value


# ---------------------------------------------------------------- the connector's sequence

@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_connector_sequence_two_processes(transport):
    env = dict(os.environ, FLAGCX_MESH_TRANSPORT=transport, FLAGCX_MESH_AGENT_SECRET=SECRET)
    p = subprocess.run([sys.executable, PROG, "pair", "--timeout", "40"], env=env, capture_output=True,
                       text=True, timeout=100)
    assert p.returncode == 0 and "pair: PASS" in p.stdout, p.stdout + p.stderr
    assert "decode: PASS" in p.stdout and "prefill: PASS" in p.stdout, p.stdout


def test_gpu_program_compiles_and_lists_cuda():
    py_compile.compile(PROG, doraise=True)
    out = subprocess.run([sys.executable, PROG, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--device {cpu,cuda}" in out.stdout, out.stdout + out.stderr
    with open(os.path.join(HERE, "..", "scripts", "test-gpu.sh")) as f:
        assert "tests/p2p_prog.py pair --device cuda" in f.read()


# ---------------------------------------------------------------- addresses to regions

def test_write_lands_at_offsets_and_across_adjacent_registrations(pair):
    target, writer = pair
    dst = np.zeros(1 << 16, np.uint8)
    src = (np.arange(1 << 16) % 251).astype(np.uint8)
    half = dst.nbytes // 2
    target.register(addr(dst), half)          # two registrations, one after the other
    target.register(addr(dst) + half, half)
    writer.register(addr(src), 1000)
    writer.register(addr(src) + 1000, src.nbytes - 1000)
    conn = writer.get_conn(session(target))
    assert conn.remote_ranges() == [(addr(dst), half), (addr(dst) + half, half)]
    conn.batch_write_sync([addr(src) + 900, addr(src) + 5], [addr(dst) + half - 300, addr(dst) + 7], [600, 11])
    want = np.zeros_like(dst)
    want[half - 300:half + 300] = src[900:1500]
    want[7:18] = src[5:16]
    assert np.array_equal(dst, want)


def spy_calls(conn, monkeypatch) -> list:
    """Which agent call each batch_write_sync made: 'write_blocks' (the table, read by numpy) or
    'batch_write' (per-entry ops)."""
    calls, agent_conn = [], conn._agent_conn
    for name in ("write_blocks", "batch_write"):
        def spy(*args, _real=getattr(agent_conn, name), _name=name):
            calls.append(_name)
            return _real(*args)
        monkeypatch.setattr(agent_conn, name, spy)
    return calls


def test_a_large_batch_goes_as_one_table(pair, monkeypatch):
    """4096 scattered blocks over two registrations a side (numpy arrays and lists, some entries
    of size 0) go through one write_blocks call; every byte lands where its entry says."""
    target, writer = pair
    block, count = 256, 4096
    dst, src = np.zeros(block * count, np.uint8), np.random.default_rng(5).integers(0, 255, block * count,
                                                                                       dtype=np.uint8)
    half = dst.nbytes // 2
    for engine, buf in ((target, dst), (writer, src)):
        engine.register(addr(buf), half)
        engine.register(addr(buf) + half, half)
    conn = writer.get_conn(session(target))
    calls = spy_calls(conn, monkeypatch)
    perm = np.random.default_rng(6).permutation(count)
    sizes = np.full(count, block, np.uint64)
    sizes[::97] = 0                                   # skipped, whatever their addresses
    conn.batch_write_sync(addr(src) + np.arange(count, dtype=np.uint64) * block,
                          [addr(dst) + int(p) * block for p in perm], sizes)
    assert calls == ["write_blocks"]
    want = np.zeros_like(dst).reshape(count, block)
    moved = sizes > 0
    want[perm[moved]] = src.reshape(count, block)[moved]
    assert np.array_equal(dst.reshape(count, block), want)


def test_a_large_batch_across_registrations_or_outside_them_goes_entry_by_entry(pair, monkeypatch):
    """An entry across two adjacent registrations is split, one outside every registration refuses
    the call (nothing written), one with a negative address is refused naming it: the table path
    leaves each of them to the per-entry checks."""
    target, writer = pair
    dst, src = np.zeros(1 << 16, np.uint8), (np.arange(1 << 16) % 251).astype(np.uint8)
    half = dst.nbytes // 2
    target.register(addr(dst), half)
    target.register(addr(dst) + half, half)
    writer.register(src)
    conn = writer.get_conn(session(target))
    calls = spy_calls(conn, monkeypatch)
    n = 32
    srcs, dsts, sizes = [addr(src) + 64 * i for i in range(n)], [addr(dst) + 64 * i for i in range(n)], [64] * n
    dsts[5] = addr(dst) + half - 10                     # across the two registrations
    conn.batch_write_sync(srcs, dsts, sizes)
    assert calls == ["batch_write"]
    assert np.array_equal(dst[half - 10:half + 54], src[320:384])
    dst[:] = 0
    dsts[5] = addr(dst) + dst.nbytes - 32               # past the end of the peer's memory
    refused(Result.InvalidArgument, "entry 5: dst_va .* nothing was written", conn.batch_write_sync,
            srcs, dsts, sizes)
    refused(Result.InvalidArgument, "entry 3: src_va -1 is not an integer", conn.batch_write_sync,
            srcs[:3] + [-1] + srcs[4:], [addr(dst)] * n, sizes)
    assert dst.sum() == 0


def test_locate_all_matches_pieces():
    """The table's vectorized lookup agrees with the per-entry one on every edge: before the
    first range, at a range's first and last byte, across a gap, past 2^64."""
    spans = [table.Span(1000, 100, b"a"), table.Span(1100, 50, b"b"), table.Span(2000, 10, b"c"),
             table.Span((1 << 64) - 16, 16, b"d")]
    t = table.AddressTable(spans)
    cases = [(999, 1), (1000, 1), (1000, 100), (1000, 101), (1099, 1), (1149, 1), (1150, 1),
             (2000, 10), (2005, 6), ((1 << 64) - 16, 16), ((1 << 64) - 1, 1), ((1 << 64) - 1, 2)]
    for a, n in cases:
        got = t.locate_all(np.array([a], np.uint64), np.array([n], np.uint64))
        one = t.pieces(a, n)
        if one is not None and len(one) == 1:
            assert got is not None, (a, n)
            assert got[0][got[1][0]] is one[0][0] and got[2][0] == one[0][1], (a, n)
        else:
            assert got is None, (a, n)
    assert table.AddressTable().locate_all(np.array([5], np.uint64), np.array([1], np.uint64)) is None


def test_the_call_returns_once_the_bytes_landed(monkeypatch):
    """Over tcp the bytes travel after the call issued them: batch_write_sync returns only once
    the target has them all (FlagCX's "sync")."""
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    target = p2p.engine_create(secret=SECRET, timeout=30)
    writer = p2p.engine_create(secret=SECRET, timeout=30)
    try:
        target.start_rpc_server()
        n = 8 << 20
        dst, src = np.zeros(n, np.uint8), (np.arange(n) % 251).astype(np.uint8)
        target.register(dst)
        writer.register(src)
        conn = writer.get_conn(session(target))
        assert conn._agent_conn.path_to(target.agent._regions[0].descriptor) == "tcp"
        chunk = n // 64
        conn.batch_write_sync([addr(src) + i * chunk for i in range(64)],
                              [addr(dst) + (63 - i) * chunk for i in range(64)], [chunk] * 64)
        assert np.array_equal(dst.reshape(64, chunk)[::-1], src.reshape(64, chunk))
    finally:
        writer.destroy()
        target.destroy()


def test_table_is_asked_again_for_a_later_registration(pair):
    target, writer = pair
    first, later = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    src = np.full(4096, 7, np.uint8)
    target.register(first)
    writer.register(src)
    conn = writer.get_conn(session(target))
    assert len(conn.remote_ranges()) == 1
    target.register(later)
    conn.batch_write_sync([addr(src)], [addr(later) + 100], [50])
    assert (later[100:150] == 7).all() and later[:100].sum() == 0 and later[150:].sum() == 0
    assert len(conn.remote_ranges()) == 2


def test_refused_writes_move_nothing(pair):
    target, writer = pair
    dst, src = np.zeros(8192, np.uint8), np.full(8192, 9, np.uint8)
    target.register(dst)
    writer.register(src)
    conn = writer.get_conn(session(target))
    d, s = addr(dst), addr(src)
    for src_vas, dst_vas, sizes in [([s], [d + 8000], [500]),          # past the end
                                    ([s, s], [d, d + 9000], [64, 64]),  # one good, one outside
                                    ([s + 8100], [d], [200]),           # the source past its end
                                    ([s], [d - 64], [128])]:            # starts before the region
        e = refused(Result.InvalidArgument, "nothing was written", conn.batch_write_sync, src_vas, dst_vas, sizes)
        assert "entry" in str(e)
    refused(Result.InvalidArgument, "lengths do not match", conn.batch_write_sync, [s], [d, d], [1])
    refused(Result.InvalidArgument, "not an integer", conn.batch_write_sync, [s], [-1], [1])
    refused(Result.InvalidArgument, "not an integer", conn.batch_write_sync, [s], [d], [1 << 64])
    assert dst.sum() == 0
    conn.batch_write_sync([], [], [])
    conn.batch_write_sync([1 << 63, 0], [0, (1 << 64) - 1], [0, 0])  # size 0: skipped
    assert dst.sum() == 0


def test_registration_refusals(pair):
    target, _ = pair
    buf = np.zeros(4096, np.uint8)
    mr = target.register(buf)
    assert target.registrations() == [(mr, addr(buf), 4096)]
    refused(Result.InvalidArgument, "overlaps registration", target.register, addr(buf) + 100, 10)
    refused(Result.InvalidArgument, "overlaps registration", target.register_host, addr(buf) - 10, 20)
    refused(Result.InvalidArgument, "no range of memory", target.register, 0, 0)
    refused(Result.InvalidArgument, "no range of memory", target.register, addr(buf), 0)
    refused(Result.InvalidArgument, "must be an int", target.register, addr(buf))
    refused(Result.InvalidArgument, "differs from the buffer", target.register, np.zeros(16, np.uint8), 8)
    refused(Result.InvalidArgument, "read-only", target.register, b"immutable")
    assert target.registrations() == [(mr, addr(buf), 4096)]


# ---------------------------------------------------------------- sessions

def test_get_conn_before_the_server_started_is_refused_naming_why():
    target = p2p.engine_create(secret=SECRET, timeout=10)
    writer = p2p.engine_create(secret=SECRET, timeout=10)
    try:
        refused(Result.RemoteError, "has not started its RPC server", writer.get_conn, session(target))
        target.start_rpc_server()
        conn = writer.get_conn(session(target))
        assert writer.get_conn(session(target)) is conn  # cached per session
        assert conn.remote_ranges() == []
    finally:
        writer.destroy()
        target.destroy()


def test_bad_sessions(pair):
    _, writer = pair
    for bad in ["no-port", ":5", "host:0", "host:http", "host:70000"]:
        refused(Result.InvalidArgument, "session|port", writer.get_conn, bad)
    nobody = Agent("placeholder", SECRET)
    port = nobody.address.rsplit(":", 1)[1]
    nobody.close()
    refused(Result.RemoteError, "Connection refused", writer.get_conn, f"{writer.host}:{port}")


def test_an_agent_that_is_no_engine_times_out():
    writer = p2p.engine_create(secret=SECRET, timeout=1)
    with Agent("silent", SECRET) as silent:
        try:
            refused(Result.RemoteError, "did not answer the region-table request", writer.get_conn, silent.address)
        finally:
            writer.destroy()


def test_a_malformed_table_is_refused():
    writer = p2p.engine_create(secret=SECRET, timeout=10)
    stop = threading.Event()
    with Agent("liar", SECRET) as liar:
        def answer():
            while not stop.is_set():
                for n in liar.notifications(0.1):
                    kind, rid, _ = table.parse(n.data)
                    liar.connection(n.peer).notify(table.MAGIC + table.TABLE + rid + b"\x05\x00\x00\x00")
        t = threading.Thread(target=answer, daemon=True)
        t.start()
        try:
            refused(Result.RemoteError, "malformed region table: the region table is truncated at range 0",
                    writer.get_conn, liar.address)
        finally:
            stop.set()
            t.join(5)
            writer.destroy()


def test_foreign_notifications_are_ignored(pair):
    target, writer = pair
    with Agent("chatty", SECRET) as chatty:
        chatty.connect(target.agent.address).notify(b"not a control message")
        dst, src = np.zeros(64, np.uint8), np.full(64, 3, np.uint8)
        target.register(dst)
        writer.register(src)
        writer.get_conn(session(target)).batch_write_sync([addr(src)], [addr(dst)], [64])
        assert (dst == 3).all()
        for _ in range(50):
            if target.ignored_messages:
                break
            threading.Event().wait(0.05)
        assert target.ignored_messages == 1


def test_destroyed_engine_and_destroyed_peer(pair):
    target, writer = pair
    dst, src = np.zeros(64, np.uint8), np.full(64, 3, np.uint8)
    target.register(dst)
    writer.register(src)
    conn = writer.get_conn(session(target))
    target.destroy()
    refused(Result.RemoteError, "closed|gone|lost", conn.batch_write_sync, [addr(src)], [addr(dst)], [64])
    refused(Result.InvalidUsage, "destroyed", target.register, np.zeros(8, np.uint8))
    refused(Result.InvalidUsage, "destroyed", target.get_rpc_port)
    writer.destroy()
    refused(Result.InvalidUsage, "destroyed", conn.batch_write_sync, [addr(src)], [addr(dst)], [64])
    target.destroy()  # idempotent


def test_a_process_that_never_destroys_its_engine_exits_cleanly():
    """Regression: the dispatcher thread came back from the agent's wait while the interpreter
    finalized (slow finalization: here a __del__ that sleeps; torch's teardown did it too) and
    the process aborted ("terminate called without an active exception", exit 134)."""
    code = textwrap.dedent("""
        import time
        from flagcx_mesh.compat import p2p
        engine = p2p.engine_create(secret="s")
        class SlowTeardown:
            def __del__(self):
                time.sleep(3 * 0.2)
        slow = SlowTeardown()
        print("leaving with the engine alive")
    """)
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "terminate" not in p.stderr, (p.returncode, p.stdout, p.stderr)


def test_library_methods_check_their_handles():
    lib = p2p.P2pLibrary(secret=SECRET)
    refused(Result.InvalidArgument, "not an engine", lib.flagcxP2pGetRpcPort, object())
    refused(Result.InvalidArgument, "not a connection", lib.flagcxP2pBatchWriteSync, object(), [], [], [])
    engine = lib.flagcxP2pEngineCreate()
    try:
        assert lib.flagcxP2pGetRpcPort(engine) == int(engine.agent.address.rsplit(":", 1)[1])
    finally:
        lib.flagcxP2pEngineDestroy(engine)
    assert engine.closed


def test_the_table_codec_refuses_malformed_bytes():
    spans = [table.Span(0x1000, 64, b""), table.Span(0x2000, 8, b"d" * 10)]
    msg = table.encode_table(b"r" * 8, spans)
    kind, rid, payload = table.parse(msg)
    assert (kind, rid) == (table.TABLE, b"r" * 8) and table.decode_table(payload) == spans
    assert table.parse(b"FXP2P\x01Z" + b"r" * 8) is None and table.parse(b"hello") is None
    for bad, why in [(payload[:3], "no count"), (payload + b"x", "stray"), (payload[:-1], "descriptor length"),
                     (b"\xff\xff\xff\x00", "ranges"),
                     (table.encode_table(b"r" * 8, [table.Span((1 << 64) - 8, 64, b"")])[15:], "wraps")]:
        with pytest.raises(ValueError, match=why):
            table.decode_table(bad)


# ---------------------------------------------------------------- device memory

def test_device_memory_goes_to_the_agent_as_device_memory():
    """On the fake CUDA driver: register(device pointer) hands the agent a CUDA array of that
    range, and raises exactly what the agent raises for it; register_host refuses it."""
    code = textwrap.dedent("""
        import fakecuda
        fake = fakecuda.use_in_this_process()
        from flagcx_mesh import _core
        from flagcx_mesh.agent import Agent
        from flagcx_mesh.compat import FlagcxError, Result, p2p
        from flagcx_mesh.compat._p2p_memory import _CudaRange
        ptr = fake.alloc(1 << 16)
        assert _core.device_of(ptr) == 0 and _core.device_of(id(object())) == -1
        engine = p2p.engine_create(secret="s")
        seen = []
        real = Agent.register
        def spy(self, buffer):
            seen.append(buffer)
            return real(self, buffer)
        Agent.register = spy
        try:
            direct = ("ok", real(Agent("direct", "s"), _CudaRange(ptr + 4096, 4096)).size)
        except Exception as e:
            direct = ("raised", type(e).__name__, str(e).split(": register: ")[-1])
        try:
            via = ("ok", engine.registrations()[0][2] if engine.register(ptr + 4096, 4096) >= 0 else None)
        except FlagcxError as e:
            via = ("raised", type(e.__cause__).__name__, str(e.__cause__).split(": register: ")[-1])
        cai = seen[0].__cuda_array_interface__
        assert cai["data"] == (ptr + 4096, False) and cai["shape"] == (4096,), cai
        assert via == direct, (via, direct)
        try:
            engine.register_host(ptr, 4096)
            raise SystemExit("register_host took device memory")
        except FlagcxError as e:
            assert e.code == Result.InvalidArgument and "is device memory" in str(e), e
        print("device:", direct)
    """)
    env = dict(os.environ, **fakecuda.env())
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=HERE, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "device: (" in p.stdout


def engine_host_in_a_new_process(**env_vars) -> str:
    """The host an engine made first in a fresh process listens on (the core reads
    FLAGCX_MESH_IFNAME once per process), with these variables and no FLAGCX_MESH_IFNAME."""
    env = {k: v for k, v in os.environ.items() if k not in ("FLAGCX_MESH_IFNAME", "VLLM_HOST_IP",
                                                            "FLAGCX_SOCKET_IFNAME")}
    env.update(env_vars, FLAGCX_MESH_AGENT_SECRET=SECRET)
    code = "from flagcx_mesh.compat import p2p; e = p2p.engine_create(timeout=5); print(e.host); e.destroy()"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_an_engine_listens_on_the_address_vllm_advertises():
    assert engine_host_in_a_new_process(VLLM_HOST_IP="127.0.0.1") == "127.0.0.1"


def test_an_engine_listens_on_flagcx_socket_ifname():
    assert engine_host_in_a_new_process(FLAGCX_SOCKET_IFNAME="lo") == "127.0.0.1"
    assert engine_host_in_a_new_process(FLAGCX_SOCKET_IFNAME="=lo") == "127.0.0.1"


def test_interface_from_env_order():
    from flagcx_mesh.compat._p2p_engine import interface_from_env

    assert interface_from_env({"FLAGCX_MESH_IFNAME": "eth0", "VLLM_HOST_IP": "10.0.0.1"}) is None
    assert interface_from_env({"VLLM_HOST_IP": "10.0.0.1", "FLAGCX_SOCKET_IFNAME": "eth1"}) == "10.0.0.1"
    assert interface_from_env({"FLAGCX_SOCKET_IFNAME": "eth1,eth2"}) == "eth1"
    assert interface_from_env({"FLAGCX_SOCKET_IFNAME": "^docker"}) is None
    assert interface_from_env({}) is None


def test_no_secret_is_explained_in_one_line(monkeypatch):
    monkeypatch.delenv("FLAGCX_MESH_AGENT_SECRET", raising=False)
    with pytest.raises(FlagcxError) as e:
        p2p.engine_create(timeout=5)
    text = str(e.value)
    assert "\n" not in text and "FLAGCX_MESH_AGENT_SECRET" in text and "FlagCX's engines need none" in text, text
