"""Put bandwidth and put_signal latency per transport, against the limits.

    python -m flagcx_mesh.bench put [--sizes 4K,64K,1M,16M,64M] [--transports shm,cma,tcp]
                                    [--batch 2000] [--batch-size 4K] [--bytes 256M] [--json PATH] [--plot PNG]
    python -m flagcx_mesh.bench put --device cuda [...]   (GPU windows: see put_cuda.py)
    mpiexec -n 2 python -m flagcx_mesh.bench put-mpi [--sizes ...] [--json PATH]

``put`` starts 2 local ranks. For each transport, rank 0 puts ``size`` bytes
into rank 1's window repeatedly, then flushes (remote completion); bandwidth
is bytes / time. Latency is half the round trip of an 8-byte put_signal
ping-pong (initiator put_signal -> target wait_signal returns -> answer).
In the same run it measures the limits: single-thread memcpy (numpy copy)
for shared memory, and raw loopback TCP throughput between the two rank
processes (sendall / recv_into on the same interface, completion ack) for TCP,
each transfer landing over a destination of its own size as a put lands over its window,
and prints the ratios. The TCP reference is measured twice: on one socket, and on
``--streams N`` sockets at once (one sending thread per socket, each size split
evenly over them; default: the tcp lanes the mesh uses, ``FLAGCX_MESH_TCP_LANES``),
which is what that many connections per pair can reach at best; the table prints tcp
(over its lanes) against both. With ``ucx`` among the transports (UCX over its tcp:
``UCX_TLS=tcp``) the TCP connections UCX opened for the puts are counted (rank 0's new
established sockets while ucx ran) and raw TCP is measured once more on that many sockets, so
ucx, the tcp path and raw TCP are compared with the same number of streams in one run. With ``--batch N`` (default 2000) it also issues N puts of
``--batch-size`` bytes three ways (a loop of put, batch_put of a list, batch_put of a
uint64 array) and prints their bandwidth side by side. ``put-mpi`` (under mpiexec, with mpi4py) measures
MPI_Put (passive target: Lock, Put x N, Flush) next to flagcx_mesh.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from typing import Dict, List, Optional

import numpy as np

from .._plot import save_plot
from .._ranks import run_ranks, save_json
from .._sizes import parse_size, size_name

TRANSPORT_ENV = {"shm": "auto", "cma": "auto", "tcp": "tcp", "ucx": "ucx"}  # ucx: the [ucx] extra (docs/rdma.md)
TARGET_BYTES = 256 << 20  # per size and transport (--bytes), bounded by the repetition limits
_budget = TARGET_BYTES    # this process's --bytes (rank_entry sets it)


def _parse(argv: List[str], prog: str, rank: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m flagcx_mesh.bench {prog}")
    p.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="put sizes, comma-separated, K/M/G suffixes (default 4K,64K,1M,16M,64M)")
    p.add_argument("--transports", default="shm,cma,tcp", help="host paths to measure, comma-separated (default shm,cma,tcp)")
    p.add_argument("--latency-iters", type=int, default=2000, help="put_signal round trips per latency figure (default 2000)")
    p.add_argument("--batch", type=int, default=2000, help="entries per batch_put (0: skip)")
    p.add_argument("--batch-size", default="4K", help="bytes per batch entry")
    p.add_argument("--streams", type=int, default=None,
                   help="sockets of the multi-stream raw TCP reference (default: the mesh's tcp lanes)")
    p.add_argument("--bytes", default="256M",
                   help="bytes moved per size and transport, for each figure (more: steadier figures)")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    p.add_argument("--plot", metavar="PNG", help="a plot of the bandwidth table (needs matplotlib)")
    if rank:
        p.add_argument("--out", required=True, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    a.transports = [t for t in a.transports.split(",") if t]
    a.batch_size = parse_size(a.batch_size)
    a.bytes = parse_size(a.bytes)
    if a.bytes < 1:
        p.error("--bytes must be at least 1")
    if a.streams is not None and a.streams < 1:
        p.error("--streams must be at least 1")
    bad = [t for t in a.transports if t not in TRANSPORT_ENV]
    if bad:
        p.error(f"unknown transport(s) {bad}; choose from {sorted(TRANSPORT_ENV)}")
    return a


def set_bytes_per_figure(nbytes: int) -> None:
    """--bytes: what every later measurement of this process moves per size (within 3..2000 ops)."""
    global _budget
    _budget = nbytes


def _reps(size: int) -> int:
    return max(3, min(2000, _budget // max(size, 1)))


# ---------------------------------------------------------------- measurements

def _windows(mesh, transport: str, nbytes: int):
    """(src, dst) windows on every rank, registered with the transport forced."""
    os.environ["FLAGCX_MESH_TRANSPORT"] = TRANSPORT_ENV[transport]
    if transport == "cma":
        keep = [np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)]
        return mesh.register_window(keep[0]), mesh.register_window(keep[1])
    src, dst = mesh.alloc_window(nbytes), mesh.alloc_window(nbytes)
    np.frombuffer(src.buffer, np.uint8)[:] = 1
    return src, dst


def put_bandwidth(mesh, src, dst, size: int) -> Optional[float]:
    """GB/s of rank 0 -> rank 1 puts of `size` bytes (rank 0 returns it)."""
    mesh.barrier()
    if mesh.rank != 0:
        mesh.barrier()
        return None
    mesh.put(1, src, 0, dst, 0, size)  # warm-up
    mesh.flush(1, timeout=60)
    reps = _reps(size)
    t0 = time.perf_counter()
    for _ in range(reps):
        mesh.put(1, src, 0, dst, 0, size)
    mesh.flush(1, timeout=120)
    dt = time.perf_counter() - t0
    mesh.barrier()
    return reps * size / dt / 1e9


def put_signal_latency(mesh, src, dst, sig, iters: int) -> Optional[float]:
    """Median one-way latency (us) of an 8-byte put_signal ping-pong."""
    base = [mesh.read_signal(s, window=sig) for s in (0, 1)]
    mesh.barrier()
    times = []
    for i in range(1, iters + 1):
        t0 = time.perf_counter()
        if mesh.rank == 0:
            mesh.put_signal(1, src, 0, dst, 0, 8, slot=0, signal_window=sig)
            mesh.wait_signal(1, base[1] + i, timeout=30, window=sig)
        else:
            mesh.wait_signal(0, base[0] + i, timeout=30, window=sig)
            mesh.put_signal(0, src, 0, dst, 0, 8, slot=1, signal_window=sig)
        times.append(time.perf_counter() - t0)
    mesh.barrier()
    return statistics.median(times) / 2 * 1e6 if mesh.rank == 0 else None


def batch_bandwidth(mesh, src, dst, n: int, size: int) -> Optional[Dict[str, float]]:
    """GB/s of n puts of `size` bytes to rank 1 (flush included) issued three ways: a loop of
    put(), one batch_put() of a list of tuples, one batch_put() of an (n, 3) uint64 array."""
    span = max(1, min(dst.size, src.size) // size)
    entries = [((i % span) * size, (i % span) * size, size) for i in range(n)]
    array = np.array(entries, dtype=np.uint64)
    ways = {
        "put loop": lambda: [mesh.put(1, src, so, dst, do, sz) for so, do, sz in entries],
        "batch list": lambda: mesh.batch_put(1, src, dst, entries),
        "batch array": lambda: mesh.batch_put(1, src, dst, array),
    }
    mesh.barrier()
    if mesh.rank != 0:
        mesh.barrier()
        return None
    out = {}
    for name, issue in ways.items():
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            issue()
            mesh.flush(1, timeout=120)
            best = min(best, time.perf_counter() - t0)
        out[name] = n * size / best / 1e9
    mesh.barrier()
    return out


def memcpy_bandwidth(size: int) -> float:
    a, b = np.ones(size, np.uint8), np.zeros(size, np.uint8)
    np.copyto(b, a)
    reps = _reps(size)
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(b, a)
    return reps * size / (time.perf_counter() - t0) / 1e9


def _socket_pair(mesh):
    """A TCP connection rank 0 -> rank 1 on the mesh's interface."""
    from ... import _core

    host = _core.local_host().strip("[]")
    if mesh.rank == 1:
        lst = socket.create_server((host, 0))
        mesh.allgather(str(lst.getsockname()[1]).encode())
        conn, _ = lst.accept()
        lst.close()
        return conn
    port = int(mesh.allgather(b"")[1])
    return socket.create_connection((host, port))


