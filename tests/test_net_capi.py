"""The net-adaptor calls of the C ABI through ctypes against the installed libflagcx_mesh.so:
argument checks and a one-rank build over the own bootstrap and the test adaptor (from
libflagcx_mesh_testing.so, which keeps its own last error)."""

import ctypes as C
import pytest

import flagcx_mesh

import testdoubles

pytestmark = pytest.mark.timeout(30)


NET_V1_FIELDS = [("size", C.c_size_t), ("name", C.c_char_p), ("ctx", C.c_void_p), ("handle_size", C.c_size_t)] + \
                [(f, C.c_void_p) for f in ("listen", "connect", "accept", "close_send", "close_recv",
                                           "close_listen", "isend", "irecv", "test")]


class NetV1(C.Structure):
    """flagcx_mesh 0.2's adaptor layout: no reg_mr/dereg_mr, isend/irecv without mhandle."""
    _fields_ = NET_V1_FIELDS


class Net(C.Structure):
    _fields_ = NET_V1_FIELDS + [("reg_mr", C.c_void_p), ("dereg_mr", C.c_void_p)]


BOOT_V1_FIELDS = [("size", C.c_size_t), ("ctx", C.c_void_p), ("rank", C.c_int), ("nranks", C.c_int),
                  ("allgather", C.c_void_p), ("send", C.c_void_p), ("recv", C.c_void_p)]


class Boot(C.Structure):
    _fields_ = BOOT_V1_FIELDS + [("abort", C.c_void_p)]


class BootV1(C.Structure):
    _fields_ = BOOT_V1_FIELDS


class Config(C.Structure):
    _fields_ = [("size", C.c_size_t), ("builder", C.c_int), ("timeout_s", C.c_double),
                ("wiring_check", C.c_int), ("tag_base", C.c_int)]


ADAPTOR_CONFIG_V1_FIELDS = [("size", C.c_size_t), ("jitter_us", C.c_uint32), ("seed", C.c_uint64),
                            ("carry_bytes", C.c_int), ("self_connect_delay_us", C.c_uint32)]


class AdaptorConfig(C.Structure):
    _fields_ = ADAPTOR_CONFIG_V1_FIELDS + [("mode", C.c_int), ("socks_per_conn", C.c_uint32)]


class AdaptorConfigV1(C.Structure):
    _fields_ = ADAPTOR_CONFIG_V1_FIELDS


class Libs:
    """libflagcx_mesh.so, with the test adaptor's calls from libflagcx_mesh_testing.so."""

    def __init__(self):
        self.main = C.CDLL(flagcx_mesh.get_library())  # the installed package's library
        self.testing = C.CDLL(testdoubles.testing_library())  # the test build's
        self.main.flagcx_mesh_last_error.restype = C.c_char_p
        self.testing.flagcx_mesh_test_last_error.restype = C.c_char_p

    def __getattr__(self, name):
        return getattr(self.testing if name.startswith("flagcx_mesh_test_") else self.main, name)


@pytest.fixture(scope="module")
def lib():
    return Libs()


def last(lib):
    return lib.flagcx_mesh_last_error().decode()


def test_nulls_and_sizes_are_invalid_arguments(lib):
    net, boot, cfg = Net(size=C.sizeof(Net)), Boot(size=C.sizeof(Boot)), Config(C.sizeof(Config), 1, 0.0, 1, 0)
    comms = (C.c_void_p * 1)()
    assert lib.flagcx_mesh_net_build_full_mesh(None, C.byref(boot), C.byref(cfg), comms, comms) == 1
    assert "flagcx_mesh_net_build_full_mesh: net is NULL" in last(lib)
    tc = AdaptorConfig(C.sizeof(AdaptorConfig) - 4, 0, 1, 1, 0)
    assert lib.flagcx_mesh_test_adaptor_create(C.byref(tc), C.byref(net)) == 1
    assert "config->size" in lib.flagcx_mesh_test_last_error().decode()
    tc.size = C.sizeof(AdaptorConfig)
    assert lib.flagcx_mesh_test_adaptor_create(C.byref(tc), C.byref(net)) == 0
    assert lib.flagcx_mesh_test_last_error().decode() == ""
    boot.nranks, boot.rank = 1, 3
    assert lib.flagcx_mesh_net_build_full_mesh(C.byref(net), C.byref(boot), C.byref(cfg), comms, comms) == 1
    assert "out of range" in last(lib) and comms[0] is None
    assert lib.flagcx_mesh_bootstrap_get_ops(None, C.byref(boot)) == 1
    assert lib.flagcx_mesh_test_adaptor_destroy(C.byref(net)) == 0


