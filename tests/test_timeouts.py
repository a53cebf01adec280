"""Timeouts are checked at every entry point: <= 0, NaN and (where it does not mean "no
limit") inf are refused with InvalidArgument naming the argument or variable.

The rule (docs/python-api.md, docs/c-api.md): a build deadline (Mesh timeout, header_timeout,
bootstrap timeouts, the C config's timeout_s, FLAGCX_MESH_TIMEOUT) is a finite number > 0
(None / 0 in C: FLAGCX_MESH_TIMEOUT); an operation's timeout in Python is > 0, inf or None
(no limit); in C, <= 0 keeps meaning no limit (or the comm's timeout for a barrier) and NaN
is refused.

Regression: header_timeout <= 0 was accepted (the build then timed out naming "connecting"),
NaN timeouts meant "no limit", and a malformed FLAGCX_MESH_TIMEOUT was silently 60."""

import ctypes
import math
import os
import subprocess
import sys

import pytest

import flagcx_mesh
from flagcx_mesh import Mesh, get_library
from flagcx_mesh.errors import InvalidArgument

pytestmark = pytest.mark.timeout(120)

BAD_BUILD = [0, -1, math.nan, math.inf, -math.inf]
BAD_OP = [0, -1, math.nan, -math.inf]


@pytest.fixture(scope="module")
def mesh():
    m = Mesh(1, flagcx_mesh.get_unique_id(), 0, timeout=20)
    m.signal_window(1)
    yield m
    m.close()


@pytest.mark.parametrize("value", BAD_BUILD, ids=str)
def test_mesh_build_timeout_refused(value):
    with pytest.raises(InvalidArgument, match="timeout"):
        Mesh(1, flagcx_mesh.get_unique_id(), 0, timeout=value)


@pytest.mark.parametrize("value", BAD_BUILD, ids=str)
def test_header_timeout_refused(value):
    uid = flagcx_mesh.get_unique_id()
    try:
        with pytest.raises(InvalidArgument, match="header_timeout"):
            Mesh(1, uid, 0, timeout=5, header_timeout=value)
    finally:
        flagcx_mesh.release_unique_id(uid)


@pytest.mark.parametrize("value", BAD_OP, ids=str)
@pytest.mark.parametrize("op", ["recv", "flush", "wait_counter", "wait_signal", "allgather", "barrier"])
def test_operation_timeout_refused(mesh, op, value):
    calls = {
        "recv": lambda t: mesh.recv(0, timeout=t),
        "flush": lambda t: mesh.flush(timeout=t),
        "wait_counter": lambda t: mesh.wait_counter(0, timeout=t),
        "wait_signal": lambda t: mesh.wait_signal(0, 0, timeout=t),
        "allgather": lambda t: mesh.allgather(b"x", timeout=t),
        "barrier": lambda t: mesh.barrier(timeout=t),
    }
    with pytest.raises(InvalidArgument, match="timeout"):
        calls[op](value)


def test_operation_timeout_inf_means_no_limit(mesh):
    mesh.flush(timeout=math.inf)
    mesh.wait_counter(0, timeout=math.inf)
    mesh.wait_signal(0, 0, timeout=math.inf)
    assert mesh.allgather(b"x", timeout=math.inf) == [b"x"]
    mesh.barrier(timeout=math.inf)
    mesh.send(0, b"y", timeout=math.inf)
    assert mesh.recv(0, timeout=math.inf) == b"y"


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf], ids=str)
def test_bootstrap_timeout_refused(value):
    from flagcx_mesh.bootstrap import unique_id_from_store

    with pytest.raises(InvalidArgument, match="timeout"):
        unique_id_from_store(object(), 0, 1, timeout=value)


class Config(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("contexts", ctypes.c_int), ("timeout_s", ctypes.c_double),
                ("max_inflight", ctypes.c_int)]


@pytest.fixture(scope="module")
def lib():
    lib = ctypes.CDLL(get_library())
    lib.flagcx_mesh_last_error.restype = ctypes.c_char_p
    lib.flagcx_mesh_barrier.argtypes = [ctypes.c_void_p, ctypes.c_double]
    lib.flagcx_mesh_wait_signal.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64,
                                            ctypes.c_double]
    lib.flagcx_mesh_flush.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_double]
    return lib


@pytest.mark.parametrize("value", [-1, math.nan, math.inf], ids=str)
def test_c_config_timeout_refused(lib, value):
    uid = ctypes.create_string_buffer(256)
    assert lib.flagcx_mesh_get_unique_id(uid) == 0
    comm = ctypes.c_void_p()
    cfg = Config(ctypes.sizeof(Config), 1, value, 64)
    try:
        assert lib.flagcx_mesh_comm_init(ctypes.byref(comm), 1, uid, 0, ctypes.byref(cfg)) == 1
        assert b"timeout" in lib.flagcx_mesh_last_error()
    finally:
        lib.flagcx_mesh_release_unique_id(uid, None)


def test_c_nan_timeouts_refused_and_zero_keeps_its_meaning(lib):
    uid = ctypes.create_string_buffer(256)
    assert lib.flagcx_mesh_get_unique_id(uid) == 0
    comm = ctypes.c_void_p()
    cfg = Config(ctypes.sizeof(Config), 1, 20.0, 64)
    assert lib.flagcx_mesh_comm_init(ctypes.byref(comm), 1, uid, 0, ctypes.byref(cfg)) == 0
    try:
        sig = ctypes.c_uint32()
        assert lib.flagcx_mesh_signal_window(comm, ctypes.c_uint64(1), ctypes.byref(sig)) == 0
        assert lib.flagcx_mesh_barrier(comm, math.nan) == 1
        assert b"NaN" in lib.flagcx_mesh_last_error()
        assert lib.flagcx_mesh_wait_signal(comm, sig.value, 0, 0, math.nan) == 1
        assert lib.flagcx_mesh_flush(comm, -1, math.nan) == 1
        assert lib.flagcx_mesh_barrier(comm, 0.0) == 0  # the comm's timeout
        assert lib.flagcx_mesh_flush(comm, -1, 0.0) == 0  # no limit
        assert lib.flagcx_mesh_wait_signal(comm, sig.value, 0, 0, -1.0) == 0
    finally:
        lib.flagcx_mesh_comm_destroy(comm)


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "abc", "5s"])
def test_bad_timeout_env_is_refused(value):
    env = dict(os.environ, FLAGCX_MESH_TIMEOUT=value)
    prog = "import flagcx_mesh; flagcx_mesh.Mesh(1, flagcx_mesh.get_unique_id(), 0)"
    p = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "InvalidArgument" in p.stderr, p.stderr[-2000:]
    assert f"FLAGCX_MESH_TIMEOUT={value}" in p.stderr, p.stderr[-2000:]


def test_good_timeout_env_is_used():
    env = dict(os.environ, FLAGCX_MESH_TIMEOUT="12.5")
    prog = "import flagcx_mesh.bootstrap as b; print(b.default_timeout())"
    p = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "12.5", p.stdout + p.stderr
