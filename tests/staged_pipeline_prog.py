"""One rank of the pipelined staged path's jobs (docs/gpu.md, "How the staged path pipelines"),
on the fake driver, 2 ranks, every device window forced to staged and small chunks so that
ops of a few hundred KiB cross many chunk boundaries and wrap their ring::

    FLAGCX_MESH_CUDA_PATH=staged FLAGCX_MESH_STAGED_CHUNK_BYTES=65536 \\
    FLAGCX_MESH_STAGED_INFLIGHT_BYTES=262144 python -m flagcx_mesh.launch -n 2 --timeout T -- \\
        python tests/staged_pipeline_prog.py SCENARIO --device fake

Scenarios:
  integrity    both ranks put and get sizes around the chunk size at odd offsets, with and
               without a stream; every byte of every put (replayed in FIFO order at the target)
               and of every get (checked as each get returns) is compared.
  signal_fifo  rank 0 put_signals multi-chunk puts of new bytes into one region; rank 1, as
               soon as each signal is seen, reads the region: it must hold all of that put's
               bytes (the signal never comes before the data landed).
  peer_death   rank 1 dies while rank 0 keeps multi-chunk puts going: rank 0 fails with
               PeerLost naming peer 1 within the mesh timeout, no hang.
  cut_short    rank 0's multi-chunk put_signal times out in its copies down after its frame
               started: the frame is cut short, rank 1 loses rank 0 and never applies the signal.
  first_send_fails  rank 1 stops; rank 0 shuts its sockets to it for sending, so the first send of
               its next put, made by the calling thread on an idle connection, fails: the put fails
               with PeerLost at once (it was dropped unsent and waited for ring slots until its
               deadline, "timed out with 0 of N bytes sent").
  backpressure rank 0 makes many multi-chunk puts to rank 1, whose copies up are slow; the
               staging its puts held never passed FLAGCX_MESH_STAGED_INFLIGHT_BYTES
               (mesh.stats()["staged_bytes_peak"]) and every byte landed.
Each rank ends with ``OK rank R SCENARIO``; a failing one prints ``FAIL rank R SCENARIO: why``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
import traceback

from flagcx_mesh import Mesh, MeshTimeout, PeerLost

from gpu_prog import Fail, FakeDevice, check, check_paths, pattern
from meshutil import stream_sockets, tcp_addresses, wait_stopped

CHUNK = int(os.environ.get("FLAGCX_MESH_STAGED_CHUNK_BYTES", str(4 << 20)))
INFLIGHT = int(os.environ.get("FLAGCX_MESH_STAGED_INFLIGHT_BYTES", str(64 << 20)))


def sizes_around_chunks() -> list:
    c = CHUNK
    return [1, c - 1, c, c + 1, 2 * c - 1, 2 * c + 1, 3 * c + 7, 4 * c, 5 * c + 3, 9 * c + 11]


def integrity(mesh: Mesh, dev, args) -> None:
    peer = 1 - mesh.rank
    span = 10 * CHUNK + 8192
    src = mesh.alloc_window(span, device=0)
    dst = mesh.alloc_window(span, device=0)
    got = mesh.alloc_window(span, device=0)
    for w, what in ((src, "source"), (dst, "target"), (got, "get target")):
        check_paths(mesh, w, "staged", what)
    dev.window_bytes(src).write(0, pattern(100 + mesh.rank, span))
    mesh.barrier(timeout=args.mesh_timeout)
    stream = dev.stream()

    def plan(rank):  # (size, src_off, dst_off, on_stream) of rank's puts, in order
        out = []
        for k, n in enumerate(sizes_around_chunks()):
            odd = (k * 4099 + 3) % (span - n + 1)
            out.append((n, odd, (k * 12347 + 1) % (span - n + 1), k % 2 == 1))
        return out

    for n, so, do, on_stream in plan(mesh.rank):
        mesh.put(peer, src, so, dst, do, n, stream=stream if on_stream else None)
    theirs = pattern(100 + peer, span)
    for n, so, do, on_stream in plan(mesh.rank):  # gets of the peer's source, checked as each returns
        mesh.get(peer, src, so, got, do, n, stream=stream if on_stream else None)
        mesh.flush(peer, timeout=args.mesh_timeout)
        seen = dev.window_bytes(got).read(do, n)
        check(seen == theirs[so:so + n], f"get of {n} B from offset {so}: wrong bytes")
    mesh.flush(timeout=args.mesh_timeout)
    mesh.barrier(timeout=args.mesh_timeout)
    model = bytearray(span)
    for n, so, do, _ in plan(peer):
        model[do:do + n] = theirs[so:so + n]
    seen = dev.window_bytes(dst).read(0, span)
    if seen != bytes(model):
        bad = next(i for i in range(span) if seen[i] != model[i])
        raise Fail(f"puts from rank {peer}: first wrong byte at {bad} (got {seen[bad]}, want {model[bad]})")
    print(f"integrity: {len(plan(0))} puts and gets of 1 B .. {max(sizes_around_chunks())} B, "
          f"chunks of {CHUNK} B, checked", flush=True)


def signal_fifo(mesh: Mesh, dev, args) -> None:
    n, rounds = 7 * CHUNK + 5, 6
    win = mesh.alloc_window(n + 3, device=0)
    sig = mesh.signal_window(1)
    check_paths(mesh, win, "staged", "window")
    mesh.barrier(timeout=args.mesh_timeout)
    for k in range(1, rounds + 1):
        data = pattern(1000 + k, n)
        if mesh.rank == 0:
            dev.window_bytes(win).write(0, data)
            mesh.put_signal(1, win, 0, win, 3, n, 0, 1, signal_window=sig)
            check(mesh.recv(1, timeout=args.mesh_timeout) == b"seen", "rank 1's answer")
        else:
            mesh.wait_signal(0, k, timeout=args.mesh_timeout, window=sig)
            seen = dev.window_bytes(win).read(3, n)
            if seen != data:
                bad = next(i for i in range(n) if seen[i] != data[i])
                raise Fail(f"round {k}: signal seen before byte {bad} of {n} landed")
            mesh.send(0, b"seen", timeout=args.mesh_timeout)
    mesh.flush(timeout=args.mesh_timeout)
    print(f"signal_fifo: {rounds} put_signals of {n} B, each signal after all its bytes", flush=True)


def peer_death(mesh: Mesh, dev, args) -> None:
    n = 40 * CHUNK
    win = mesh.alloc_window(n, device=0)
    mesh.barrier(timeout=args.mesh_timeout)
    if mesh.rank == 1:
        time.sleep(0.5)
        print("OK rank 1 peer_death (dying)", flush=True)
        os._exit(0)
    t0, ops = time.monotonic(), 0
    try:
        while time.monotonic() - t0 < args.mesh_timeout:
            mesh.put(1, win, 0, win, 0, n)
            ops += 1
        raise Fail(f"{ops} puts to a dead peer did not fail in {args.mesh_timeout} s")
    except PeerLost as e:
        check(e.peer == 1 or "peer 1" in str(e), f"PeerLost should name peer 1: {e}")
        took = time.monotonic() - t0
        check(took < args.mesh_timeout / 2, f"the loss took {took:.1f} s to be seen")
        print(f"peer_death: loss seen after {ops} puts of {n} B, {took:.2f} s: {e}", flush=True)
    print("OK rank 0 peer_death", flush=True)
    os._exit(0)  # the mesh's goodbye to a dead peer is not part of the test


def _other_rank_pid() -> int:
    """The launcher's other child: the other rank of a 2-rank job."""
    ppid = os.getppid()
    with open(f"/proc/{ppid}/task/{ppid}/children") as f:
        kids = [int(k) for k in f.read().split() if int(k) != os.getpid()]
    check(len(kids) == 1, f"the launcher's other children: {kids}")
    return kids[0]


