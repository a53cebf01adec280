"""Prints a CUDA driver's answers to the cases the fake driver models, one `case: answer` line
each, with no addresses in them, so that two runs diff cleanly:

    python tests/fakecuda_probe.py libcuda.so.1 > real.txt          # on a GPU machine
    python tests/fakecuda_probe.py "$(python -c 'import fakecuda; print(fakecuda.library_path())')" > fake.txt
    diff real.txt fake.txt

Run from tests/ (or with tests/ on PYTHONPATH). Widths: an attribute is read into an 8-byte
slot of all ones, so `0xffffffff00000001` means the driver wrote 4 bytes."""

import ctypes as C
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fakecuda as F  # noqa: E402


def show(case, answer):
    print(f"{case}: {answer}", flush=True)


def attr(cu, a, ptr, rel=0):
    x = C.c_ulonglong(0xFFFFFFFFFFFFFFFF)
    rc = cu.rc("cuPointerGetAttribute", C.byref(x), a, ptr)
    return rc, hex(x.value - rel) if rel and rc == 0 else hex(x.value)


def addr_range(cu, ptr, rel):
    b, s = C.c_ulonglong(), C.c_size_t()
    rc = cu.rc("cuMemGetAddressRange_v2", C.byref(b), C.byref(s), ptr)
    return (rc, hex(b.value - rel), hex(s.value)) if rc == 0 else rc


ATTRS = [(F.ATTR_LEGACY_IPC, "legacy"), (F.ATTR_HANDLE_TYPES, "handle types"), (F.ATTR_MEMORY_TYPE, "memory type"),
         (F.ATTR_DEVICE_ORDINAL, "ordinal"), (F.ATTR_MAPPING_BASE, "mapping base"), (F.ATTR_MAPPING_SIZE, "mapping size"),
         (F.ATTR_RANGE_START, "range start"), (F.ATTR_RANGE_SIZE, "range size")]
RELATIVE = {F.ATTR_MAPPING_BASE, F.ATTR_RANGE_START}


def probe_legacy(cu, d):
    for a, name in ATTRS:
        show(f"cuMemAlloc attr {name}", attr(cu, a, d + 100, d if a in RELATIVE else 0))
    show("cuMemAlloc address range of an interior pointer", addr_range(cu, d + 100, d))
    show("cuMemFree of an interior pointer", cu.rc("cuMemFree_v2", d + 100))
    show("cuIpcCloseMemHandle of a pointer not opened", cu.rc("cuIpcCloseMemHandle", d))
    h = C.c_ulonglong()
    show("cuMemRetainAllocationHandle on cuMemAlloc memory", cu.rc("cuMemRetainAllocationHandle", C.byref(h), C.c_void_p(d)))
    show("cuIpcOpenMemHandle of an own handle", cu.rc("cuIpcOpenMemHandle_v2", C.byref(C.c_ulonglong()),
                                                        F.IpcMemHandle.from_buffer_copy(cu.ipc_handle(d)), 1))
    for code in (700, 712, 713, 9999):
        t = C.c_char_p()
        show(f"cuGetErrorName {code}", (cu.lib.cuGetErrorName(code, C.byref(t)), t.value))


def probe_host(cu, ha):
    dp = C.c_ulonglong()
    show("address range of unregistered host memory", addr_range(cu, ha, ha))
    show("attr memory type of unregistered host memory", attr(cu, F.ATTR_MEMORY_TYPE, ha))
    show("device pointer of unregistered host memory", cu.rc("cuMemHostGetDevicePointer_v2", C.byref(dp), ha, 0))
    show("cuMemHostRegister", cu.rc("cuMemHostRegister_v2", ha, 8192, 2))
    show("cuMemHostRegister overlapping", cu.rc("cuMemHostRegister_v2", ha + 4096, 8192, 0))
    show("cuMemHostRegister IOMEMORY", cu.rc("cuMemHostRegister_v2", ha + 16384, 4096, 4))
    for a, name in ATTRS[:4]:
        show(f"registered host attr {name}", attr(cu, a, ha + 10))
    show("address range of registered host memory", addr_range(cu, ha + 10, ha))
    rc = cu.rc("cuMemHostGetDevicePointer_v2", C.byref(dp), ha + 10, 0)
    show("device pointer of registered host memory minus host pointer", (rc, dp.value - ha - 10 if rc == 0 else None))
    show("cuMemHostUnregister of an interior pointer", cu.rc("cuMemHostUnregister", ha + 10))


