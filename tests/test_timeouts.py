"""Build deadlines are checked at every entry point: a negative number, NaN and inf are
refused with InvalidArgument naming the argument or variable.

The rule (docs/python-api.md, "Timeouts"; docs/c-api.md): a build deadline (Mesh timeout,
header_timeout, bootstrap timeouts, the C config's timeout_s, FLAGCX_MESH_TIMEOUT) is None or 0
(FLAGCX_MESH_TIMEOUT) or a finite number > 0. Operations' timeouts (None or 0: the object's,
inf: no limit) are walked call by call in test_contract.py.

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

BAD_BUILD = [-1, math.nan, math.inf, -math.inf]


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


@pytest.mark.parametrize("value", [-1, math.nan, math.inf], ids=str)
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


def test_a_zero_build_deadline_is_the_default():
    """0 means FLAGCX_MESH_TIMEOUT for a build as for every timeout (it was refused)."""
    with Mesh(1, flagcx_mesh.get_unique_id(), 0, timeout=0, header_timeout=0) as m:
        assert m.allgather(b"x", timeout=0) == [b"x"]