def test_one_rank_build_over_the_own_bootstrap(lib):
    uid = flagcx_mesh.get_unique_id()  # the rendezvous root runs in this process
    idbuf = C.create_string_buffer(uid, 256)
    b = C.c_void_p()
    assert lib.flagcx_mesh_bootstrap_init(C.byref(b), 1, idbuf, 0, C.c_double(10.0)) == 0, last(lib)
    ops, net = Boot(), Net()
    assert lib.flagcx_mesh_bootstrap_get_ops(b, C.byref(ops)) == 0 and (ops.rank, ops.nranks) == (0, 1)
    tc = AdaptorConfig(C.sizeof(AdaptorConfig), 100, 5, 1, 0)
    assert lib.flagcx_mesh_test_adaptor_create(C.byref(tc), C.byref(net)) == 0
    for builder in (0, 1, 2):
        send, recv = (C.c_void_p * 1)(), (C.c_void_p * 1)()
        cfg = Config(C.sizeof(Config), builder, 5.0, 1, 100 + 4 * builder)
        assert lib.flagcx_mesh_net_build_full_mesh(C.byref(net), C.byref(ops), C.byref(cfg), send, recv) == 0, last(lib)
        assert send[0] and recv[0]
        assert lib.flagcx_mesh_net_close_full_mesh(C.byref(net), 1, send, recv) == 0
        assert send[0] is None and recv[0] is None
    assert lib.flagcx_mesh_test_adaptor_destroy(C.byref(net)) == 0
    assert lib.flagcx_mesh_bootstrap_destroy(b) == 0


def test_struct_sizes_name_both_accepted_layouts(lib):
    """A size between the 0.2 layout and this one is refused, naming both sizes."""
    net, boot = Net(), Boot(size=C.sizeof(Boot), rank=0, nranks=1)
    tc = AdaptorConfig(C.sizeof(AdaptorConfig), 0, 1, 1, 0, 1, 1)
    assert lib.flagcx_mesh_test_adaptor_create(C.byref(tc), C.byref(net)) == 0
    assert net.reg_mr and net.dereg_mr  # IB-strict registers
    cfg, comms = Config(C.sizeof(Config), 1, 1.0, 1, 0), (C.c_void_p * 1)()
    try:
        net.size = C.sizeof(NetV1) + 8
        assert lib.flagcx_mesh_net_build_full_mesh(C.byref(net), C.byref(boot), C.byref(cfg), comms, comms) == 1
        assert f"or {C.sizeof(NetV1)} (FLAGCX_MESH_NET_ADAPTOR_SIZE_V1" in last(lib), last(lib)
        net.size, boot.size = C.sizeof(Net), C.sizeof(BootV1) + 4
        assert lib.flagcx_mesh_net_build_full_mesh(C.byref(net), C.byref(boot), C.byref(cfg), comms, comms) == 1
        assert f"or {C.sizeof(BootV1)} (FLAGCX_MESH_BOOTSTRAP_OPS_SIZE_V1" in last(lib), last(lib)
        net.dereg_mr = None
        boot.size = C.sizeof(Boot)
        assert lib.flagcx_mesh_net_build_full_mesh(C.byref(net), C.byref(boot), C.byref(cfg), comms, comms) == 1
        assert "reg_mr and dereg_mr must be both set" in last(lib), last(lib)
    finally:
        lib.flagcx_mesh_test_adaptor_destroy(C.byref(net))


ISEND_V1 = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.c_void_p, C.c_size_t, C.POINTER(C.c_void_p))
ISEND = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.c_void_p, C.c_size_t, C.c_void_p, C.POINTER(C.c_void_p))