def probe_vmm(cu, ha, stream):
    g, h, r = cu.granularity(), C.c_ulonglong(), C.c_ulonglong()
    show("granularity", g)
    show("cuMemCreate size not a multiple", cu.rc("cuMemCreate", C.byref(h), g + 4096, C.byref(cu.prop()), 0))
    show("cuMemCreate FABRIC", cu.rc("cuMemCreate", C.byref(h), g, C.byref(cu.prop(F.HANDLE_FABRIC)), 0))
    show("cuMemCreate POSIX_FD|FABRIC", cu.rc("cuMemCreate", C.byref(h), g, C.byref(cu.prop(9)), 0))
    if cu.rc("cuMemCreate", C.byref(h), g, C.byref(cu.prop(0)), 0) == 0:
        fd = C.c_int(-1)
        show("export of a handle made without handle types", cu.rc("cuMemExportToShareableHandle", C.byref(fd), h.value, 1, 0))
        cu.rc("cuMemRelease", h.value)
    show("cuMemAddressReserve size not a multiple", cu.rc("cuMemAddressReserve", C.byref(r), g + 4096, 0, 0, 0))
    cu.call("cuMemAddressReserve", C.byref(r), 3 * g, 0, 0, 0)
    base, h1, h2 = r.value, cu.mem_create(g), cu.mem_create(g)
    show("cuMemMap offset not 0", cu.rc("cuMemMap", base, g // 2, g // 2, h1, 0))
    show("cuMemMap unaligned address", cu.rc("cuMemMap", base + 4096, g, 0, h1, 0))
    show("cuMemMap", (cu.rc("cuMemMap", base, g, 0, h1, 0), cu.rc("cuMemMap", base + g, g, 0, h2, 0)))
    show("cuMemcpyHtoD before cuMemSetAccess", cu.rc("cuMemcpyHtoD_v2", base, b"x" * 8, 8))
    show("cuMemcpyAsync before cuMemSetAccess", (cu.rc("cuMemcpyAsync", base, ha, 8, stream),
                                                 cu.rc("cuStreamSynchronize", stream)))
    desc = F.MemAccessDesc(F.MemLocation(1, 0), 3)
    show("cuMemSetAccess over two mappings", cu.rc("cuMemSetAccess", base, 2 * g, C.byref(desc), 1))
    show("one copy across two mappings", cu.rc("cuMemcpyHtoD_v2", base + g - 8, b"y" * 16, 16))
    for a, name in ATTRS:
        show(f"VMM attr {name} (second mapping)", attr(cu, a, base + g + 5, base if a in RELATIVE else 0))
    show("VMM address range (second mapping)", addr_range(cu, base + g + 5, base))
    show("cuIpcGetMemHandle on VMM memory", cu.rc("cuIpcGetMemHandle", C.byref(F.IpcMemHandle()), base))
    show("cuMemUnmap of part of a mapping", cu.rc("cuMemUnmap", base, g // 2))
    show("cuMemAddressFree while mapped", cu.rc("cuMemAddressFree", base, 3 * g))
    show("cuMemUnmap of two mappings at once", cu.rc("cuMemUnmap", base, 2 * g))
    cu.rc("cuMemRelease", h1)
    cu.rc("cuMemRelease", h2)
    show("cuMemAddressFree", cu.rc("cuMemAddressFree", base, 3 * g))


def probe_no_context(cu, d, ha, stream, g):
    L, res = cu.lib, {}

    def body():
        L.cuCtxSetCurrent(None)
        res["cuMemAlloc"] = L.cuMemAlloc_v2(C.byref(C.c_ulonglong()), 64)
        res["cuMemGetAddressRange"] = L.cuMemGetAddressRange_v2(C.byref(C.c_ulonglong()), C.byref(C.c_size_t()), d)
        res["cuPointerGetAttribute"] = L.cuPointerGetAttribute(C.byref(C.c_ulonglong()), 2, d)
        res["cuMemcpyHtoD"] = L.cuMemcpyHtoD_v2(d, b"z", 1)
        res["cuStreamSynchronize(NULL)"] = L.cuStreamSynchronize(None)
        res["cuStreamSynchronize(a stream)"] = L.cuStreamSynchronize(stream)
        res["cuMemcpyAsync(a stream)"] = L.cuMemcpyAsync(d, ha, 8, stream)
        res["cuMemHostRegister"] = L.cuMemHostRegister_v2(ha + 32768, 4096, 0)
        res["cuStreamCreate"] = L.cuStreamCreate(C.byref(C.c_void_p()), 1)
        res["cuEventCreate"] = L.cuEventCreate(C.byref(C.c_void_p()), 2)
        res["cuIpcGetMemHandle"] = L.cuIpcGetMemHandle(C.byref(F.IpcMemHandle()), d)
        res["cuMemFree(interior)"] = L.cuMemFree_v2(d + 7)
        res["cuMemCreate"] = L.cuMemCreate(C.byref(C.c_ulonglong()), g, C.byref(cu.prop()), 0)
    t = threading.Thread(target=body)
    t.start()
    t.join()
    for k, v in res.items():
        show(f"no current context: {k}", v)


def probe_streams(cu, stream):
    slot = (C.c_uint64 * 2)(0, 0)
    sa = C.addressof(slot)
    pageable = (C.c_uint64 * 1)(0)
    show("cuStreamWaitValue64 on pageable memory", cu.rc("cuStreamWaitValue64_v2", stream, C.addressof(pageable), 1, 0))
    cu.host_register(sa, 16, 2)
    ev = cu.event()
    show("cuEventQuery of an event never recorded", cu.event_query(ev))
    for flags, name in ((0, "blocking"), (1, "non-blocking")):
        s, seen = cu.stream(flags), []
        slot[0] = 0
        cu.wait_value64(s, sa, 1)
        cu.launch_host_func(None, lambda: seen.append(1))
        time.sleep(0.5)
        show(f"NULL stream work ran while a {name} stream waits", bool(seen))
        slot[0] = 1
        cu.synchronize(None)
        cu.stream_destroy(s)
    s, done = cu.stream(1), []
    cu.wait_value64(s, sa, 3)
    cu.launch_host_func(s, lambda: done.append(1))
    t0 = time.time()
    show("cuStreamDestroy with a wait pending: rc, returned at once", (cu.rc("cuStreamDestroy_v2", s), time.time() - t0 < 0.2))
    slot[0] = 3
    time.sleep(0.5)
    show("the destroyed stream's work ran after the release", done == [1])
    s = cu.stream(1)
    slot[1] = (1 << 64) - 1
    cu.wait_value64(s, sa + 8, 1)
    cu.record(ev, s)
    time.sleep(0.3)
    show("GEQ 1 on 2**64-1 passed (a cyclic compare says no)", cu.event_query(ev) == 0)
    slot[1] = 5
    cu.synchronize(s)
    probe_event_records(cu, slot, sa)


def probe_event_records(cu, slot, sa):
    """A wait queued behind record 1 of an event is not released by a later record 2 of it."""
    first, waiter, quick, ev, seen = cu.stream(), cu.stream(), cu.stream(), cu.event(), []
    slot[0] = 0
    cu.wait_value64(first, sa, 7)
    cu.record(ev, first)
    cu.call("cuStreamWaitEvent", waiter, ev, 0)
    cu.launch_host_func(waiter, lambda: seen.append(1))
    cu.record(ev, quick)
    cu.synchronize(quick)
    show("event query after a later record on a stream that is done", cu.event_query(ev))
    time.sleep(0.5)
    show("a wait on the earlier record passed on the later one", bool(seen))
    slot[0] = 7
    cu.synchronize(waiter)
    show("the wait passed once the earlier record was reached", seen == [1])
    for s in (first, waiter, quick):
        cu.stream_destroy(s)


def child(path, body):
    code = f"import ctypes, sys; sys.path.insert(0, {HERE!r}); import fakecuda as F; cu = F.FakeCuda(path={path!r}); " + body
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def probe_processes(cu, path):
    hx = child(path, "print(cu.ipc_handle(cu.alloc(4096)).hex())").stdout.strip()
    p = C.c_ulonglong()
    show("cuIpcOpenMemHandle of a handle of a process that is gone",
         cu.rc("cuIpcOpenMemHandle_v2", C.byref(p), F.IpcMemHandle.from_buffer_copy(bytes.fromhex(hx)), 1) if hx else "no handle")
    r = child(path, "p = cu.alloc(4096); print('allocated', flush=True); print(ctypes.string_at(p, 8))")
    show("a CPU read of a device address: exit status, output", (r.returncode, r.stdout.split()[:1]))


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "libcuda.so.1"
    cu = F.FakeCuda(path=path)
    v = C.c_int()
    cu.lib.cuDriverGetVersion(C.byref(v))
    print(f"# driver {path}, version {v.value}", flush=True)
    d, host, stream = cu.alloc(1 << 20), C.create_string_buffer(1 << 16), cu.stream()
    ha = C.addressof(host)
    probe_legacy(cu, d)
    probe_host(cu, ha)
    probe_vmm(cu, ha, stream)
    probe_no_context(cu, d, ha, stream, cu.granularity())
    probe_streams(cu, stream)
    probe_processes(cu, path)


if __name__ == "__main__":
    main()
