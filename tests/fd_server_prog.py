"""One rank of a job in which rank 2 attacks the cuMem fd servers of the others (test_fd_server.py).

    python -m flagcx_mesh.launch -n 3 -- python tests/fd_server_prog.py hold|flood

Ranks 0 and 1 allocate a device window (cuMem, fake CUDA driver) and reach each other over
cuda-vmm, fetching each other's fds from the fd server each runs during the registration.
Rank 2 takes part in the registration through the bootstrap allgather (its own description
names another host), but first finds the two fd servers as any process of this user can (the
ranks' sockets in /proc/<pid>/fd, their abstract names in /proc/net/unix) and
  hold   connects to each, sends 1 byte of the 8-byte token and keeps the connection open;
  flood  does the same, then opens up to 300 more connections to each that send nothing (more
         than its listen backlog) and keeps them all open.
Only then does rank 2 let the registration proceed; it closes its connections after every rank
passed the barrier that follows the registration, so a registration that waited for them could
not complete (the job runs into its timeout). Prints REGISTERED and VERDICT lines.
"""

import os
import select
import socket
import struct
import sys
import time

from flagcx_mesh import Mesh

from meshutil import socket_inodes

SCENARIO = sys.argv[1]
SIZE = 64 << 10
m = Mesh.from_launcher(timeout=30)
r = m.rank
# bootstrap::CallKind (csrc/bootstrap/proto.h) of alloc_window(device=) and of its second step
ALLOC_DEVICE_WINDOW, REGISTRATION_DONE = 9, 11
SO_ACCEPTCON = 0x10000  # /proc/net/unix "Flags" of a listening socket


def s(b):
    return struct.pack("<I", len(b)) + b


def device_desc_elsewhere():
    # WindowDesc.encode() (csrc/transport/path.cc) of a device window on another host, no export
    dev = struct.pack("<iB", 0, 0) + bytes(64)
    return (struct.pack("<IQQi", 4, SIZE, 0, os.getpid()) + s(b"elsewhere") + s(b"") + s(b"") +
            struct.pack("<QQ", 0, 0) + dev + struct.pack("<Q", 0) + struct.pack("<I", 0) +
            s(b"") + s(b"") + s(b"") + struct.pack("<Q", 0))


def listening_fd_servers(pid):
    inodes = socket_inodes(pid)
    names = []
    with open("/proc/net/unix") as f:
        next(f)
        for cols in (line.split() for line in f):
            if (len(cols) >= 8 and cols[7].startswith("@fxm-fd-") and int(cols[3], 16) & SO_ACCEPTCON
                    and int(cols[6]) in inodes):
                names.append(cols[7][1:].encode())
    return names


def find_fd_server(pid, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        names = listening_fd_servers(pid)
        if len(names) == 1:
            return names[0]
        time.sleep(0.01)
    sys.exit(f"rank 2: no fd server of pid {pid} found")


def attack(names):
    held = []
    for name in names:  # 1 byte of the token, then nothing
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(b"\0" + name)
        c.send(b"x")
        held.append(c)
    time.sleep(0.5)  # each server has accepted it and read the byte
    if SCENARIO == "flood":
        for name in names:
            n, full = 0, False
            for _ in range(300):
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.setblocking(False)
                try:
                    c.connect(b"\0" + name)
                except BlockingIOError:  # its backlog is full
                    c.close()
                    full = True
                    break
                held.append(c)
                n += 1
            print(f"VERDICT flood: {n} silent connections to one fd server{' (its backlog full)' * full}",
                  flush=True)
    return held


def closed_by_server(c, timeout=10.0):
    if not select.select([c], [], [], timeout)[0]:
        return False
    try:
        return c.recv(16) == b""
    except ConnectionResetError:
        return True


pids = [struct.unpack("<i", p)[0] for p in m.allgather(struct.pack("<i", os.getpid()), timeout=30)]
if r == 2:
    held = attack([find_fd_server(pids[0]), find_fd_server(pids[1])])
    m._core.allgather(struct.pack("<I", 0) + device_desc_elsewhere(), 30.0, call_kind=ALLOC_DEVICE_WINDOW,
                      call_index=0)
    m._core.allgather(b"", 30.0, call_kind=REGISTRATION_DONE, call_index=0)
    closed = sum(closed_by_server(c) for c in held[:2])
    print(f"VERDICT stranger: {closed} of 2 token-less connections closed by the fd servers", flush=True)
else:
    W = m.alloc_window(SIZE, device=0)
    print(f"REGISTERED rank {r}: {W.describe()}", flush=True)
    m.put(1 - r, W, 0, W, 0, SIZE)
    m.flush(1 - r, timeout=10)
m.barrier(timeout=30)
if r == 2:
    for c in held:
        c.close()
m.barrier(timeout=30)
m.close()
print(f"OK rank {r}", flush=True)
