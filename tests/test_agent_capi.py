"""The agents' C ABI (flagcx_mesh_agent_*), through ctypes: two agents, a
batched write with a notification, a read, bad descriptors refused with a
code and a message, short buffers that say the size needed."""

import ctypes

import pytest

import flagcx_mesh

pytestmark = pytest.mark.timeout(60)
OK, INVALID, TIMEOUT = 0, 1, 2
SECRET = b"capi-agent-secret"


class Xfer(ctypes.Structure):
    _fields_ = [("local", ctypes.c_void_p), ("local_len", ctypes.c_size_t), ("local_offset", ctypes.c_uint64),
                ("remote", ctypes.c_void_p), ("remote_len", ctypes.c_size_t), ("remote_offset", ctypes.c_uint64),
                ("size", ctypes.c_uint64)]


@pytest.fixture(scope="module")
def lib():
    L = ctypes.CDLL(flagcx_mesh.get_library())
    p, d, sz, u64 = ctypes.c_void_p, ctypes.c_double, ctypes.c_size_t, ctypes.c_uint64
    sigs = {
        "agent_create": [p, ctypes.c_char_p, ctypes.c_char_p, d], "agent_destroy": [p],
        "agent_metadata": [p, p, p], "agent_register": [p, p, u64, p, p], "agent_deregister": [p, p, sz, d],
        "agent_connect": [p, p, sz, d, p], "agent_conn_release": [p],
        "agent_transfer": [p, ctypes.c_int, p, sz, p, sz, p], "agent_handle_test": [p, p], "agent_handle_size": [p, p, p],
        "agent_handle_wait": [p, d], "agent_handle_free": [p], "agent_notification": [p, d, p, sz, p, p],
    }
    for name, args in sigs.items():
        fn = getattr(L, "flagcx_mesh_" + name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    L.flagcx_mesh_last_error.restype = ctypes.c_char_p
    return L


def err(lib):
    return lib.flagcx_mesh_last_error().decode()


def agent(lib, name):
    a = ctypes.c_void_p()
    assert lib.flagcx_mesh_agent_create(ctypes.byref(a), name, SECRET, 20.0) == OK, err(lib)
    return a


def blob(lib, fn, *args):
    n = ctypes.c_size_t(0)
    assert fn(*args, None, ctypes.byref(n)) == INVALID and n.value > 0  # says the size needed
    assert "are needed" in err(lib)
    buf = ctypes.create_string_buffer(n.value)
    assert fn(*args, buf, ctypes.byref(n)) == OK, err(lib)
    return buf.raw[:n.value]


def register(lib, a, mem):
    n = ctypes.c_size_t(4096)
    desc = ctypes.create_string_buffer(n.value)
    assert lib.flagcx_mesh_agent_register(a, ctypes.addressof(mem), len(mem), desc, ctypes.byref(n)) == OK, err(lib)
    return desc.raw[:n.value]


def xfer(local, loff, remote, roff, size, keep):
    lb, rb = ctypes.create_string_buffer(local, len(local)), ctypes.create_string_buffer(remote, len(remote))
    keep += [lb, rb]
    return Xfer(ctypes.addressof(lb), len(local), loff, ctypes.addressof(rb), len(remote), roff, size)


def test_agents_through_the_c_abi(lib):
    a, b = agent(lib, b"c-initiator"), agent(lib, b"c-target")
    try:
        meta = blob(lib, lib.flagcx_mesh_agent_metadata, b)
        src, dst, back = (ctypes.c_uint8 * 8192)(*(list(range(256)) * 32)), (ctypes.c_uint8 * 8192)(), (ctypes.c_uint8 * 100)()
        ls, rd, lb = register(lib, a, src), register(lib, b, dst), register(lib, a, back)
        conn = ctypes.c_void_p()
        assert lib.flagcx_mesh_agent_connect(a, meta, len(meta), 10.0, ctypes.byref(conn)) == OK, err(lib)
        keep = []
        ops = (Xfer * 2)(xfer(ls, 0, rd, 4096, 100, keep), xfer(ls, 100, rd, 0, 100, keep))
        h = ctypes.c_void_p()
        assert lib.flagcx_mesh_agent_transfer(conn, 0, ops, 2, b"landed", 6, ctypes.byref(h)) == OK, err(lib)
        assert lib.flagcx_mesh_agent_handle_wait(h, 10.0) == OK, err(lib)
        done = ctypes.c_int(0)
        assert lib.flagcx_mesh_agent_handle_test(h, ctypes.byref(done)) == OK and done.value == 1
        nops, nbytes = ctypes.c_size_t(0), ctypes.c_uint64(0)
        assert lib.flagcx_mesh_agent_handle_size(h, ctypes.byref(nops), ctypes.byref(nbytes)) == OK, err(lib)
        assert (nops.value, nbytes.value) == (2, 200)
        assert lib.flagcx_mesh_agent_handle_size(h, None, None) == OK
        assert lib.flagcx_mesh_agent_handle_size(None, None, None) != OK
        lib.flagcx_mesh_agent_handle_free(h)
        assert bytes(dst[4096:4196]) == bytes(src[0:100]) and bytes(dst[0:100]) == bytes(src[100:200])
        peer = ctypes.create_string_buffer(64)
        n, buf = ctypes.c_size_t(64), ctypes.create_string_buffer(64)
        assert lib.flagcx_mesh_agent_notification(b, 10.0, peer, 64, buf, ctypes.byref(n)) == OK, err(lib)
        assert buf.raw[:n.value] == b"landed" and peer.value == b"c-initiator"
        n = ctypes.c_size_t(64)
        assert lib.flagcx_mesh_agent_notification(b, 0.05, peer, 64, buf, ctypes.byref(n)) == TIMEOUT
        rops = (Xfer * 1)(xfer(lb, 0, rd, 4096, 100, keep))
        assert lib.flagcx_mesh_agent_transfer(conn, 1, rops, 1, None, 0, ctypes.byref(h)) == OK, err(lib)
        assert lib.flagcx_mesh_agent_handle_wait(h, 10.0) == OK, err(lib)
        lib.flagcx_mesh_agent_handle_free(h)
        assert bytes(back) == bytes(src[0:100])
        bad = (Xfer * 1)(xfer(ls, 0, rd, 8100, 100, keep))  # past the end of the target's region
        assert lib.flagcx_mesh_agent_transfer(conn, 0, bad, 1, None, 0, ctypes.byref(h)) == INVALID
        assert "out of range" in err(lib) and "flagcx_mesh_agent_transfer" in err(lib)
        junk = (Xfer * 1)(xfer(b"junk", 0, rd, 0, 1, keep))
        assert lib.flagcx_mesh_agent_transfer(conn, 0, junk, 1, None, 0, ctypes.byref(h)) == INVALID
        assert lib.flagcx_mesh_agent_deregister(b, rd, len(rd), 5.0) == OK, err(lib)
        assert lib.flagcx_mesh_agent_deregister(b, rd, len(rd), 5.0) == INVALID and "deregistered" in err(lib)
        assert lib.flagcx_mesh_agent_conn_release(conn) == OK
    finally:
        assert lib.flagcx_mesh_agent_destroy(a) == OK
        assert lib.flagcx_mesh_agent_destroy(b) == OK


def test_create_refuses_bad_input(lib):
    a = ctypes.c_void_p()
    assert lib.flagcx_mesh_agent_create(ctypes.byref(a), b"", SECRET, 0.0) == INVALID and "name" in err(lib)
    assert lib.flagcx_mesh_agent_create(None, b"x", SECRET, 0.0) == INVALID and "agent is NULL" in err(lib)


def test_stream_transfers_and_a_stream_wait_through_the_c_abi():
    """flagcx_mesh_agent_transfer_on_stream and flagcx_mesh_agent_stream_wait_notification on the
    fake CUDA driver, in a process of their own (tests/agent_capi_stream_prog.py): writes and reads
    after a busy stream's work, the stream's later work after the notification, a timeout that
    releases the stream and says so."""
    import os
    import subprocess
    import sys

    import fakecuda
    import gpujobs

    here = os.path.dirname(os.path.abspath(__file__))
    env = gpujobs.job_env(fakecuda.env(), ("FLAGCX_MESH_CUDA_PATH", "FLAGCX_MESH_TRANSPORT", "FXM_FAKECUDA_FAIL"))
    p = subprocess.run([sys.executable, os.path.join(here, "agent_capi_stream_prog.py")], env=env, cwd=here,
                       capture_output=True, text=True, timeout=50)
    assert p.returncode == 0 and "capi stream ok" in p.stdout, p.stdout + p.stderr
