"""The agents' stream calls of the C ABI through ctypes, on the fake CUDA driver (run by
tests/test_agent_capi.py in a process of its own): flagcx_mesh_agent_transfer_on_stream writes
and reads ordered after a busy stream's work, flagcx_mesh_agent_stream_wait_notification holds
the stream's later work until the notification came, and releases it at its timeout with
FLAGCX_MESH_TIMEOUT naming the peer. Prints "capi stream ok"."""

import ctypes
import time

import fakecuda
import flagcx_mesh

OK, TIMEOUT = 0, 2
N = 4096


class Xfer(ctypes.Structure):
    _fields_ = [("local", ctypes.c_void_p), ("local_len", ctypes.c_size_t), ("local_offset", ctypes.c_uint64),
                ("remote", ctypes.c_void_p), ("remote_len", ctypes.c_size_t), ("remote_offset", ctypes.c_uint64),
                ("size", ctypes.c_uint64)]


def check(cond, msg):
    if not cond:
        raise SystemExit(f"FAILED: {msg}")


L = ctypes.CDLL(flagcx_mesh.get_library())
p, d, sz, u64 = ctypes.c_void_p, ctypes.c_double, ctypes.c_size_t, ctypes.c_uint64
for name, args in {
    "agent_create": [p, ctypes.c_char_p, ctypes.c_char_p, d], "agent_destroy": [p], "agent_metadata": [p, p, p],
    "agent_register": [p, p, u64, p, p], "agent_connect": [p, p, sz, d, p], "agent_conn_release": [p],
    "agent_transfer": [p, ctypes.c_int, p, sz, p, sz, p],
    "agent_transfer_on_stream": [p, ctypes.c_int, p, sz, p, sz, p, p],
    "agent_stream_wait_notification": [p, p, sz, ctypes.c_char_p, p, d, p],
    "agent_handle_test": [p, p], "agent_handle_wait": [p, d], "agent_handle_free": [p],
    "agent_notification": [p, d, p, sz, p, p],
}.items():
    fn = getattr(L, "flagcx_mesh_" + name)
    fn.argtypes, fn.restype = args, ctypes.c_int
L.flagcx_mesh_last_error.restype = ctypes.c_char_p


def err():
    return L.flagcx_mesh_last_error().decode()


def agent(name):
    a = ctypes.c_void_p()
    check(L.flagcx_mesh_agent_create(ctypes.byref(a), name, b"capi-stream", 20.0) == OK, err())
    return a


def register(a, mem):
    n = ctypes.c_size_t(4096)
    desc = ctypes.create_string_buffer(n.value)
    check(L.flagcx_mesh_agent_register(a, ctypes.addressof(mem), len(mem), desc, ctypes.byref(n)) == OK, err())
    return ctypes.create_string_buffer(desc.raw[:n.value], n.value)


def xfer(local, remote, size):
    return Xfer(ctypes.addressof(local), len(local), 0, ctypes.addressof(remote), len(remote), 0, size)


def done(h):
    flag = ctypes.c_int(-1)
    check(L.flagcx_mesh_agent_handle_test(h, ctypes.byref(flag)) == OK, err())
    return flag.value == 1


def main():
    cu = fakecuda.FakeCuda.get()
    s = cu.stream()
    a, b = agent(b"c-initiator"), agent(b"c-target")
    try:
        n = ctypes.c_size_t(4096)
        meta = ctypes.create_string_buffer(4096)
        check(L.flagcx_mesh_agent_metadata(b, meta, ctypes.byref(n)) == OK, err())
        src, dst, back = (ctypes.c_uint8 * N)(), (ctypes.c_uint8 * N)(), (ctypes.c_uint8 * N)()
        ls, rd, lb = register(a, src), register(b, dst), register(a, back)
        conn = ctypes.c_void_p()
        check(L.flagcx_mesh_agent_connect(a, meta, n.value, 10.0, ctypes.byref(conn)) == OK, err())
        want = bytes((i * 7 + 3) % 251 for i in range(N))

        def fill_src():  # the stream's earlier work: a write not ordered on it copies zeros
            time.sleep(0.3)
            ctypes.memmove(src, want, N)
        cu.launch_host_func(s, fill_src)
        h = ctypes.c_void_p()
        ops = (Xfer * 1)(xfer(ls, rd, N))
        check(L.flagcx_mesh_agent_transfer_on_stream(conn, 0, ops, 1, None, 0, s, ctypes.byref(h)) == OK, err())
        check(L.flagcx_mesh_agent_handle_wait(h, 10.0) == OK, err())
        L.flagcx_mesh_agent_handle_free(h)
        check(bytes(dst) == want, "a write on a stream did not wait for the stream's earlier work")

        def clear_back():  # a read not ordered on the stream is overwritten by this
            time.sleep(0.3)
            ctypes.memset(back, 0xEE, N)
        cu.launch_host_func(s, clear_back)
        rops = (Xfer * 1)(xfer(lb, rd, N))
        check(L.flagcx_mesh_agent_transfer_on_stream(conn, 1, rops, 1, None, 0, s, ctypes.byref(h)) == OK, err())
        check(L.flagcx_mesh_agent_handle_wait(h, 10.0) == OK, err())
        L.flagcx_mesh_agent_handle_free(h)
        check(bytes(back) == want, "a read on a stream landed before the stream's earlier work")

        ran = []
        w = ctypes.c_void_p()
        check(L.flagcx_mesh_agent_stream_wait_notification(b, b"go", 2, None, s, 10.0, ctypes.byref(w)) == OK, err())
        cu.launch_host_func(s, lambda: ran.append(time.monotonic()))
        time.sleep(0.3)
        check(not ran and not done(w), "the stream went on before the notification")
        t0 = time.monotonic()
        check(L.flagcx_mesh_agent_transfer(conn, 0, ops, 1, b"go", 2, ctypes.byref(h)) == OK, err())
        check(L.flagcx_mesh_agent_handle_wait(w, 10.0) == OK, err())
        cu.synchronize(s)
        check(ran and ran[0] >= t0, "the stream's later work did not follow the notification")
        L.flagcx_mesh_agent_handle_free(w)
        L.flagcx_mesh_agent_handle_wait(h, 10.0)
        L.flagcx_mesh_agent_handle_free(h)

        check(L.flagcx_mesh_agent_stream_wait_notification(b, b"never", 5, b"c-initiator", s, 0.3,
                                                           ctypes.byref(w)) == OK, err())
        check(L.flagcx_mesh_agent_handle_wait(w, 0.0) == TIMEOUT, "a wait past its timeout did not say so")
        msg = err()
        check("did not arrive" in msg and "c-initiator" in msg and "flagcx_mesh_agent_handle_wait" in msg, msg)
        check(done(w), "a released wait is not done")
        L.flagcx_mesh_agent_handle_free(w)
        cu.synchronize(s)
        L.flagcx_mesh_agent_conn_release(conn)
    finally:
        check(L.flagcx_mesh_agent_destroy(a) == OK, err())
        check(L.flagcx_mesh_agent_destroy(b) == OK, err())
    print("capi stream ok", flush=True)


if __name__ == "__main__":
    main()