def test_a_0_2_layout_adaptor_and_bootstrap_still_build(lib):
    """An adaptor in the 0.2 layout (size FLAGCX_MESH_NET_ADAPTOR_SIZE_V1, isend/irecv without
    mhandle) and 0.2 bootstrap ops (no abort) build every builder: the library calls the old
    isend/irecv signature for them, never reads past their size."""
    uid = flagcx_mesh.get_unique_id()
    b = C.c_void_p()
    assert lib.flagcx_mesh_bootstrap_init(C.byref(b), 1, C.create_string_buffer(uid, 256), 0, C.c_double(10.0)) == 0
    ops, real = Boot(), Net()
    assert lib.flagcx_mesh_bootstrap_get_ops(b, C.byref(ops)) == 0
    old_ops = BootV1(C.sizeof(BootV1), ops.ctx, ops.rank, ops.nranks, ops.allgather, ops.send, ops.recv)
    tc = AdaptorConfigV1(C.sizeof(AdaptorConfigV1), 0, 5, 1, 0)  # a 0.2 config: mode IB, no registration
    assert lib.flagcx_mesh_test_adaptor_create(C.byref(tc), C.byref(real)) == 0, lib.flagcx_mesh_test_last_error()
    assert not real.reg_mr
    real_isend, real_irecv = ISEND(real.isend), ISEND(real.irecv)
    calls = []

    def forward(fn):
        def call(ctx, comm, data, size, request):
            calls.append(size)
            return fn(ctx, comm, data, size, None, request)
        return ISEND_V1(call)

    isend_v1, irecv_v1 = forward(real_isend), forward(real_irecv)
    old = NetV1(C.sizeof(NetV1), real.name, real.ctx, real.handle_size, real.listen, real.connect, real.accept,
                real.close_send, real.close_recv, real.close_listen,
                C.cast(isend_v1, C.c_void_p), C.cast(irecv_v1, C.c_void_p), real.test)
    try:
        for builder in (0, 1, 2):
            send, recv = (C.c_void_p * 1)(), (C.c_void_p * 1)()
            cfg = Config(C.sizeof(Config), builder, 5.0, 1, 200 + 4 * builder)
            assert lib.flagcx_mesh_net_build_full_mesh(C.byref(old), C.byref(old_ops), C.byref(cfg), send, recv) == 0, \
                last(lib)
            assert lib.flagcx_mesh_net_close_full_mesh(C.byref(old), 1, send, recv) == 0
        # the identity messages (header + its MAC) went through the old calls
        assert calls and all(size == 96 for size in calls)
    finally:
        assert lib.flagcx_mesh_test_adaptor_destroy(C.byref(real)) == 0
        assert lib.flagcx_mesh_bootstrap_destroy(b) == 0


LISTEN = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.POINTER(C.c_void_p))
CONNECT = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.POINTER(C.c_void_p))
ACCEPT = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.POINTER(C.c_void_p))
CLOSE = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p)
TEST = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.POINTER(C.c_int))
REG = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.c_void_p, C.c_size_t, C.POINTER(C.c_void_p))
DEREG = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.c_void_p)