def _shut_sending_to(pid: int) -> int:
    """Shuts for sending each of this process's TCP sockets connected to process `pid`: the next
    send on each fails (EPIPE) at once, and nothing arrives here to tell a reader of it."""
    theirs, shut = tcp_addresses(pid), 0
    for s in stream_sockets():
        if s.family == socket.AF_INET and s.getpeername() in theirs:
            s.shutdown(socket.SHUT_WR)
            shut += 1
        s.close()
    return shut


def first_send_fails(mesh: Mesh, dev, args) -> None:
    n = 40 * CHUNK
    win = mesh.alloc_window(n, device=0)
    mesh.barrier(timeout=args.mesh_timeout)
    if mesh.rank == 1:
        print("OK rank 1 first_send_fails (stopping)", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # continued by rank 0 once its put failed
        os._exit(0)
    peer = _other_rank_pid()
    try:
        wait_stopped(peer, f"rank 1 (pid {peer})", args.mesh_timeout)
        check(_shut_sending_to(peer) >= 1, "no socket to rank 1 found")
        t0 = time.monotonic()
        try:
            mesh.put(1, win, 0, win, 0, n)
            raise Fail("a put whose first send failed completed")
        except PeerLost as e:
            took = time.monotonic() - t0
            check(e.peer == 1 or "peer 1" in str(e), f"PeerLost should name peer 1: {e}")
            check(took < args.mesh_timeout / 2, f"the loss took {took:.1f} s to be seen")
            print(f"first_send_fails: PeerLost after {took:.3f} s: {e}", flush=True)
    finally:
        os.kill(peer, signal.SIGCONT)
    print("OK rank 0 first_send_fails", flush=True)
    os._exit(0)  # the mesh's goodbye to a stopped peer is not part of the test


def cut_short(mesh: Mesh, dev, args) -> None:
    """Copies down of 1 s a chunk and a mesh timeout of 3 s: rank 0's put_signal of 6 chunks
    is posted after its first chunk and times out during its third, its frame half sent. Rank 0
    lives on for LINGER s after that, so rank 1 must see the frame cut short (not the exit)."""
    linger = 6.0
    n = 6 * CHUNK
    win = mesh.alloc_window(n, device=0)
    sig = mesh.signal_window(1)
    mesh.barrier(timeout=60)
    if mesh.rank == 0:
        t0 = time.monotonic()
        try:
            mesh.put_signal(1, win, 0, win, 0, n, 0, 1, signal_window=sig)
            raise Fail("a put_signal past its deadline returned")
        except MeshTimeout as e:
            print(f"cut_short: rank 0's put_signal failed after {time.monotonic() - t0:.1f} s: {e}", flush=True)
        time.sleep(linger)
    else:
        t0 = time.monotonic()
        try:
            mesh.wait_signal(0, 1, timeout=30, window=sig)
            raise Fail("the signal of a put cut short was applied")
        except PeerLost as e:
            check("peer 0" in str(e) or e.peer == 0, f"PeerLost should name peer 0: {e}")
            check(mesh.read_signal(0, window=sig) == 0, "the signal of a put cut short was applied")
            took = time.monotonic() - t0
            check(took < args.mesh_timeout + linger / 2, f"rank 0 was lost only after {took:.1f} s (its exit?)")
            print(f"cut_short: rank 1 lost rank 0 after {took:.1f} s, signal not applied: {e}", flush=True)
    print(f"OK rank {mesh.rank} cut_short", flush=True)
    os._exit(0)  # the mesh is broken between them: its goodbye is not part of the test


def backpressure(mesh: Mesh, dev, args) -> None:
    n, count = 16 * CHUNK + 1, 10
    win = mesh.alloc_window(count * n, device=0)
    check_paths(mesh, win, "staged", "window")
    if mesh.rank == 0:
        dev.window_bytes(win).write(0, pattern(7, count * n))
    mesh.barrier(timeout=args.mesh_timeout)
    if mesh.rank == 0:
        for k in range(count):
            mesh.put(1, win, k * n, win, k * n, n)
        mesh.flush(timeout=args.mesh_timeout)
        peak = mesh.stats()["staged_bytes_peak"]
        check(0 < peak <= INFLIGHT, f"staging held for peer 1 peaked at {peak} B, over the bound of {INFLIGHT}")
        print(f"backpressure: {count} puts of {n} B held at most {peak} B of staging (bound {INFLIGHT})",
              flush=True)
    mesh.barrier(timeout=args.mesh_timeout)
    if mesh.rank == 1:
        check(dev.window_bytes(win).read(0, count * n) == pattern(7, count * n), "the puts' bytes")


SCENARIOS = {"integrity": integrity, "signal_fifo": signal_fifo, "peer_death": peer_death,
             "backpressure": backpressure, "cut_short": cut_short, "first_send_fails": first_send_fails}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--device", choices=("fake",), default="fake")
    ap.add_argument("--mesh-timeout", type=float, default=30)
    args = ap.parse_args()
    dev = FakeDevice()
    with Mesh.from_launcher(timeout=args.mesh_timeout) as mesh:
        try:
            SCENARIOS[args.scenario](mesh, dev, args)
            mesh.barrier(timeout=args.mesh_timeout)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL rank {mesh.rank} {args.scenario}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
            sys.stdout.flush()
            os._exit(1)
        print(f"OK rank {mesh.rank} {args.scenario}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