def _socket_pairs(mesh, n: int):
    """n TCP connections rank 0 -> rank 1 on the mesh's interface."""
    return [_socket_pair(mesh) for _ in range(n)]


RECV_CALL_BYTES = 4 << 20  # the most one recv_into of the references asks for


def _land(sock, reps: int, size: int) -> None:
    """Receive reps transfers of `size` bytes, each landing over one destination of `size` bytes
    (as a put lands over its window, not into a small buffer that stays in the cache), in
    recv_into calls of at most RECV_CALL_BYTES. Its pages are touched first, as a registered
    window's are."""
    view = memoryview(np.ones(max(size, 1), np.uint8))
    for _ in range(reps):
        got = 0
        while got < size:
            got += sock.recv_into(view[got:min(size, got + RECV_CALL_BYTES)])


def streams_bandwidth(mesh, socks, size: int) -> Optional[float]:
    """GB/s of `size`-byte transfers rank 0 -> rank 1 split evenly over `socks`, one thread per
    socket on each side (sendall / recv_into release the GIL), each socket ended by a 1-byte ack."""
    import threading

    reps, n = _reps(size), len(socks)
    parts = [size // n + (1 if i < size % n else 0) for i in range(n)]
    mesh.barrier()
    if mesh.rank == 1:
        def drain(i):
            _land(socks[i], reps, parts[i])
            socks[i].sendall(b"k")
        threads = [threading.Thread(target=drain, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return None
    payload = memoryview(np.ones(size, np.uint8))
    offsets = [sum(parts[:i]) for i in range(n)]

    def pump(i):
        piece = payload[offsets[i]:offsets[i] + parts[i]]
        for _ in range(reps):
            if parts[i]:
                socks[i].sendall(piece)
        socks[i].recv(1)
    threads = [threading.Thread(target=pump, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return reps * size / (time.perf_counter() - t0) / 1e9


def socket_bandwidth(mesh, sock, size: int) -> Optional[float]:
    """GB/s of `size`-byte sendall()s rank 0 -> rank 1, ended by a 1-byte ack."""
    reps = _reps(size)
    mesh.barrier()
    if mesh.rank == 1:
        _land(sock, reps, size)
        sock.sendall(b"k")
        return None
    payload = memoryview(np.ones(size, np.uint8))
    t0 = time.perf_counter()
    for _ in range(reps):
        sock.sendall(payload)
    sock.recv(1)
    return reps * size / (time.perf_counter() - t0) / 1e9


def socket_latency(mesh, sock, iters: int) -> Optional[float]:
    """Median one-way latency (us) of an 8-byte ping-pong on the raw socket."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg, buf, times = b"x" * 8, bytearray(8), []
    mesh.barrier()
    for _ in range(iters):
        t0 = time.perf_counter()
        if mesh.rank == 0:
            sock.sendall(msg)
            _recv_exact(sock, buf)
        else:
            _recv_exact(sock, buf)
            sock.sendall(msg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / 2 * 1e6 if mesh.rank == 0 else None


def _recv_exact(sock, buf: bytearray) -> None:
    view, got = memoryview(buf), 0
    while got < len(buf):
        got += sock.recv_into(view[got:])


# ---------------------------------------------------------------- rank programs

def tcp_connections() -> set:
    """The inodes of this process's established TCP connections (/proc: its socket fds that
    /proc/self/net/tcp{,6} lists in state 01)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    established = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "01":
                established.add(cols[9])
    return mine & established


def _measure_transport(mesh, t: str, args) -> Dict[str, object]:
    before = tcp_connections()
    src, dst = _windows(mesh, t, max(args.sizes))
    sig = mesh.signal_window(2)
    row: Dict[str, object] = {"mode": dst.mode, "paths": dst.paths[1 - mesh.rank][0]}
    row["bandwidth_gbs"] = {str(s): put_bandwidth(mesh, src, dst, s) for s in args.sizes}
    if args.batch > 0:
        row["batch_gbs"] = batch_bandwidth(mesh, src, dst, args.batch, args.batch_size)
    row["latency_us"] = put_signal_latency(mesh, src, dst, sig, args.latency_iters // (4 if t == "tcp" else 1))
    if t == "ucx":  # the streams UCX's tcp opened, as rank 0 counts them (both ranks take its count)
        row["tcp_streams"] = int(mesh.allgather(str(len(tcp_connections() - before)).encode())[0])
    for w in (src, dst, sig):
        w.close()
    return row


def _streams_gbs(mesh, n: int, sizes) -> Dict[str, float]:
    """Raw TCP over n socket pairs made for it (every rank calls it alike), GB/s per size."""
    socks = _socket_pairs(mesh, n)
    try:
        return {str(s): streams_bandwidth(mesh, socks, s) for s in sizes}
    finally:
        for sk in socks:
            sk.close()


def _ucx_streams_reference(mesh, out: Dict[str, object], args) -> None:
    """Raw TCP on as many sockets as UCX used (when it used any), beside the other references."""
    n = out["ucx"]["tcp_streams"] if "ucx" in out else 0
    if n >= 1:
        out["ucx_streams"] = n
        out["ucx_streams_gbs"] = _streams_gbs(mesh, n, args.sizes)


def rank_entry(argv: List[str]) -> int:
    from ...mesh import Mesh

    args = _parse(argv, "put-rank", rank=True)
    set_bytes_per_figure(args.bytes)
    with Mesh.from_launcher(timeout=60) as mesh:
        out: Dict[str, object] = {t: _measure_transport(mesh, t, args) for t in args.transports}
        with _socket_pair(mesh) as sock:
            out["socket_gbs"] = {str(s): socket_bandwidth(mesh, sock, s) for s in args.sizes}
            out["socket_latency_us"] = socket_latency(mesh, sock, args.latency_iters // 4)
        out["tcp_lanes"] = mesh.tcp_lanes
        out["streams"] = args.streams or mesh.tcp_lanes
        out["streams_gbs"] = _streams_gbs(mesh, out["streams"], args.sizes)
        _ucx_streams_reference(mesh, out, args)
        if mesh.rank == 0:
            out["memcpy_gbs"] = {str(s): memcpy_bandwidth(s) for s in args.sizes}
            with open(args.out, "w") as f:
                json.dump(out, f)
        mesh.barrier()
    return 0


def _reference(data: dict, name: str, k: str) -> float:
    """A ratio's denominator: a limit measured in the run (memcpy, socket, streams) or another path's figure."""
    return data[name + "_gbs"][k] if name + "_gbs" in data else data[name]["bandwidth_gbs"][k]


def _report(data: dict, args) -> None:
    ts = args.transports
    print("put bandwidth, rank 0 -> rank 1 on this host (GB/s, flush included)")
    n = data["streams"]
    sx = f"socket x{n}"
    print(f"  (tcp: {data.get('tcp_lanes', 1)} lane(s) per pair, FLAGCX_MESH_TCP_LANES; socket: one raw TCP "
          f"connection; {sx}: {n} connections at once, one thread each)")
    ux = f"socket x{data['ucx_streams']}" if "ucx_streams" in data else ""
    if ux:
        print(f"  (ucx: UCX opened {data['ucx_streams']} TCP connection(s) to the peer; {ux}: raw TCP on as many)")
    head = f"  {'size':>8}" + "".join(f"{t:>9}" for t in ts) + f"{'memcpy':>9}{'socket':>9}{sx:>11}"
    head += f"{ux + ' (ucx)':>18}" if ux else ""
    ratios = [("shm", "memcpy"), ("cma", "memcpy"), ("tcp", "socket"), ("tcp", "streams"), ("ucx", "tcp"),
              ("ucx", "ucx_streams")]
    ratios = [(a, b) for a, b in ratios if a in ts and (b + "_gbs" in data or b in ts)]
    label = {"streams": sx, "ucx_streams": ux}
    print(head + "".join(f"{a + '/' + label.get(b, b):>15}" for a, b in ratios))
    for s in args.sizes:
        k = str(s)
        line = f"  {size_name(s):>8}" + "".join(f"{data[t]['bandwidth_gbs'][k]:>9.2f}" for t in ts)
        line += f"{data['memcpy_gbs'][k]:>9.2f}{data['socket_gbs'][k]:>9.2f}{data['streams_gbs'][k]:>11.2f}"
        line += f"{data['ucx_streams_gbs'][k]:>18.2f}" if ux else ""
        line += "".join(f"{data[a]['bandwidth_gbs'][k] / _reference(data, b, k):>15.2f}" for a, b in ratios)
        print(line)
    print("put_signal latency, 8 bytes, one way (median of a ping-pong, us): " +
          ", ".join(f"{t} {data[t]['latency_us']:.1f}" for t in ts) +
          f"; raw socket ping-pong {data['socket_latency_us']:.1f}")
    if args.batch > 0:
        print(f"{args.batch} puts of {size_name(args.batch_size)} to one peer, flush included (GB/s, best of 5)")
        for t in ts:
            b = data[t]["batch_gbs"]
            print(f"  {t:>4}: " + ", ".join(f"{k} {v:.2f}" for k, v in b.items()) +
                  f"; batch array / put loop {b['batch array'] / b['put loop']:.2f}")
    print("window modes actually used: " + ", ".join(f"{t} -> {data[t]['mode']}" for t in ts))


def main(argv: List[str]) -> int:
    if any(a == "--device" or a.startswith("--device=") for a in argv):
        from . import put_cuda

        return put_cuda.main(argv)
    args = _parse(argv, "put")
    data = run_ranks("put", ["put-rank", *argv], 2, timeout=900)
    if data is None:
        return 1
    _report(data, args)
    save_json(data, args.json)
    plot(data, args)
    return 0


def plot(data: dict, args) -> bool:
    """--plot: every transport beside the memcpy and raw-socket references."""
    series = {t: data[t]["bandwidth_gbs"] for t in args.transports}
    series["ref: memcpy"] = data["memcpy_gbs"]
    series["ref: raw socket"] = data["socket_gbs"]
    if "streams_gbs" in data:
        series[f"ref: raw socket x{data['streams']}"] = data["streams_gbs"]
    if "ucx_streams_gbs" in data:
        series[f"ref: raw socket x{data['ucx_streams']} (ucx's)"] = data["ucx_streams_gbs"]
    return save_plot(args.plot, "flagcx_mesh put bandwidth, 2 ranks on one host (flush included)",
                     [("host memory", series)])