def test_ib_strict_test_adaptor_keeps_ibs_contract(lib):
    """The IB-strict test adaptor behaves as IB does for the builders: an unregistered buffer is
    refused (EFAULT), isend answers NULL ("call again") until the peer posted its irecv, irecv
    answers NULL once per message before posting, and the message then arrives."""
    net = Net()
    tc = AdaptorConfig(C.sizeof(AdaptorConfig), 0, 1, 1, 0, 1, 1)
    assert lib.flagcx_mesh_test_adaptor_create(C.byref(tc), C.byref(net)) == 0
    f = dict(listen=LISTEN(net.listen), connect=CONNECT(net.connect), accept=ACCEPT(net.accept),
             isend=ISEND(net.isend), irecv=ISEND(net.irecv), test=TEST(net.test), reg=REG(net.reg_mr),
             dereg=DEREG(net.dereg_mr), close=CLOSE(net.close_send), close_listen=CLOSE(net.close_listen))
    handle, lc, sc, rc = C.create_string_buffer(net.handle_size), C.c_void_p(), C.c_void_p(), C.c_void_p()
    try:
        assert f["listen"](net.ctx, handle, C.byref(lc)) == 0
        for _ in range(100000):  # a connect completes only once the accept took it
            assert f["connect"](net.ctx, handle, C.byref(sc)) == 0
            if not rc:
                assert f["accept"](net.ctx, lc, C.byref(rc)) == 0
            if sc and rc:
                break
        assert sc and rc
        out, into = C.create_string_buffer(b"x" * 64, 64), C.create_string_buffer(64)
        sreq, rreq, smh, rmh = C.c_void_p(), C.c_void_p(), C.c_void_p(), C.c_void_p()
        assert f["isend"](net.ctx, sc, out, 64, None, C.byref(sreq)) == 14  # EFAULT: not registered
        assert f["reg"](net.ctx, sc, out, 64, C.byref(smh)) == 0 and f["reg"](net.ctx, rc, into, 64, C.byref(rmh)) == 0
        assert f["isend"](net.ctx, sc, C.byref(out, 32), 64, smh, C.byref(sreq)) == 14  # beyond the registration
        assert f["isend"](net.ctx, sc, out, 64, smh, C.byref(sreq)) == 0 and not sreq  # peer has not posted
        assert f["irecv"](net.ctx, rc, into, 64, rmh, C.byref(rreq)) == 0 and not rreq  # NULL once
        assert f["irecv"](net.ctx, rc, into, 64, rmh, C.byref(rreq)) == 0 and rreq
        for _ in range(100000):
            assert f["isend"](net.ctx, sc, out, 64, smh, C.byref(sreq)) == 0
            if sreq:
                break
        assert sreq
        done = C.c_int(0)
        for req in (sreq, rreq):
            done.value = 0
            while not done.value:
                assert f["test"](net.ctx, req, C.byref(done)) == 0
        assert into.raw == out.raw
        assert f["dereg"](net.ctx, sc, smh) == 0 and f["dereg"](net.ctx, rc, rmh) == 0
        assert f["dereg"](net.ctx, rc, rmh) == 22  # twice: EINVAL
        assert f["close"](net.ctx, sc) == 0 and f["close"](net.ctx, rc) == 0 and f["close_listen"](net.ctx, lc) == 0
    finally:
        assert lib.flagcx_mesh_test_adaptor_destroy(C.byref(net)) == 0


def test_get_ops_fills_the_0_2_layout_only(lib):
    """flagcx_mesh_bootstrap_get_ops writes the 0.2 fields and size FLAGCX_MESH_BOOTSTRAP_OPS_SIZE_V1,
    never `abort`: a caller's uninitialised struct must not announce a hook it does not have (a
    watchdog called the garbage pointer: SIGSEGV), and a 0.2 caller's struct ends before it."""
    uid = flagcx_mesh.get_unique_id()
    b = C.c_void_p()
    assert lib.flagcx_mesh_bootstrap_init(C.byref(b), 1, C.create_string_buffer(uid, 256), 0, C.c_double(10.0)) == 0
    try:
        ops = Boot()
        C.memset(C.byref(ops), 0xAB, C.sizeof(ops))  # what an uninitialised stack struct may hold
        assert lib.flagcx_mesh_bootstrap_get_ops(b, C.byref(ops)) == 0
        assert ops.size == C.sizeof(BootV1), ops.size
        assert ops.abort == int.from_bytes(b"\xab" * C.sizeof(C.c_void_p), "little")  # untouched
        assert (ops.rank, ops.nranks) == (0, 1) and ops.allgather and ops.send and ops.recv
    finally:
        assert lib.flagcx_mesh_bootstrap_destroy(b) == 0


ALLGATHER = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.c_size_t, C.c_double)
ABORT = C.CFUNCTYPE(C.c_int, C.c_void_p)


