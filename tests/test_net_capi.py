"""The net-adaptor calls of the C ABI through ctypes against the installed libflagcx_mesh.so:
argument checks and a one-rank build over the own bootstrap and the test adaptor (from
libflagcx_mesh_testing.so, which keeps its own last error)."""

import ctypes as C
import pytest

import flagcx_mesh

pytestmark = pytest.mark.timeout(30)


class Net(C.Structure):
    _fields_ = [("size", C.c_size_t), ("name", C.c_char_p), ("ctx", C.c_void_p), ("handle_size", C.c_size_t)] + \
               [(f, C.c_void_p) for f in ("listen", "connect", "accept", "close_send", "close_recv",
                                          "close_listen", "isend", "irecv", "test")]


class Boot(C.Structure):
    _fields_ = [("size", C.c_size_t), ("ctx", C.c_void_p), ("rank", C.c_int), ("nranks", C.c_int),
                ("allgather", C.c_void_p), ("send", C.c_void_p), ("recv", C.c_void_p)]


class Config(C.Structure):
    _fields_ = [("size", C.c_size_t), ("builder", C.c_int), ("timeout_s", C.c_double),
                ("wiring_check", C.c_int), ("tag_base", C.c_int)]


class AdaptorConfig(C.Structure):
    _fields_ = [("size", C.c_size_t), ("jitter_us", C.c_uint32), ("seed", C.c_uint64),
                ("carry_bytes", C.c_int), ("self_connect_delay_us", C.c_uint32)]


class Libs:
    """libflagcx_mesh.so, with the test adaptor's calls from libflagcx_mesh_testing.so."""

    def __init__(self):
        from flagcx_mesh._paths import get_testing_library
        self.main = C.CDLL(flagcx_mesh.get_library())  # the installed package's libraries
        self.testing = C.CDLL(get_testing_library())
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
    tc = AdaptorConfig(C.sizeof(AdaptorConfig) - 8, 0, 1, 1, 0)
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
