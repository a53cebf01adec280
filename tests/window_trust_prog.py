"""One rank of a job in which rank 2 misbehaves on window descriptions (test_window_trust.py).

    python -m flagcx_mesh.launch -n 3 -- python tests/window_trust_prog.py cma|ipc|self|ipc-past|vmm-past

Rank 2 takes part in the registrations through the bootstrap allgather (no window of its own),
learns what the others published for window #0, and publishes for window #1:
  cma   rank 1's cma identity (pid, cookie address, cookie, host, PID namespace) with the address
        of rank 1's private bytes (host memory)
  ipc   rank 1's legacy IPC handle with the offset of rank 1's private bytes in that allocation
  self  rank 0's own pid with an address past rank 0's device window #0 (its private bytes)
  ipc-past  its own IPC handle with a window that runs past the end of its allocation
  vmm-past  its own cuMem fd (served like the library serves them) with a window twice its size
  shm   a shared-memory window naming a file of /dev/shm that rank 1 created and maps (another
        job's segment: its bytes are the private ones), with rank 2's own pid
In the scenarios that name rank 2's own process (ipc, ipc-past, vmm-past, shm) rank 2 also keeps
the seal of what it publishes in its own memory (descforge.SealCell), as an honest owner does:
what is checked is then the export itself, not the seal (csrc/transport/binding.h).
Ranks 0 and 1 are honest. Rank 0 then gets and puts into rank 2's window #1; the private bytes
(0x5A, in no window) must be neither read nor overwritten. Device scenarios need the fake CUDA
driver (FLAGCX_MESH_CUDA_DRIVER). Prints VERDICT lines.
"""

import atexit
import os
import struct
import sys

import numpy as np

from descforge import SealCell, Win
from flagcx_mesh import Mesh, MeshError

SCENARIO = sys.argv[1]
SIZE, PRIVATE = 64 << 10, 512 << 10  # the window; where the private bytes lie in its allocation
m = Mesh.from_launcher(timeout=6)  # bounds a staged get that is never answered (the build takes < 1 s)
r = m.rank


def s(b):
    return struct.pack("<I", len(b)) + b


def host_id():
    boot = open("/proc/sys/kernel/random/boot_id").read().split("\n")[0]
    st = os.stat("/dev/shm")
    return f"{boot}:{st.st_dev}:{st.st_ino}".encode()


def desc(kind, size, addr, pid, host, ns, cookie_addr=0, cookie=0, ipc_handle=None, ipc_offset=0, vmm=(),
         fd_socket=b"", fd_token=0):
    # WindowDesc.encode() (csrc/transport/path.cc); vmm: (offset, size) of each cuMem mapping
    dev = struct.pack("<iB", 0 if kind == 4 else -1, ipc_handle is not None) + (ipc_handle or bytes(64))
    maps = struct.pack("<I", len(vmm)) + b"".join(struct.pack("<qQ", o, n) for o, n in vmm)
    return (struct.pack("<IQQi", kind, size, addr, pid) + s(host) + s(ns) + s(b"") +
            struct.pack("<QQ", cookie_addr, cookie) + dev + struct.pack("<Q", ipc_offset) + maps +
            s(b"") + s(b"") + s(fd_socket) + struct.pack("<Q", fd_token))


def serve_fds(name, token, fds):
    # the cuMem fd server's protocol (csrc/transport/cuda/fd_pass.cc), from a thread
    import socket
    import threading
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(b"\0" + name)
    srv.listen(8)

    def loop():
        while True:
            conn, _ = srv.accept()
            with conn:
                if conn.recv(8, socket.MSG_WAITALL) == struct.pack("<Q", token):
                    socket.send_fds(conn, [struct.pack("<I", len(fds))], fds)

    threading.Thread(target=loop, daemon=True).start()


def fields(part):
    # pid, host, ns, cookie address, cookie and IPC handle of a published description
    b = part[4:]
    pid = struct.unpack_from("<i", b, 20)[0]
    off, strs = 24, []
    for _ in range(3):
        (n,) = struct.unpack_from("<I", b, off)
        strs.append(b[off + 4:off + 4 + n])
        off += 4 + n
    cookie_addr, cookie = struct.unpack_from("<QQ", b, off)
    ipc = b[off + 16 + 5:off + 16 + 5 + 64] if b[off + 16 + 4] else None
    return dict(pid=pid, host=strs[0], ns=strs[1], cookie_addr=cookie_addr, cookie=cookie, ipc=ipc)


class Memory:
    """SIZE-byte window at the start of a 1 MiB allocation whose bytes at PRIVATE are in no window."""

    def __init__(self, fill):
        if SCENARIO in ("cma", "shm"):
            self.alloc = np.full(1 << 20, fill, np.uint8)
            self.ptr = self.alloc.ctypes.data
            self.window = self.alloc[:SIZE]
        else:
            import fakecuda
            self.alloc = fakecuda.DeviceBuffer(1 << 20)
            self.alloc.write(bytes([fill]) * (1 << 20))
            self.ptr = self.alloc.ptr
            self.window = self
        self.alloc_write(bytes([0x5A]) * SIZE, PRIVATE)

    @property
    def __cuda_array_interface__(self):
        return {"version": 3, "shape": (SIZE,), "typestr": "|u1", "data": (self.ptr, False), "strides": None}

    def alloc_write(self, data, off):
        if SCENARIO in ("cma", "shm"):
            self.alloc[off:off + len(data)] = np.frombuffer(data, np.uint8)
        else:
            self.alloc.write(data, off)

    def read(self, off, n):
        return bytes(self.alloc[off:off + n]) if SCENARIO in ("cma", "shm") else self.alloc.read(n, off)