def test_a_build_whose_abort_hook_was_called_fails(lib):
    """The deadline passes while the build is inside a bootstrap allgather, so the watchdog calls
    the abort hook; the allgather then returns successfully anyway. The build must fail (the
    bootstrap may be unusable after its hook): before, it returned OK with the hook called."""
    import time

    uid = flagcx_mesh.get_unique_id()
    b = C.c_void_p()
    assert lib.flagcx_mesh_bootstrap_init(C.byref(b), 1, C.create_string_buffer(uid, 256), 0, C.c_double(10.0)) == 0
    real = Boot()
    assert lib.flagcx_mesh_bootstrap_get_ops(b, C.byref(real)) == 0
    real_allgather, aborts = ALLGATHER(real.allgather), []

    def slow_allgather(ctx, data, size, timeout_s):
        rc = real_allgather(ctx, data, size, C.c_double(10.0))
        time.sleep(1.3)  # past the build's 1 s deadline, then success
        return rc

    def abort(ctx):
        aborts.append(ctx)
        return 0

    allgather_cb, abort_cb = ALLGATHER(slow_allgather), ABORT(abort)
    ops = Boot(C.sizeof(Boot), real.ctx, 0, 1, C.cast(allgather_cb, C.c_void_p), real.send, real.recv,
               C.cast(abort_cb, C.c_void_p))
    net, keep = instant_adaptor()
    try:
        send, recv = (C.c_void_p * 1)(), (C.c_void_p * 1)()
        cfg = Config(C.sizeof(Config), 1, 1.0, 0, 300)  # ordered, no wiring check (no bytes carried)
        rc = lib.flagcx_mesh_net_build_full_mesh(C.byref(net), C.byref(ops), C.byref(cfg), send, recv)
        assert len(aborts) == 1, aborts
        assert rc == 2 and "abort hook was called" in last(lib), (rc, last(lib))
        assert send[0] is None and recv[0] is None  # outputs written only on success
        assert keep["closed"] == 2 and keep["listen_closes"] == 1  # each comm and the listener once
    finally:
        assert lib.flagcx_mesh_bootstrap_destroy(b) == 0


def instant_adaptor(close_listen_rc=0):
    """An adaptor whose listen, connect and accept complete at once and which carries no bytes;
    returns it and the callbacks it needs kept alive (and the count of comms it closed, and of
    close_listen calls, which return close_listen_rc)."""
    keep = {"closed": 0, "listen_closes": 0, "next": 0x1000}

    def close_listen(ctx, comm):
        keep["listen_closes"] += 1
        return close_listen_rc

    def comm_out(out):
        keep["next"] += 16
        out[0] = keep["next"]
        return 0

    def closed(ctx, comm):
        keep["closed"] += 1
        return 0

    keep["cbs"] = cbs = dict(listen=LISTEN(lambda ctx, handle, out: comm_out(out)),
                             connect=CONNECT(lambda ctx, handle, out: comm_out(out)),
                             accept=ACCEPT(lambda ctx, lc, out: comm_out(out)), close=CLOSE(closed),
                             close_listen=CLOSE(close_listen))
    ptr = {k: C.cast(v, C.c_void_p) for k, v in cbs.items()}
    net = Net(C.sizeof(Net), b"instant", None, 16, ptr["listen"], ptr["connect"], ptr["accept"], ptr["close"],
              ptr["close"], ptr["close_listen"], None, None, None, None, None)
    return net, keep


def test_a_failing_close_listen_is_not_called_twice(lib):
    """The build ends by closing its listener; when that close_listen fails, the build fails
    naming it, and nothing closes the listener a second time (before: the cleanup of the failed
    build called close_listen again, a double free on FlagCX's adaptors)."""
    uid = flagcx_mesh.get_unique_id()
    b = C.c_void_p()
    assert lib.flagcx_mesh_bootstrap_init(C.byref(b), 1, C.create_string_buffer(uid, 256), 0, C.c_double(10.0)) == 0
    ops = Boot()
    assert lib.flagcx_mesh_bootstrap_get_ops(b, C.byref(ops)) == 0
    net, keep = instant_adaptor(close_listen_rc=5)
    try:
        send, recv = (C.c_void_p * 1)(), (C.c_void_p * 1)()
        cfg = Config(C.sizeof(Config), 1, 5.0, 0, 400)
        rc = lib.flagcx_mesh_net_build_full_mesh(C.byref(net), C.byref(ops), C.byref(cfg), send, recv)
        assert rc != 0 and "close_listen" in last(lib) and "returned 5" in last(lib), (rc, last(lib))
        assert keep["listen_closes"] == 1, keep["listen_closes"]
        assert keep["closed"] == 2 and send[0] is None and recv[0] is None
    finally:
        assert lib.flagcx_mesh_bootstrap_destroy(b) == 0
