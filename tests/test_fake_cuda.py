"""The fake CUDA driver (libflagcx_mesh_fakecuda.so) does what docs/testing.md says it does:
device memory the CPU cannot touch, legacy IPC and VMM fds across processes, ordered streams,
injected failures. The library's GPU-path tests stand on it, so it is tested on its own here."""

import ctypes as C
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import fakecuda as F
from meshutil import REPO_ROOT, subprocess_env

CHILD_TIMEOUT = 60
DRIVER_H = os.path.join(REPO_ROOT, "csrc", "transport", "cuda", "driver.h")
GRAN = 64 << 10  # the granularity child processes run with


@pytest.fixture(scope="module")
def cu():
    return F.FakeCuda.get()


def run_child(code, extra=None, pass_fds=(), expect_rc=0):
    """Runs `code` in a fresh interpreter that imports fakecuda as F; returns its stdout
    lines (expect_rc=None: the finished process itself)."""
    prelude = "import ctypes as C, os, socket, sys\nimport fakecuda as F\n"
    body = prelude + textwrap.dedent(code)
    env = subprocess_env({**F.env(granularity=GRAN), **(extra or {})})
    p = subprocess.run([sys.executable, "-c", body], env=env, pass_fds=pass_fds,
                       capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    if expect_rc is None:
        return p
    assert p.returncode == expect_rc, f"rc {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout.split()


# ----------------------------------------------------------------------------- the library file

def driver_entry_points():
    if not os.path.exists(DRIVER_H):
        pytest.skip("csrc/ is not beside the tests (installed-only run)")
    text = open(DRIVER_H).read()
    struct = text[text.index("struct Driver {"):]
    return re.findall(r"CUresult \(\*(cu\w+)\)", struct[:struct.index("};")])


def test_exports_only_driver_entry_points():
    out = subprocess.run([shutil.which("nm"), "-D", "--defined-only", F.library_path()],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    switches = {"fxmFakeSetNotReadyQueryDelay"}  # the fake's own run-time switch (docs/testing.md)
    assert switches <= names, sorted(names)
    # the test extras of its own: calls counted per entry point, in all and by the calling thread
    names -= {"fakecuda_call_count", "fakecuda_thread_call_count"}
    assert all(n.startswith("cu") for n in names - switches), sorted(names)
    for extra in ("cuGetProcAddress_v2", "cuMemAlloc_v2", "cuMemFree_v2", "cuMemcpyHtoD_v2",
                  "cuMemcpyDtoH_v2", "cuCtxSynchronize", "cuStreamWaitValue64_v2"):
        assert extra in names


def test_calls_are_counted_per_entry_point_failed_ones_included(cu):
    before, queries = cu.calls("cuStreamCreate"), cu.calls("cuEventQuery")
    s = cu.stream()
    assert cu.rc("cuEventQuery", None) == F.INVALID_HANDLE
    assert cu.calls("cuStreamCreate") == before + 1 and cu.calls("cuEventQuery") == queries + 1
    assert cu.calls("no such entry point") == 0
    cu.stream_destroy(s)


def test_every_driver_member_resolves_by_base_name(cu):
    fn, status = C.c_void_p(), C.c_int(-1)
    for name in driver_entry_points():
        assert cu.lib.cuGetProcAddress_v2(name.encode(), C.byref(fn), 12000, 0, C.byref(status)) == 0, name
        assert fn.value and status.value == 0, name
    base = C.c_void_p()
    cu.lib.cuGetProcAddress_v2(b"cuMemGetAddressRange", C.byref(base), 12000, 0, None)
    assert base.value == C.cast(cu.lib.cuMemGetAddressRange_v2, C.c_void_p).value
    assert cu.lib.cuGetProcAddress_v2(b"cuNoSuchCall", C.byref(fn), 12000, 0, C.byref(status)) == F.NOT_FOUND
    assert fn.value is None and status.value == 1


def test_error_names(cu):
    for code, name in [(0, "CUDA_SUCCESS"), (1, "CUDA_ERROR_INVALID_VALUE"), (2, "CUDA_ERROR_OUT_OF_MEMORY"),
                       (201, "CUDA_ERROR_INVALID_CONTEXT"),
                       (500, "CUDA_ERROR_NOT_FOUND"), (600, "CUDA_ERROR_NOT_READY"),
                       (800, "CUDA_ERROR_NOT_PERMITTED"), (801, "CUDA_ERROR_NOT_SUPPORTED")]:
        assert cu.error_name(code) == name


# ----------------------------------------------------------------------------- memory

def test_round_trip_and_attributes(cu):
    with F.DeviceBuffer(1000) as buf:
        buf.write(b"abc", offset=997)
        assert buf.read() == bytes(997) + b"abc"
        assert buf.__cuda_array_interface__["data"] == (buf.ptr, False)
        assert cu.attribute(buf.ptr + 5, F.ATTR_MEMORY_TYPE) == F.MEMORY_DEVICE
        assert cu.attribute(buf.ptr, F.ATTR_LEGACY_IPC) == 1
        assert cu.attribute(buf.ptr, F.ATTR_HANDLE_TYPES) == 0
        assert cu.address_range(buf.ptr + 999) == (buf.ptr, 1000)


def test_unregistered_host_memory_is_unknown_registered_is_host(cu):
    host = C.create_string_buffer(4096)
    addr = C.addressof(host)
    assert cu.rc("cuPointerGetAttribute", C.byref(C.c_ulonglong()), F.ATTR_MEMORY_TYPE, addr) == F.INVALID_VALUE
    base, size = C.c_ulonglong(), C.c_size_t()
    assert cu.rc("cuMemGetAddressRange_v2", C.byref(base), C.byref(size), addr) == F.NOT_FOUND  # as on the H200
    cu.host_register(addr, 4096)
    try:
        assert cu.address_range(addr + 100) == (addr, 4096)  # as on the H200
        assert cu.attribute(addr + 100, F.ATTR_MEMORY_TYPE) == F.MEMORY_HOST
        dptr = C.c_ulonglong()
        cu.call("cuMemHostGetDevicePointer_v2", C.byref(dptr), addr, 0)
        assert dptr.value == addr
    finally:
        cu.host_unregister(addr)


def test_cpu_read_of_a_device_address_dies_with_sigsegv():
    p = run_child("""
        cu = F.FakeCuda.get()
        p = cu.alloc(4096)
        print("allocated", flush=True)
        print(C.string_at(p, 8))
    """, expect_rc=None)
    assert p.stdout.split() == ["allocated"], p.stdout + p.stderr
    # a sanitizer run (scripts/sanitize.sh preloads one) reports the SEGV and exits instead
    assert p.returncode == -signal.SIGSEGV or "SEGV" in p.stderr, p.stderr


def test_no_current_context_is_invalid_context_where_the_h200_says_so(cu):
    dev = cu.alloc(64)
    got = {}

    def body():  # a thread that never made a context current
        L = cu.lib
        got["alloc"] = L.cuMemAlloc_v2(C.byref(C.c_ulonglong()), 64)
        got["range"] = L.cuMemGetAddressRange_v2(C.byref(C.c_ulonglong()), C.byref(C.c_size_t()), dev)
        got["ipc"] = L.cuIpcGetMemHandle(C.byref(F.IpcMemHandle()), dev)
        got["attribute"] = L.cuPointerGetAttribute(C.byref(C.c_ulonglong()), F.ATTR_MEMORY_TYPE, dev)
        got["free interior"] = L.cuMemFree_v2(dev + 7)
    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    assert got == {"alloc": F.INVALID_CONTEXT, "range": F.INVALID_CONTEXT, "ipc": F.INVALID_CONTEXT,
                   "attribute": F.SUCCESS, "free interior": F.INVALID_VALUE}
    cu.free(dev)


# ----------------------------------------------------------------------------- legacy IPC

@pytest.mark.timeout(120)
def test_legacy_ipc_across_processes(cu):
    buf = F.DeviceBuffer(10000)
    buf.write(b"parent" * 10)
    handle = cu.ipc_handle(buf.ptr + 4000)  # an interior pointer names the allocation
    out = run_child(f"""
        cu = F.FakeCuda.get()
        h = bytes.fromhex("{handle.hex()}")
        p = cu.ipc_open(h)
        assert cu.ipc_open(h) == p  # the same mapping, counted
        assert cu.read(p, 60) == b"parent" * 10, cu.read(p, 60)
        assert cu.address_range(p + 9999) == (p, 10000)
        assert cu.attribute(p, F.ATTR_MEMORY_TYPE) == F.MEMORY_DEVICE
        cu.write(p + 5000, b"child wrote this")
        cu.ipc_close(p)
        cu.ipc_close(p)
        print(cu.rc("cuIpcCloseMemHandle", p))
    """)
    assert out == [str(F.INVALID_VALUE)]  # closed twice: gone
    assert buf.read(16, offset=5000) == b"child wrote this"
    buf.free()


def test_own_ipc_handle_is_invalid_context_and_vmm_has_none(cu):
    with F.DeviceBuffer(64) as buf:
        with pytest.raises(F.CudaError) as e:
            cu.ipc_open(cu.ipc_handle(buf.ptr))
        assert e.value.code == F.INVALID_CONTEXT
    g = cu.granularity()
    h = cu.mem_create(g)
    p = cu.map(h, g)
    try:
        assert cu.rc("cuIpcGetMemHandle", C.byref(F.IpcMemHandle()), p) == F.INVALID_VALUE
    finally:
        cu.unmap(p, g)
        cu.call("cuMemRelease", h)


@pytest.mark.timeout(120)
def test_ipc_handle_of_a_dead_process_is_invalid_value(cu):
    out = run_child("""
        cu = F.FakeCuda.get()
        print(cu.ipc_handle(cu.alloc(4096)).hex())
    """)
    with pytest.raises(F.CudaError) as e:
        cu.ipc_open(bytes.fromhex(out[0]))
    assert e.value.code == F.INVALID_VALUE


# ----------------------------------------------------------------------------- VMM

def test_fabric_is_not_permitted_posix_fd_works(cu):
    g = cu.granularity()
    assert g == 2 << 20
    h = C.c_ulonglong()
    for types in (F.HANDLE_FABRIC, F.HANDLE_FABRIC | F.HANDLE_POSIX_FD):
        assert cu.rc("cuMemCreate", C.byref(h), g, C.byref(cu.prop(types)), 0) == F.NOT_PERMITTED
    assert cu.rc("cuMemCreate", C.byref(h), g + 4096, C.byref(cu.prop()), 0) == F.INVALID_VALUE
    cu.call("cuMemRelease", cu.mem_create(g))


def test_vmm_attributes_and_retained_handle(cu):
    g = cu.granularity()
    reserved = C.c_ulonglong()
    cu.call("cuMemAddressReserve", C.byref(reserved), 3 * g, 0, 0, 0)
    h = cu.mem_create(g)
    at = reserved.value + g
    cu.call("cuMemMap", at, g, 0, h, 0)
    # no access granted yet: a copy into it is refused, the range unknown (as on the H200)
    assert cu.rc("cuMemcpyHtoD_v2", at, b"x", 1) == F.INVALID_VALUE
    base, size = C.c_ulonglong(), C.c_size_t()
    assert cu.rc("cuMemGetAddressRange_v2", C.byref(base), C.byref(size), at + 5) == F.NOT_FOUND
    cu.call("cuMemSetAccess", at, g, C.byref(F.MemAccessDesc(F.MemLocation(1, 0), 3)), 1)
    cu.call("cuMemRelease", h)  # the mapping keeps the allocation
    cu.write(at + 10, b"vmm")
    assert cu.read(at + 10, 3) == b"vmm"
    assert cu.attribute(at + 7, F.ATTR_LEGACY_IPC) == 0
    assert cu.attribute(at + 7, F.ATTR_HANDLE_TYPES) == F.HANDLE_POSIX_FD
    assert cu.attribute(at + 7, F.ATTR_MAPPING_BASE) == at
    assert cu.attribute(at + 7, F.ATTR_MAPPING_SIZE) == g
    assert cu.attribute(at + 7, F.ATTR_RANGE_START) == reserved.value
    assert cu.attribute(at + 7, F.ATTR_RANGE_SIZE) == 3 * g
    got = C.c_ulonglong()
    cu.call("cuMemRetainAllocationHandle", C.byref(got), C.c_void_p(at + 5))
    assert got.value == h
    fd = cu.export_fd(got.value)
    os.close(fd)
    cu.call("cuMemRelease", got.value)
    assert cu.rc("cuMemAddressFree", reserved.value, 3 * g) == F.INVALID_VALUE  # still mapped
    cu.call("cuMemUnmap", at, g)
    cu.call("cuMemAddressFree", reserved.value, 3 * g)


@pytest.mark.timeout(120)
def test_vmm_fd_crosses_processes_through_scm_rights(cu):
    g = cu.granularity()
    h = cu.mem_create(g)
    p = cu.map(h, g)
    cu.write(p, b"from the parent")
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = cu.export_fd(h)
    socket.send_fds(mine, [b"f"], [fd])
    os.close(fd)
    run_child(f"""
        cu = F.FakeCuda.get()
        sock = socket.socket(fileno={theirs.fileno()})
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
        h = cu.import_fd(fds[0])
        os.close(fds[0])
        size = {g}  # the exporter's granularity: the child's own is smaller
        p = cu.map(h, size)
        assert cu.read(p, 15) == b"from the parent"
        assert cu.attribute(p, F.ATTR_HANDLE_TYPES) == F.HANDLE_POSIX_FD
        cu.write(p + size - 5, b"child")
        cu.unmap(p, size)
        cu.call("cuMemRelease", h)
    """, extra={"FXM_FAKECUDA_GRANULARITY": str(g)}, pass_fds=(theirs.fileno(),))
    assert cu.read(p + g - 5, 5) == b"child"
    cu.unmap(p, g)
    cu.call("cuMemRelease", h)
    mine.close()
    theirs.close()


# ----------------------------------------------------------------------------- streams

def host_slot():
    """A registered 8-byte host slot (as a window's signal slot would be) and its address."""
    slot = (C.c_uint64 * 1)(0)
    return slot, C.addressof(slot)


@pytest.mark.timeout(60)
def test_stream_runs_its_operations_in_order(cu):
    s = cu.stream()
    seen = []
    dev = cu.alloc(8 * 50)
    src = (C.c_uint64 * 50)(*range(50))
    for i in range(50):
        cu.memcpy_async(dev + 8 * i, C.addressof(src) + 8 * i, 8, s)
        cu.launch_host_func(s, lambda i=i: seen.append(i))
    cu.synchronize(s)
    assert seen == list(range(50))
    assert cu.read(dev, 400) == bytes(src)
    cu.stream_destroy(s)
    cu.free(dev)


@pytest.mark.timeout(60)
def test_wait_value_holds_later_operations_until_the_slot_is_written(cu):
    slot, addr = host_slot()
    cu.host_register(addr, 8)
    s = cu.stream()
    ev = cu.event()
    dev = cu.alloc(16)
    payload = C.create_string_buffer(b"after the signal", 16)
    cu.wait_value64(s, addr, 5, F.WAIT_GEQ)
    cu.memcpy_async(dev, C.addressof(payload), 16, s)
    cu.record(ev, s)
    slot[0] = 4
    time.sleep(0.2)
    assert cu.event_query(ev) == F.NOT_READY
    assert cu.read(dev, 16) == bytes(16)  # the copy has not run
    writer = threading.Thread(target=lambda: slot.__setitem__(0, 5))
    writer.start()
    writer.join(10)
    cu.synchronize(s)
    assert cu.event_query(ev) == F.SUCCESS
    assert cu.read(dev, 16) == b"after the signal"
    cu.stream_destroy(s)
    cu.host_unregister(addr)
    cu.free(dev)


def test_wait_value_needs_registered_or_device_memory(cu):
    slot, addr = host_slot()
    s = cu.stream()
    assert cu.rc("cuStreamWaitValue64_v2", s, addr, 1, 0) == F.INVALID_VALUE
    cu.stream_destroy(s)


@pytest.mark.timeout(60)
def test_stream_waits_for_an_event_of_another_stream(cu):
    slot, addr = host_slot()
    cu.host_register(addr, 8)
    first, second, ev = cu.stream(), cu.stream(), cu.event()
    seen = []
    cu.wait_value64(first, addr, 1, F.WAIT_EQ)
    cu.record(ev, first)
    cu.call("cuStreamWaitEvent", second, ev, 0)
    cu.launch_host_func(second, lambda: seen.append("second"))
    time.sleep(0.2)
    assert seen == [] and cu.event_query(ev) == F.NOT_READY
    slot[0] = 1
    cu.synchronize(second)
    assert seen == ["second"]
    cu.stream_destroy(first)
    cu.stream_destroy(second)
    cu.host_unregister(addr)


@pytest.mark.timeout(60)
def test_a_stream_wait_is_not_released_by_a_later_record_of_its_event(cu):
    """CUDA: cuStreamWaitEvent waits for the record that was the event's latest when the wait
    was queued. A later record of the same event (a pooled event reused) on a stream that gets
    there at once must not let the waiting stream run ahead of the first record's work."""
    slot, addr = host_slot()
    cu.host_register(addr, 8)
    first, waiter, quick, ev = cu.stream(), cu.stream(), cu.stream(), cu.event()
    dev = cu.alloc(16)
    payload, out = C.create_string_buffer(b"the first stream", 16), C.create_string_buffer(16)
    passed = threading.Event()
    cu.wait_value64(first, addr, 1)
    cu.memcpy_async(dev, C.addressof(payload), 16, first)
    cu.record(ev, first)
    cu.call("cuStreamWaitEvent", waiter, ev, 0)
    cu.launch_host_func(waiter, passed.set)
    cu.memcpy_async(C.addressof(out), dev, 16, waiter)
    cu.record(ev, quick)  # the event's latest record now: done at once
    cu.synchronize(quick)
    assert cu.event_query(ev) == F.SUCCESS  # query and synchronize refer to the latest record
    cu.call("cuEventSynchronize", ev)
    released_early = passed.wait(1.0)  # the old fake let the waiter go here
    slot[0] = 1
    cu.synchronize(waiter)
    assert not released_early, "the waiting stream ran before the record it waited for"
    assert out.raw == b"the first stream"
    for s in (first, waiter, quick):
        cu.stream_destroy(s)
    cu.host_unregister(addr)
    cu.free(dev)


@pytest.mark.timeout(60)
def test_a_record_issued_after_a_wait_was_queued_is_not_waited_for(cu):
    """The other half: a wait queued before a record waits only for the records before it."""
    slot, addr = host_slot()
    cu.host_register(addr, 8)
    early, held, waiter, ev = cu.stream(), cu.stream(), cu.stream(), cu.event()
    cu.record(ev, early)
    cu.synchronize(early)
    cu.call("cuStreamWaitEvent", waiter, ev, 0)
    cu.wait_value64(held, addr, 1)
    cu.record(ev, held)  # after the wait was queued: the waiter does not wait for it
    cu.synchronize(waiter)
    assert cu.event_query(ev) == F.NOT_READY
    slot[0] = 1
    cu.call("cuEventSynchronize", ev)
    assert cu.event_query(ev) == F.SUCCESS
    for s in (early, held, waiter):
        cu.stream_destroy(s)
    cu.host_unregister(addr)


@pytest.mark.timeout(60)
def test_null_stream_waits_for_blocking_streams_not_for_non_blocking(cu):
    slot, addr = host_slot()
    cu.host_register(addr, 8)
    blocking, free = cu.stream(0), cu.stream(F.STREAM_NON_BLOCKING)
    seen = []
    cu.wait_value64(free, addr, 1)
    cu.launch_host_func(None, lambda: seen.append("null after non-blocking"))
    cu.synchronize(None)
    assert seen == ["null after non-blocking"]
    cu.wait_value64(blocking, addr, 2)
    cu.launch_host_func(None, lambda: seen.append("null after blocking"))
    time.sleep(0.2)
    assert len(seen) == 1
    slot[0] = 2
    cu.synchronize(None)
    assert seen[-1] == "null after blocking"
    cu.stream_destroy(blocking)
    cu.stream_destroy(free)
    cu.host_unregister(addr)


@pytest.mark.timeout(60)
def test_wait_geq_compares_cyclically_as_the_driver(cu):
    slot, addr = host_slot()
    cu.host_register(addr, 8)
    s, ev = cu.stream(), cu.event()
    slot[0] = (1 << 64) - 1  # "before" 1 in the driver's wrap-around order
    cu.wait_value64(s, addr, 1, F.WAIT_GEQ)
    cu.record(ev, s)
    time.sleep(0.2)
    assert cu.event_query(ev) == F.NOT_READY
    slot[0] = 1
    cu.synchronize(s)
    assert cu.event_query(ev) == F.SUCCESS
    cu.stream_destroy(s)
    cu.host_unregister(addr)


# ----------------------------------------------------------------------------- fault injection

@pytest.mark.timeout(120)
def test_injected_failures_and_switches():
    out = run_child("""
        cu = F.FakeCuda.get()
        h = C.c_ulonglong()
        print(cu.rc("cuMemCreate", C.byref(h), cu.granularity(), C.byref(cu.prop()), 0))
        print(cu.rc("cuIpcGetMemHandle", C.byref(F.IpcMemHandle()), cu.alloc(64)))
        slot = (C.c_uint64 * 1)(0)
        cu.host_register(C.addressof(slot), 8)
        print(cu.rc("cuStreamWaitValue64_v2", None, C.addressof(slot), 0, 0))
        n = C.c_int()
        cu.call("cuDeviceGetCount", C.byref(n))
        print(n.value)
        second = F.FakeCuda(device=1)
        print(second.attribute(second.alloc(64), F.ATTR_DEVICE_ORDINAL))
    """, extra=F.env(fail={"cuMemCreate": 801, "cuIpcGetMemHandle": 1}, no_stream_memops=True, devices=2))
    assert out == ["801", "1", "801", "2", "1"]


@pytest.mark.timeout(120)
def test_failed_init_leaves_the_driver_uninitialised():
    out = run_child("""
        lib = C.CDLL(F.library_path())
        print(lib.cuInit(0))
        print(lib.cuDeviceGetCount(C.byref(C.c_int())))
    """, extra=F.env(fail={"cuInit": 100}))
    assert out == [str(F.NO_DEVICE), str(F.NOT_INITIALIZED)]


@pytest.mark.timeout(60)
def test_destroy_returns_at_once_and_the_queued_work_still_runs(cu):
    slot, addr = host_slot()
    cu.host_register(addr, 8)
    s = cu.stream()
    done = threading.Event()
    cu.wait_value64(s, addr, 1)
    cu.launch_host_func(s, done.set)
    cu.stream_destroy(s)  # as the driver's: does not wait for the pending wait
    assert not done.is_set()
    assert cu.rc("cuStreamSynchronize", s) == F.INVALID_HANDLE
    slot[0] = 1
    assert done.wait(30)
    cu.host_unregister(addr)


# ----------------------------------------------------------------------------- memory gone under queued work

@pytest.mark.timeout(120)
def test_a_copy_queued_before_its_device_memory_was_freed_fails_and_touches_nothing():
    """A copy held on its stream while the allocation is freed must not write the pages that
    were the allocation (the old fake took the address for host memory and died of SIGSEGV).
    It fails as an illegal address, the stream's sticky error."""
    p = run_child("""
        cu = F.FakeCuda.get()
        slot = (C.c_uint64 * 1)(0)
        cu.host_register(C.addressof(slot), 8)
        s, d, src = cu.stream(), cu.alloc(1 << 16), C.create_string_buffer(1 << 16)
        cu.wait_value64(s, C.addressof(slot), 1)
        cu.memcpy_async(d, C.addressof(src), 1 << 16, s)  # into the allocation
        cu.memcpy_async(C.addressof(src), d, 1 << 16, s)  # and out of it
        cu.free(d)
        slot[0] = 1
        print(cu.rc("cuStreamSynchronize", s), flush=True)
    """, expect_rc=None)
    assert p.returncode == 0 and p.stdout.split() == [str(F.ILLEGAL_ADDRESS)], (p.returncode, p.stdout, p.stderr)


@pytest.mark.timeout(120)
def test_a_stream_wait_on_a_slot_unregistered_meanwhile_fails_and_reads_nothing():
    """A pending cuStreamWaitValue64 on registered host memory that is unregistered and unmapped
    (a signal window closed) ends with an illegal address instead of reading the freed pages."""
    p = run_child("""
        import mmap
        cu = F.FakeCuda.get()
        m = mmap.mmap(-1, 4096)
        addr = C.addressof(C.c_char.from_buffer(m))
        cu.host_register(addr, 4096)
        s = cu.stream()
        cu.wait_value64(s, addr, 1)
        cu.host_unregister(addr)
        libc = C.CDLL(None)
        libc.munmap.argtypes = [C.c_void_p, C.c_size_t]
        print(libc.munmap(addr, 4096), cu.rc("cuStreamSynchronize", s), flush=True)
        os._exit(0)  # the mmap object must not unmap it again
    """, expect_rc=None)
    assert p.returncode == 0 and p.stdout.split() == ["0", str(F.ILLEGAL_ADDRESS)], (p.returncode, p.stdout, p.stderr)


@pytest.mark.timeout(120)
def test_a_window_freed_while_its_copy_is_held_on_a_stream_does_not_crash_the_process():
    """The library's case, made deterministic: cuEventQuery fails (injected), so the put counts as
    failed while its copy is still held on the user's stream; dropping the mesh frees the window,
    then the stream is released. The copy must fail, not write the freed pages (the old fake died
    of SIGSEGV here, and at interpreter exit under load where nothing held the stream)."""
    p = run_child("""
        import gc
        import flagcx_mesh as fm
        cu = F.FakeCuda.get()
        slot = (C.c_uint64 * 1)(0)
        cu.host_register(C.addressof(slot), 8)
        s = cu.stream()
        cu.wait_value64(s, C.addressof(slot), 1)
        m = fm.Mesh(1, fm.get_unique_id(), 0, timeout=10)
        w = m.alloc_window(1 << 16, device=0)
        m.put(0, w, 0, w, 1 << 15, 1 << 15, stream=s)
        try:
            m.flush(timeout=10)
            print("FLUSHED")
        except fm.MeshError:
            print("FAILED")
        m.close()
        del m, w
        gc.collect()
        slot[0] = 1
        print(cu.rc("cuStreamSynchronize", s), flush=True)
    """, extra=F.env(granularity=GRAN, fail={"cuEventQuery": F.ILLEGAL_ADDRESS}), expect_rc=None)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    assert p.stdout.split() == ["FAILED", str(F.ILLEGAL_ADDRESS)], p.stdout


@pytest.mark.timeout(120)
def test_the_library_keeps_a_pairs_order_across_streams_when_a_pooled_event_is_reused():
    """The library orders a pair's device ops across streams with pooled events. Put X (its
    stream held), then put Y to the same bytes on another stream, which waits for X's event;
    that event goes back to the pool and the next stream wait records it on a stream that passes
    at once. Y must still land after X (on the old fake Y passed and X overwrote it)."""
    p = run_child("""
        import flagcx_mesh as fm
        cu = F.FakeCuda.get()
        hold = (C.c_uint64 * 1)(0)
        cu.host_register(C.addressof(hold), 8)
        n = 4096
        src, dst = F.DeviceBuffer(2 * n), F.DeviceBuffer(n)
        src.write(b"X" * n + b"Y" * n)
        m = fm.Mesh(1, fm.get_unique_id(), 0, timeout=10)
        sig = m.signal_window(4)
        sw, dw = m.register_window(src), m.register_window(dst)
        first, second, quick = cu.stream(), cu.stream(), cu.stream()
        m.signal(0, 2, 1, signal_window=sig)
        m.flush(timeout=10)
        cu.wait_value64(first, C.addressof(hold), 1)
        m.put_signal(0, sw, 0, dw, 0, n, 0, 1, signal_window=sig, stream=first)
        m.put_signal(0, sw, n, dw, 0, n, 1, 1, signal_window=sig, stream=second)
        m.wait_signal(2, 1, window=sig, stream=quick)  # records a pooled event: the one just freed
        try:
            m.wait_signal(1, 1, timeout=1.0, window=sig)
            print("second-landed-early")
        except fm.MeshError:
            print("second-waits")
        hold[0] = 1
        m.flush(timeout=10)
        print(dst.read(n) == b"Y" * n, flush=True)
        m.close()
    """)
    assert p == ["second-waits", "True"], p


RANDOM_TRAFFIC = """
    import random
    import flagcx_mesh as fm
    from meshutil import run_threads
    cu = F.FakeCuda.get()
    RANKS, REGION, ROUNDS = 3, 256 << 10, 48

    def plan(src):  # the puts rank src makes: (dst, off, size, round, stream choice, signal)
        rng = random.Random(7000 + src * 31 + SEED)
        return [(rng.randrange(RANKS), *(lambda o: (o, rng.randint(1, REGION - o)))(rng.randrange(REGION)),
                 i, rng.randrange(4), rng.random() < 0.5) for i in range(ROUNDS)]

    def expected(src, dst):  # what src's region at dst holds once all its puts landed in order
        out = bytearray(REGION)
        for d, off, size, i, _, _ in plan(src):
            if d == dst:
                out[off:off + size] = bytes([1 + (src * ROUNDS + i) % 251]) * size
        return bytes(out)

    uid = fm.get_unique_id()
    def rank(r):
        m = fm.Mesh(RANKS, uid, r, timeout=30)
        sig = m.signal_window(RANKS)
        src, dst = F.DeviceBuffer(ROUNDS * REGION), F.DeviceBuffer(RANKS * REGION)
        for i in range(ROUNDS):
            src.write(bytes([1 + (r * ROUNDS + i) % 251]) * REGION, i * REGION)
        dst.write(bytes(RANKS * REGION))
        sw, dw = m.register_window(src), m.register_window(dst)
        streams = [cu.stream() for _ in range(3)] + [None]
        for d, off, size, i, k, signal in plan(r):
            args = (d, sw, i * REGION + off, dw, r * REGION + off, size)
            if signal:
                m.put_signal(*args, r, 1, signal_window=sig, stream=streams[k])
            else:
                m.put(*args, stream=streams[k])
        m.flush(timeout=30)
        m.barrier(timeout=30)
        bad = [s for s in range(RANKS) if dst.read(REGION, s * REGION) != expected(s, r)]
        m.barrier(timeout=30)
        m.close()
        return bad

    print(run_threads(RANKS, rank, timeout=90), flush=True)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", range(4))
def test_three_ranks_of_random_device_traffic_on_several_streams_land_in_order(seed):
    """Three ranks (threads of one process, so the pooled events are shared) put random ranges
    into every rank's device window, each put on one of three streams or none, with and without
    a signal; later puts overwrite earlier ones. Each rank checks every source's region against
    the puts replayed in issue order (the issue saw 3 of 8 such runs corrupted on the old fake)."""
    out = run_child("SEED = %d\n" % seed + textwrap.dedent(RANDOM_TRAFFIC))
    assert out == ["[[],", "[],", "[]]"], out


@pytest.mark.timeout(120)
def test_a_process_exits_cleanly_with_work_held_and_queued_on_its_streams():
    """exit() with a stream wait pending and copies queued behind it: the exit handler stops
    the stream threads (the wait ends, the queued copies are dropped) and the process ends."""
    p = run_child("""
        cu = F.FakeCuda.get()
        slot = (C.c_uint64 * 1)(0)
        cu.host_register(C.addressof(slot), 8)
        d, host = cu.alloc(1 << 20), C.create_string_buffer(1 << 20)
        for flags in (0, F.STREAM_NON_BLOCKING):
            s = cu.stream(flags)
            cu.wait_value64(s, C.addressof(slot), 1)
            cu.memcpy_async(d, C.addressof(host), 1 << 20, s)
            cu.memcpy_async(C.addressof(host), d, 1 << 20, s)
        cu.memcpy_async(d, C.addressof(host), 1 << 20, None)  # behind the blocking one
        print("queued", flush=True)
    """, expect_rc=None)
    assert p.returncode == 0 and p.stdout.split() == ["queued"], (p.returncode, p.stdout, p.stderr)


# ----------------------------------------------------------------------------- hygiene

def open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(60)
def test_no_descriptor_is_left_behind(cu):
    g = cu.granularity()
    for _ in range(2):  # the first round may open what stays (the NULL stream's thread)
        before = open_fds()
        bufs = [F.DeviceBuffer(4096) for _ in range(5)]
        for b in bufs:
            b.free()
        h = cu.mem_create(g)
        fd = cu.export_fd(h)
        h2 = cu.import_fd(fd)
        os.close(fd)
        p = cu.map(h2, g)
        cu.unmap(p, g)
        cu.call("cuMemRelease", h2)
        cu.call("cuMemRelease", h)
        s = cu.stream()
        cu.synchronize(s)
        cu.stream_destroy(s)
    assert open_fds() == before


@pytest.mark.timeout(120)
def test_threads_copying_through_their_own_streams(cu):
    def body(rank):
        s = cu.stream()
        dev = cu.alloc(1 << 16)
        src = C.create_string_buffer(bytes([rank]) * (1 << 16), 1 << 16)
        dst = C.create_string_buffer(1 << 16)
        for _ in range(20):
            cu.memcpy_async(dev, C.addressof(src), 1 << 16, s)
            cu.memcpy_async(C.addressof(dst), dev, 1 << 16, s)
        cu.synchronize(s)
        cu.stream_destroy(s)
        cu.free(dev)
        return dst.raw == bytes([rank]) * (1 << 16)

    from meshutil import run_threads
    assert run_threads(6, body, timeout=100) == [True] * 6


@pytest.mark.timeout(60)
def test_a_forked_child_cannot_use_the_parents_driver(cu):
    cu.synchronize(None)  # the NULL stream's thread exists in this process, not in a child
    pid = os.fork()
    if pid == 0:  # the child: exits with the code of a call that needs the driver
        code = cu.lib.cuStreamSynchronize(None)
        os._exit(code if code < 256 else 255)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == F.NOT_INITIALIZED


def test_one_copy_spans_adjacent_mappings_of_one_reservation(cu):
    """As in a torch expandable-segments tensor: one range, several mappings."""
    g = cu.granularity()
    reserved = C.c_ulonglong()
    cu.call("cuMemAddressReserve", C.byref(reserved), 2 * g, 0, 0, 0)
    base = reserved.value
    handles = [cu.mem_create(g) for _ in range(2)]
    for i, h in enumerate(handles):
        cu.call("cuMemMap", base + i * g, g, 0, h, 0)
        cu.call("cuMemRelease", h)
    cu.call("cuMemSetAccess", base, 2 * g, C.byref(F.MemAccessDesc(F.MemLocation(1, 0), 3)), 1)
    data = bytes(range(256)) * 16
    cu.write(base + g - 2048, data)  # half in each mapping
    assert cu.read(base + g - 2048, len(data)) == data
    assert cu.attribute(base + g + 1, F.ATTR_MAPPING_BASE) == base + g
    assert cu.address_range(base + g + 1) == (base + g, g)
    cu.unmap(base, 2 * g)