# bootstrap::CallKind (csrc/bootstrap/proto.h): a collective carries the call it is part of, so
# rank 2 takes part as the registration the others make (host or device window, its index).
REGISTER_WINDOW, ALLOC_WINDOW, REGISTER_DEVICE_WINDOW, REGISTRATION_DONE = 5, 6, 8, 11


def rank2_registration(part, index):
    call = REGISTER_WINDOW if SCENARIO == "cma" else REGISTER_DEVICE_WINDOW
    if SCENARIO == "shm":
        call = ALLOC_WINDOW if index == 1 else REGISTER_WINDOW
    parts = m._core.allgather(part, 30.0, call_kind=call, call_index=index)
    try:  # the registration's second step
        m._core.allgather(b"", 10.0, call_kind=REGISTRATION_DONE, call_index=index)
    except MeshError:
        pass
    return parts


ns = os.readlink("/proc/self/ns/pid").encode()
kind = 1 if SCENARIO == "cma" else 4
DECOY = f"/fxm-trust-decoy-{os.getppid()}"  # the launcher's pid: one name per job
decoy_map = None
if r == 1 and SCENARIO == "shm":  # another job's segment, mapped by rank 1
    import mmap
    try:  # a crashed run with a launcher of this pid may have left it behind
        os.unlink("/dev/shm" + DECOY)
    except FileNotFoundError:
        pass
    fd = os.open("/dev/shm" + DECOY, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    atexit.register(lambda: os.path.exists("/dev/shm" + DECOY) and os.unlink("/dev/shm" + DECOY))
    os.write(fd, bytes([0x5A]) * SIZE)
    decoy_map = mmap.mmap(fd, SIZE)
    os.close(fd)
cell = SealCell()
if r == 2:
    first = rank2_registration(struct.pack("<I", 0) + desc(1, SIZE, 0, os.getpid(), b"elsewhere", b""), 0)
else:
    A = Memory(0x10 + r)
    W0 = m.register_window(A.window)
shared = m.allgather(struct.pack("<Qi", A.ptr if r < 2 else 0, os.getpid()), timeout=30)  # (the attacker's aim)
if r == 2:
    if SCENARIO == "cma":
        v = fields(first[1])
        forged = desc(1, SIZE, struct.unpack("<Q", shared[1][:8])[0] + PRIVATE, v["pid"], v["host"], v["ns"],
                      v["cookie_addr"], v["cookie"])
    elif SCENARIO == "ipc":
        v = fields(first[1])
        assert v["ipc"] is not None, "rank 1 published no IPC handle"
        forged = desc(4, SIZE, 0, os.getpid(), host_id(), ns, ipc_handle=v["ipc"], ipc_offset=PRIVATE)
    elif SCENARIO == "ipc-past":  # its own allocation, with a window that runs past its end
        import fakecuda
        own = fakecuda.DeviceBuffer(1 << 20)
        forged = desc(4, SIZE, 0, os.getpid(), host_id(), ns, ipc_handle=fakecuda.FakeCuda.get().ipc_handle(own.ptr),
                      ipc_offset=(1 << 20) - SIZE // 2)
    elif SCENARIO == "vmm-past":  # its own cuMem mapping of SIZE bytes for a window of 2 * SIZE
        import fakecuda
        cuda = fakecuda.FakeCuda.get()
        fd = cuda.export_fd(cuda.mem_create(SIZE))
        name = f"fxm-fd-test-{os.getpid()}".encode()
        serve_fds(name, 7, [fd])
        forged = desc(4, 2 * SIZE, 0, os.getpid(), host_id(), ns, vmm=[(0, SIZE)], fd_socket=name, fd_token=7)
    elif SCENARIO == "shm":
        forged = desc(2, SIZE, 0, os.getpid(), host_id(), ns)
        forged = Win(**{**Win.decode(forged).__dict__, "shm_name": DECOY.encode()}).encode()
    else:
        forged = desc(4, SIZE, struct.unpack("<Q", shared[0][:8])[0] + PRIVATE, struct.unpack("<i", shared[0][8:])[0],
                      host_id(), ns)
    if SCENARIO in ("ipc", "ipc-past", "vmm-past", "shm"):
        forged = cell.publish(Win.decode(forged), 1).encode()
    rank2_registration(struct.pack("<I", 1) + forged, 1)
elif SCENARIO == "shm":
    W1 = m.alloc_window(SIZE)
    np.frombuffer(W1.buffer, np.uint8)[:] = 0x77 if r == 0 else 0x20
else:
    B = Memory(0x77 if r == 0 else 0x20)
    W1 = m.register_window(B.window)
m.barrier(timeout=30)
if r == 0:
    print(f"DESCRIBE {W1.describe()}", flush=True)
    for op in ("get", "put"):
        try:
            if op == "get":  # rank 2's window #1 into this rank's window #0
                m.get(2, W1, 0, W0, 0, SIZE)
            else:  # this rank's window #1 (0x77) into rank 2's window #1
                m.put(2, W1, 0, W1, 0, SIZE)
            m.flush(2, timeout=2)
            print(f"VERDICT {op} succeeded", flush=True)
        except MeshError as e:
            print(f"VERDICT {op} {type(e).__name__}: {e}", flush=True)
    print(f"VERDICT get read {A.read(0, SIZE).count(0x5A)} private bytes", flush=True)
m.barrier(timeout=90)
if r < 2:
    private = A.read(PRIVATE, SIZE)
    if r == 1 and SCENARIO == "shm":
        private = bytes(decoy_map[:SIZE])
        os.unlink("/dev/shm" + DECOY)
    print(f"VERDICT rank {r}: {SIZE - private.count(0x5A)} private bytes overwritten", flush=True)
m.barrier(timeout=30)
m.close()
print(f"OK rank {r}", flush=True)
