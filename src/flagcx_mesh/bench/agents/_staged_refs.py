"""The references a staged batch is read by, measured in the same run (bench agent --device cuda
with staged among --paths): pinned copies (device -> pinned host, pinned host -> device) and raw
TCP over loopback, one connection, four, and as many as the staged connection's tcp lanes (a
staged batch of 1 MiB or more is striped over them), each out of one 1 MiB buffer into another;
beside them, for context, the same lanes through rings of a staged lane's sizes (distinct bytes).
The goal of a staged batch of 64 MiB and up: at least 0.8x the slower of its two stages, i.e.
min(the pinned copies' pipelined rate min(D2H, H2D), raw TCP over the same lanes)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Dict, Optional

GOAL = 0.8
CHUNK = 1 << 20


def _drain(conn: socket.socket, n: int, ring: memoryview) -> None:
    """Receives n bytes into `ring`, CHUNK at a time, going round it."""
    got = 0
    while got < n:
        at = got % len(ring)
        k = conn.recv_into(ring[at:at + min(CHUNK, n - got)])
        if k == 0:
            raise ConnectionError("the loopback sender closed early")
        got += k


# A staged lane's rings: its part's 16 slots of 1 MiB at the sender, 4 landing buffers at the target.
SEND_RING, RECV_RING = 16 * CHUNK, 4 * CHUNK


def tcp_loopback_gbps(nbytes: int, lanes: int = 1, send_ring: int = CHUNK, recv_ring: int = CHUNK) -> float:
    """nbytes sent over `lanes` loopback connections at once (nbytes / lanes each), GB/s, each
    connection sending out of a ring of `send_ring` bytes into one of `recv_ring` bytes (by
    default one 1 MiB buffer each side, which stays in the CPU's caches)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(lanes)
    pairs = []
    for _ in range(lanes):
        c = socket.create_connection(srv.getsockname())
        s, _ = srv.accept()
        pairs.append((c, s))
    srv.close()
    each = nbytes // lanes
    sources = [memoryview(bytearray(send_ring)) for _ in range(lanes)]
    sinks = [memoryview(bytearray(recv_ring)) for _ in range(lanes)]

    def send(c: socket.socket, ring: memoryview) -> None:
        sent = 0
        while sent < each:
            at, n = sent % len(ring), min(CHUNK, each - sent)
            c.sendall(ring[at:at + n])
            sent += n

    threads = [threading.Thread(target=send, args=(c, sources[i])) for i, (c, _) in enumerate(pairs)]
    threads += [threading.Thread(target=_drain, args=(s, each, sinks[i])) for i, (_, s) in enumerate(pairs)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    for c, s in pairs:
        c.close()
        s.close()
    return each * lanes / took / 1e9


def references(mem, nbytes: int, lanes: int = 1) -> Dict[str, Optional[float]]:
    """Pinned D2H and H2D GB/s (None without torch) and raw loopback TCP over 1 and 4 lanes, and
    over `lanes` (the staged connection's), which the reference takes."""
    d2h, h2d = mem.pinned_gbps(nbytes) if hasattr(mem, "pinned_gbps") else (None, None)
    out = {"pinned_d2h_GBps": d2h, "pinned_h2d_GBps": h2d, "lanes": lanes,
           "tcp_1_lane_GBps": max(tcp_loopback_gbps(nbytes, 1) for _ in range(2)),
           "tcp_4_lanes_GBps": max(tcp_loopback_gbps(nbytes, 4) for _ in range(2))}
    same = {1: out["tcp_1_lane_GBps"], 4: out["tcp_4_lanes_GBps"]}.get(lanes)
    out["tcp_same_lanes_GBps"] = same if same else max(tcp_loopback_gbps(nbytes, lanes) for _ in range(2))
    # Context, not the goal's reference: the same lanes moving distinct bytes through rings of a
    # staged lane's sizes, as a batch does (the reference's one buffer a side stays in the caches).
    out["tcp_same_lanes_rings_GBps"] = max(tcp_loopback_gbps(nbytes, lanes, SEND_RING, RECV_RING) for _ in range(2))
    pinned = min(d2h, h2d) if d2h and h2d else None
    out["pinned_pipelined_GBps"] = pinned
    tcp = out["tcp_same_lanes_GBps"]
    out["reference_GBps"] = min(pinned, tcp) if pinned else tcp
    return out


def _f(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def report(staged: Dict, refs: Dict, count: int, path: str = "staged") -> Dict[str, Optional[float]]:
    """Prints each block size's GB/s over `path` (staged, staged-host) beside the references and
    their ratio (goal: >= 0.8); the references' line once."""
    if "ratios" not in refs and "ratios_host" not in refs:  # the first path reported
        _print_refs(refs)
    ratios: Dict[str, Optional[float]] = {}
    for name, r in staged.get("request", {}).items():
        for mode in ("pipelined_GBps", "blocking_GBps"):
            ref = refs["reference_GBps"]
            ratios[f"{name}_{mode}_over_reference"] = r[mode] / ref if ref else None
        print(f"[staged refs] {path}: {count} x {name}: pipelined {r['pipelined_GBps']:.2f} GB/s = "
              f"{_f(ratios[f'{name}_pipelined_GBps_over_reference'])}x the reference "
              f"(goal >= {GOAL}), blocking {_f(ratios[f'{name}_blocking_GBps_over_reference'])}x", flush=True)
    return ratios


def _print_refs(refs: Dict) -> None:
    print(f"[staged refs] pinned D2H {_f(refs['pinned_d2h_GBps'])} GB/s, H2D {_f(refs['pinned_h2d_GBps'])} GB/s; "
          f"raw loopback TCP 1 lane {_f(refs['tcp_1_lane_GBps'])} GB/s, 4 lanes {_f(refs['tcp_4_lanes_GBps'])} GB/s, "
          f"{refs['lanes']} lane(s) {_f(refs['tcp_same_lanes_GBps'])} GB/s (a staged batch of 1 MiB or more is striped over "
          f"the connection's {refs['lanes']} tcp lane(s)), through rings of a staged lane's sizes (16 MiB out, 4 MiB "
          f"in) {_f(refs['tcp_same_lanes_rings_GBps'])} GB/s; reference min(pinned, tcp {refs['lanes']} lane(s)) "
          f"{_f(refs['reference_GBps'])} GB/s",
          flush=True)
