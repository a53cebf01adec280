"""One rank of a one-sided test job (integrity, ordering, threads, bad input, timeouts, peer death).

Run under the embedded launcher::

    python -m flagcx_mesh.launch -n N --timeout T -- python tests/onesided_prog.py SCENARIO [--seed S]

with FLAGCX_MESH_TRANSPORT=tcp|cma|shm|auto in the environment to force a transport.
Scenarios (each asserts, and on failure prints ``FAIL rank R SCENARIO: why`` plus a
traceback on stderr and exits 1):

    integrity    random contents at random offsets/sizes (0, 1, unaligned, whole window),
                 put / batch_put / put_signal / get, user and library windows as source and
                 destination, to every peer including self; byte-for-byte checks
    ordering     put_signal under load: a signal is never seen before its data; signal-only
                 after puts; value 0 = data only; op="set"
    threads      4 threads per rank issuing puts / gets / put_signals concurrently, on two
                 contexts, then flush; counter and contents checked
    bad_input    every bad input of issue item 4 is refused with a clear error, and every
                 window of every rank is byte-for-byte unchanged afterwards
    timeout      wait_signal / wait_counter time out naming slot, values and last signaller
    peer_death   rank 1 stops, the survivors queue ops to it, then it is SIGKILLed (no
                 goodbye); flush / wait_signal / wait_counter fail with PeerLost naming it,
                 within seconds

Rank 0 prints ``modes user=X alloc=Y signal=Z`` (the modes of its windows) and every rank
checks that each window's per-peer paths match the forced transport. The last line of a
passing rank is ``OK rank R SCENARIO ...``.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import os
import resource
import signal
import sys
import threading
import time
import traceback

import numpy as np

from flagcx_mesh import Mesh
from flagcx_mesh.errors import InvalidArgument, MeshClosed, MeshTimeout, PeerLost

RANK = -1
SCENARIO = "?"
TIMEOUT = 60.0  # bound on every wait below (the launcher's --timeout is the hard one)


class Fail(AssertionError):
    pass


def check(cond, msg) -> None:
    if not cond:
        raise Fail(msg() if callable(msg) else msg)


def log(text: str) -> None:
    print(f"rank {RANK}: {text}", flush=True)


def sha(buf) -> str:
    return hashlib.sha256(memoryview(buf).cast("B")).hexdigest()[:16]


def u8(win) -> np.ndarray:
    """A writable uint8 numpy view of a window's bytes."""
    return np.frombuffer(win.buffer, dtype=np.uint8)


def first_diff(a: np.ndarray, b: np.ndarray) -> str:
    bad = np.flatnonzero(a != b)
    if bad.size == 0:
        return "no difference"
    i = int(bad[0])
    return (f"{bad.size} byte(s) differ, first at offset {i} (got {int(a[i])}, "
            f"expected {int(b[i])}), last at {int(bad[-1])}")


def rand_bytes(size: int, *key) -> np.ndarray:
    rng = np.random.default_rng([0xF1A6C, *key])
    return np.frombuffer(rng.bytes(size), dtype=np.uint8).copy()


def expect_raises(exc, what: str, fn, *needles, peer=None):
    """fn() must raise `exc` whose message contains every needle (case-insensitive)."""
    try:
        fn()
    except exc as e:
        msg = str(e)
        for n in needles:
            check(str(n).lower() in msg.lower(), f"{what}: message {msg!r} does not mention {n!r}")
        if peer is not None:
            check(getattr(e, "peer", None) == peer, f"{what}: error .peer is {getattr(e, 'peer', None)}, "
                                                    f"expected {peer} ({msg!r})")
        return e
    except Exception as e:  # noqa: BLE001 - reported as the failure
        raise Fail(f"{what}: raised {type(e).__name__}({e}) instead of {exc.__name__}") from e
    raise Fail(f"{what}: no error raised (expected {exc.__name__})")


# ----------------------------------------------------------------------------- transports

def transport() -> str:
    return os.environ.get("FLAGCX_MESH_TRANSPORT", "auto") or "auto"


def expected_path(kind: str, me: int, peer: int) -> str:
    t = transport()
    if t == "tcp":
        return "tcp"
    if peer == me:
        return "self"
    if kind == "signal":
        return "shm"
    if t == "ucx":
        return "ucx"
    if kind == "user" or t == "cma":
        return "cma"
    return "shm"  # library window, shm or auto


def check_paths(mesh, **windows) -> None:
    """Every window's per-peer path matches the forced transport; rank 0 prints the modes.

    Where the kernel refuses cross-memory attach (e.g. Yama ptrace_scope >= 1), a cma path
    must fall back to tcp and say so; the modes line then ends with "cma refused"."""
    refused = ""
    for name, w in windows.items():
        kind = {"user": "user", "alloc": "shm", "signal": "signal"}[name]
        check(w.kind == kind, f"{name} window kind is {w.kind!r}, expected {kind!r}")
        for p, (got, why) in enumerate(w.paths):
            want = expected_path(name, mesh.rank, p)
            if want == "cma" and got == "tcp" and "process_vm_writev not permitted" in why:
                refused = why
                continue
            check(got == want, lambda: f"{name} window: path to peer {p} is {got!r}, expected {want!r} "
                                       f"(FLAGCX_MESH_TRANSPORT={transport()}); {w.describe()}")
            if transport() == "tcp":
                check("FLAGCX_MESH_TRANSPORT=tcp" in why, f"{name} window: forced tcp path does not say why: "
                                                          f"{w.paths}")
        check(f"mode {w.mode}" in w.describe(), f"describe() lacks the mode: {w.describe()}")
    if mesh.rank == 0:
        print("modes " + " ".join(f"{k}={w.mode}" for k, w in windows.items()) +
              (f" cma refused ({refused})" if refused else ""), flush=True)


# ----------------------------------------------------------------------------- integrity

SIZES = {
    "SU": lambda q: (1 << 20) + (64 << 10) + q * 4096 + 7 * q,  # user source
    "SA": lambda q: (384 << 10) + q * 1024 + 5 * q,  # alloc source
    "U": lambda q: (1 << 20) + q * 4096 + q,  # user destination
    "A": lambda q: (256 << 10) + q * 8192 + 3 * q,  # alloc destination
}


def gen_ops(rng, ssizes: dict, dsizes: dict, nops: int):
    """Random (src, src_off, dst, dst_off, size): 0 and 1 bytes, unaligned, end-aligned, whole
    windows."""
    ops = []
    for _ in range(nops):
        s = str(rng.choice(["SU", "SA"]))
        d = str(rng.choice(["U", "A"]))
        ssz, dsz = ssizes[s], dsizes[d]
        top = min(ssz, dsz)
        cat = int(rng.integers(0, 10))
        if cat == 0:
            size = 0
        elif cat == 1:
            size = 1
        elif cat == 2:
            size = int(rng.integers(2, 64))
        elif cat in (3, 4):
            size = int(rng.integers(64, 8192))
        elif cat == 5:
            size = int(rng.integers(8192, min(top, 256 << 10)))
        elif cat == 6:
            size = int(rng.integers(1, top + 1))
        else:
            size = top  # whole destination or whole source window, or end-aligned
        soff = int(rng.integers(0, ssz - size + 1))
        doff = int(rng.integers(0, dsz - size + 1))
        if cat == 7:
            soff = 0 if size == ssz else soff
            doff = 0 if size == dsz else doff
        elif cat == 8:
            soff, doff = ssz - size, dsz - size
        elif cat == 9 and size:
            size = int(rng.integers(1, 4096))
            soff, doff = ssz - size, dsz - size
        ops.append((s, soff, d, doff, size))
    return ops


def sources(q: int):
    return {"SU": rand_bytes(SIZES["SU"](q), q, 1), "SA": rand_bytes(SIZES["SA"](q), q, 2)}


def scenario_integrity(mesh, args) -> None:
    n, r = mesh.nranks, mesh.rank
    sizes_of = lambda q: {k: f(q) for k, f in SIZES.items()}  # noqa: E731
    mine = sizes_of(r)
    src = sources(r)
    su = src["SU"].copy()  # registered, never written remotely
    u = rand_bytes(mine["U"], r, 3)
    W = {"U": mesh.register_window(u), "A": mesh.alloc_window(mine["A"]),
         "SU": mesh.register_window(su), "SA": mesh.alloc_window(mine["SA"])}
    sig = mesh.signal_window(n)
    biggest = max(SIZES["U"](q) for q in range(n))
    scratch_a = mesh.alloc_window(biggest)
    scratch_u = np.zeros(max(SIZES["A"](q) for q in range(n)), np.uint8)
    scratch_uw = mesh.register_window(scratch_u)
    check(W["U"].index == 0 and sig.index == 4 and scratch_uw.index == 6,
          f"window indices are not the registration order: {[w.index for w in W.values()]}")
    check_paths(mesh, user=W["U"], alloc=W["A"], signal=sig)
    view = {k: (u if k == "U" else su if k == "SU" else u8(W[k])) for k in W}
    view["A"][:] = rand_bytes(mine["A"], r, 4)
    view["SA"][:] = src["SA"]
    model = {"U": u.copy(), "A": view["A"].copy()}
    mesh.barrier(timeout=TIMEOUT)
    issued = 0
    nops = args.ops
    stats = {"bytes": 0, "ops": 0}

    def verify(what: str) -> None:
        for k in ("U", "A"):
            check(np.array_equal(view[k], model[k]),
                  lambda: f"{what}: window {k} (#{W[k].index}, {W[k].mode}): {first_diff(view[k], model[k])}")

    # puts: in phase k rank r writes to (r + k) % n, so every target has one writer per phase
    for k in range(n):
        p, q = (r + k) % n, (r - k) % n
        ops = gen_ops(np.random.default_rng([args.seed, r, k, 1]), mine, sizes_of(p), nops)
        pick = np.random.default_rng([args.seed, r, k, 5])
        i = 0
        while i < len(ops) - 1:
            how = int(pick.integers(0, 4))
            s, so, d, do, sz = ops[i]
            if how == 0:  # a batch of the following ops with the same windows
                j = i
                while j < len(ops) - 1 and j - i < 4 and ops[j][0] == s and ops[j][2] == d:
                    j += 1
                mesh.batch_put(p, W[s], W[d], [(o[1], o[3], o[4]) for o in ops[i:j]])
                issued += j - i
                i = j
                continue
            if how == 1:  # value 0: data only, the announce slot must not move
                mesh.put_signal(p, W[s], so, W[d], do, sz, slot=r, value=0)
            else:
                mesh.put(p, W[s], so, W[d], do, sz)
            issued += 1
            i += 1
        s, so, d, do, sz = ops[-1]  # the announcement (size 0: a signal after the puts)
        mesh.put_signal(p, W[s], so, W[d], do, sz, slot=r, value=1)
        issued += 1
        stats["ops"] += len(ops)
        stats["bytes"] += sum(o[4] for o in ops)
        # as the target of q's phase-k puts: wait for the announcement, then replay q's ops
        mesh.wait_signal(q, 1, timeout=TIMEOUT)
        qops = gen_ops(np.random.default_rng([args.seed, q, k, 1]), sizes_of(q), mine, nops)
        qsrc = sources(q)
        for s, so, d, do, sz in qops:
            model[d][do:do + sz] = qsrc[s][so:so + sz]
        verify(f"after phase {k} (puts from rank {q})")
        check(mesh.read_signal(q) == 1, f"announce slot {q} is {mesh.read_signal(q)}, expected 1")
        mesh.barrier(timeout=TIMEOUT)
    check([mesh.read_signal(q) for q in range(n)] == [1] * n,
          f"announce slots {[mesh.read_signal(q) for q in range(n)]}, expected all 1")

    # gets: from every peer's (static) source windows into this rank's destination windows
    for k in range(n):
        p = (r + k) % n
        ops = gen_ops(np.random.default_rng([args.seed, r, k, 2]), sizes_of(p), mine, nops)
        psrc = sources(p)
        for s, so, d, do, sz in ops:
            mesh.get(p, W[s], so, W[d], do, sz)
            model[d][do:do + sz] = psrc[s][so:so + sz]
        issued += len(ops)
        mesh.flush(p, timeout=TIMEOUT)
        verify(f"after gets from rank {p}")

    # cross-check: every rank fetches every peer's whole destination windows
    hashes = [h.decode().split() for h in mesh.allgather(f"{sha(u)} {sha(view['A'])}".encode(),
                                                         timeout=TIMEOUT)]
    for p in range(n):
        ps = sizes_of(p)
        mesh.get(p, W["U"], 0, scratch_a, 0, ps["U"])
        mesh.get(p, W["A"], 0, scratch_uw, 0, ps["A"])
        issued += 2
        mesh.flush(p, timeout=TIMEOUT)
        got = (sha(u8(scratch_a)[:ps["U"]]), sha(scratch_u[:ps["A"]]))
        check(list(got) == hashes[p], f"whole-window get from rank {p}: hashes {got} != {hashes[p]}")
    mesh.flush(timeout=TIMEOUT)
    check(mesh.read_counter() == issued, f"read_counter() {mesh.read_counter()} != {issued} ops issued")
    mesh.wait_counter(issued, timeout=5)
    check(np.array_equal(su, src["SU"]) and np.array_equal(view["SA"], src["SA"]),
          "a source window changed")
    mesh.barrier(timeout=TIMEOUT)
    for w in list(W.values()) + [sig, scratch_a, scratch_uw]:
        w.close()
    log(f"integrity: {stats['ops']} puts ({stats['bytes']} bytes) to {n} ranks, {issued} ops in all")


# ----------------------------------------------------------------------------- ordering

WORD = np.uint64(0x9E3779B97F4A7C15)


def chunk_base(src: int, seq: int) -> np.uint64:
    return np.uint64(((seq + 1) * int(WORD) ^ (src << 56)) & 0xFFFFFFFFFFFFFFFF)


def scenario_ordering(mesh, args) -> None:
    n, r = mesh.nranks, mesh.rank
    count, chunk, ring = args.count, args.chunk, 32
    words = chunk // 8
    tail = ring  # plain puts followed by a size-0 signal
    per = (count + tail + 2) // 2 + 1  # chunks per target window (even seqs -> alloc, odd -> user)
    t_user = np.zeros(per * chunk, np.uint8)
    TU = mesh.register_window(t_user)
    TA = mesh.alloc_window(per * chunk)
    s_user = np.zeros(ring * chunk, np.uint8)
    SU = mesh.register_window(s_user)
    SA = mesh.alloc_window(ring * chunk)
    sig = mesh.signal_window(8)
    check_paths(mesh, user=TU, alloc=TA, signal=sig)
    targets = {0: u8(TA).view(np.uint64), 1: t_user.view(np.uint64)}
    rings = {0: u8(SA).view(np.uint64), 1: s_user.view(np.uint64)}
    iota = np.arange(words, dtype=np.uint64)
    dst, src = (r + 1) % n, (r - 1) % n
    SLOT_SEQ, SLOT_TAIL, SLOT_DATA_ONLY, SLOT_FENCE = 0, 1, 2, 3
    mesh.barrier(timeout=TIMEOUT)
    errors = []
    base_count = mesh.read_counter()

    def src_loc(seq):  # (window, ring slot): seq % 3 == 0 from the user ring
        return (SU, rings[1]) if seq % 3 == 0 else (SA, rings[0])

    def fill(seq) -> tuple:
        w, arr = src_loc(seq)
        slot = seq % ring
        np.add(iota, chunk_base(r, seq), out=arr[slot * words:(slot + 1) * words])
        return w, slot * chunk

    def dst_loc(seq):
        return (TU if seq % 2 else TA), (seq // 2) * chunk

    def sender() -> None:
        try:
            issued = 0
            for seq in range(count):
                if seq >= ring:  # the ring slot's previous op must have completed
                    mesh.wait_counter(base_count + seq - ring + 1, timeout=TIMEOUT)
                w, off = fill(seq)
                dw, doff = dst_loc(seq)
                mesh.put_signal(dst, w, off, dw, doff, chunk, slot=SLOT_SEQ, value=1)
                issued += 1
            mesh.wait_counter(base_count + issued, timeout=TIMEOUT)
            # `tail` plain puts (the first half one by one, the rest as batches), then a
            # signal-only op: it must not overtake them
            tail_seqs = list(range(count, count + tail))
            for seq in tail_seqs:
                fill(seq)
            half = tail_seqs[:tail // 2]
            for seq in half:
                w, off = src_loc(seq)[0], seq % ring * chunk
                dw, doff = dst_loc(seq)
                mesh.put(dst, w, off, dw, doff, chunk)
            groups = {}
            for seq in tail_seqs[tail // 2:]:
                key = (src_loc(seq)[0].index, dst_loc(seq)[0].index)
                groups.setdefault(key, []).append((seq % ring * chunk, dst_loc(seq)[1], chunk))
            for (sw, dw), entries in groups.items():
                mesh.batch_put(dst, sw, dw, entries)
            mesh.signal(dst, SLOT_TAIL, 1)
            issued += tail + 1
            # value 0 = data only; set; add 0; a size-0 value-0 no-op; then a fence
            mesh.wait_counter(base_count + issued, timeout=TIMEOUT)
            seq = count + tail
            w, off = fill(seq)
            dw, doff = dst_loc(seq)
            mesh.put_signal(dst, w, off, dw, doff, chunk, slot=SLOT_DATA_ONLY, value=0)
            mesh.signal(dst, SLOT_DATA_ONLY, 5, op="set")
            mesh.signal(dst, SLOT_DATA_ONLY, 0)
            mesh.put_signal(dst, w, off, dw, doff, 0, slot=SLOT_DATA_ONLY, value=0)
            mesh.signal(dst, SLOT_FENCE, 1)
            issued += 5
            mesh.flush(dst, timeout=TIMEOUT)
            check(mesh.read_counter() == base_count + issued,
                  f"read_counter() {mesh.read_counter()} != {base_count + issued}")
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def verify(seq, what) -> None:
        tw, off = dst_loc(seq)
        arr = targets[seq % 2][off // 8:off // 8 + words]
        want = iota + chunk_base(src, seq)
        if not np.array_equal(arr, want):
            bad = np.flatnonzero(arr != want)
            raise Fail(f"{what}: chunk {seq} from rank {src} is incomplete: {bad.size} of {words} "
                       f"words wrong, first word {int(bad[0])} = {int(arr[bad[0]]):#x}, "
                       f"expected {int(want[bad[0]]):#x}")

    t = threading.Thread(target=sender, name="sender", daemon=True)
    t.start()
    checked, reads, t0 = 0, 0, time.monotonic()
    while checked < count:
        v = mesh.read_signal(SLOT_SEQ)
        reads += 1
        check(v <= count, f"signal slot {SLOT_SEQ} is {v} > {count} puts")
        if v == checked:
            if errors:
                raise errors[0]
            mesh.wait_signal(SLOT_SEQ, checked + 1, timeout=TIMEOUT)
            continue
        for seq in [v - 1] + list(range(checked, v - 1)):  # the newest first
            verify(seq, f"signal value {v} seen")
        checked = v
    mesh.wait_signal(SLOT_TAIL, 1, timeout=TIMEOUT)
    for seq in range(count, count + tail):
        verify(seq, "size-0 signal after plain puts seen")
    mesh.wait_signal(SLOT_FENCE, 1, timeout=TIMEOUT)
    verify(count + tail, "put_signal(value=0) then fence")
    check(mesh.read_signal(SLOT_DATA_ONLY) == 5,
          f"data-only slot is {mesh.read_signal(SLOT_DATA_ONLY)}, expected 5 (set 5; add 0)")
    check(mesh.read_signal(SLOT_SEQ) == count and mesh.read_signal(SLOT_TAIL) == 1,
          f"slots {[mesh.read_signal(i) for i in range(4)]}")
    t.join(TIMEOUT)
    check(not t.is_alive(), "the sender thread is stuck")
    if errors:
        raise errors[0]
    mesh.barrier(timeout=TIMEOUT)
    for w in (TU, TA, SU, SA, sig):
        w.close()
    log(f"ordering: {count} x {chunk} B put_signal from rank {src} checked with {reads} signal "
        f"reads in {time.monotonic() - t0:.2f} s")


# ----------------------------------------------------------------------------- threads

def scenario_threads(mesh, args) -> None:
    n, r = mesh.nranks, mesh.rank
    T, R, iters = 4, 32 << 10, args.iters
    U = np.zeros(n * T * R, np.uint8)
    WU = mesh.register_window(U)
    WA = mesh.alloc_window(n * T * R)
    src_u = rand_bytes(T * R, r, 10)
    WSU = mesh.register_window(src_u)
    WSA = mesh.alloc_window(T * R)
    u8(WSA)[:] = rand_bytes(T * R, r, 11)
    WL = mesh.alloc_window(n * T * R)  # gets land here: region (peer, thread)
    sig = mesh.signal_window(n * T)
    check_paths(mesh, user=WU, alloc=WA, signal=sig)
    mesh.barrier(timeout=TIMEOUT)
    base = mesh.read_counter()
    counts = [0] * T
    errors = []

    def plan(q, t, p):
        """Thread t of rank q: its ops to peer p, (kind, src_win_name, src_off, dst_name, dst_off, size)."""
        rng = np.random.default_rng([args.seed, q, t, p, 7])
        ops = []
        for i in range(iters):
            size = int(rng.integers(0, R + 1)) if i % 3 else int(rng.integers(0, 3))
            so = t * R + int(rng.integers(0, R - size + 1))
            do = (q * T + t) * R + int(rng.integers(0, R - size + 1))
            ops.append(("SU" if rng.integers(0, 2) else "SA", so, "U" if rng.integers(0, 2) else "A", do, size))
        return ops

    wins = {"SU": WSU, "SA": WSA, "U": WU, "A": WA}

    def worker(t):
        try:
            ctx = t % 2
            for k in range(n):
                p = (r + k + t) % n
                for s, so, d, do, sz in plan(r, t, p):
                    mesh.put(p, wins[s], so, wins[d], do, sz, context=ctx)
                    counts[t] += 1
                rng = np.random.default_rng([args.seed, r, t, p, 8])
                sz = int(rng.integers(1, R + 1))
                so = int(rng.integers(0, R - sz + 1))
                mesh.get(p, WSU if t % 2 else WSA, t * R + so, WL, (p * T + t) * R, sz, context=ctx)
                mesh.put_signal(p, WSU, t * R, WU, (r * T + t) * R, 0, slot=r * T + t, value=1, context=ctx)
                counts[t] += 2
            mesh.flush(timeout=TIMEOUT)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(T)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT)
    check(not any(th.is_alive() for th in threads), "a worker thread is stuck")
    if errors:
        raise errors[0]
    total = sum(counts)
    check(mesh.read_counter() - base == total, f"read_counter() advanced by {mesh.read_counter() - base}, "
                                               f"{total} ops were issued")
    for slot in range(n * T):
        mesh.wait_signal(slot, 1, timeout=TIMEOUT)
    check([mesh.read_signal(s) for s in range(n * T)] == [1] * (n * T),
          f"signal slots {[mesh.read_signal(s) for s in range(n * T)]}, expected all 1")
    # expected contents: zero, then each (q, t) region replayed from q's plan
    model = {"U": np.zeros(n * T * R, np.uint8), "A": np.zeros(n * T * R, np.uint8)}
    for q in range(n):
        qsrc = {"SU": rand_bytes(T * R, q, 10), "SA": rand_bytes(T * R, q, 11)}
        for t in range(T):
            for s, so, d, do, sz in plan(q, t, r):
                model[d][do:do + sz] = qsrc[s][so:so + sz]
    for name, arr in (("U", U), ("A", u8(WA))):
        check(np.array_equal(arr, model[name]), lambda: f"window {name}: {first_diff(arr, model[name])}")
    local = np.zeros(n * T * R, np.uint8)
    for p in range(n):
        psrc = {"SU": rand_bytes(T * R, p, 10), "SA": rand_bytes(T * R, p, 11)}
        for t in range(T):
            rng = np.random.default_rng([args.seed, r, t, p, 8])
            sz = int(rng.integers(1, R + 1))
            so = int(rng.integers(0, R - sz + 1))
            s = psrc["SU" if t % 2 else "SA"]
            local[(p * T + t) * R:(p * T + t) * R + sz] = s[t * R + so:t * R + so + sz]
    check(np.array_equal(u8(WL), local), lambda: f"get window: {first_diff(u8(WL), local)}")
    mesh.barrier(timeout=TIMEOUT)
    for w in (WU, WA, WSU, WSA, WL, sig):
        w.close()
    log(f"threads: {T} threads issued {total} ops on 2 contexts")


# ----------------------------------------------------------------------------- bad input

def scenario_bad_input(mesh, args) -> None:
    n, r = mesh.nranks, mesh.rank
    usize, asize, nslots = 64 << 10, (32 << 10) + 8 * r + 3, 4
    gone_arr = rand_bytes(4096, r, 20)
    gone = mesh.register_window(gone_arr)  # window #0, deregistered below
    u = rand_bytes(usize + 4096 * r, r, 21)  # sizes differ per rank
    U = mesh.register_window(u)
    A = mesh.alloc_window(asize)
    u8(A)[:] = rand_bytes(asize, r, 22)
    S = mesh.signal_window(nslots)
    check_paths(mesh, user=U, alloc=A, signal=S)
    gone.close()  # window #0 is gone; valid ops afterwards must not trip over it
    check(gone.closed, "Window.close() did not mark the window closed")
    # give the signal slots non-zero values (each rank adds r+1 to slot r % nslots of every peer)
    for p in range(n):
        mesh.signal(p, r % nslots, r + 1)
        mesh.put_signal(p, A, 0, A, 0, 0, (r + 1) % nslots, value=2 + r)
    mesh.flush(timeout=TIMEOUT)
    mesh.barrier(timeout=TIMEOUT)
    want = [sum(q + 1 for q in range(n) if q % nslots == j) + sum(q + 2 for q in range(n) if (q + 1) % nslots == j)
            for j in range(nslots)]
    got = [mesh.read_signal(j) for j in range(nslots)]
    check(got == want, f"signal slots {got} after the set-up signals, expected {want}")

    def snapshot():
        return [sha(u), sha(u8(A)), sha(u8(S)), sha(gone_arr)]

    before = snapshot()
    counter = mesh.read_counter()
    sizes = mesh.allgather(f"{len(u)} {asize}".encode(), timeout=TIMEOUT)
    usz = [int(s.split()[0]) for s in sizes]
    asz = [int(s.split()[1]) for s in sizes]
    mesh.barrier(timeout=TIMEOUT)
    E = 2 ** 64 - 1
    refused = 0

    def bad(what, fn, *needles, peer=None, exc=InvalidArgument):
        nonlocal refused
        expect_raises(exc, what, fn, *needles, peer=peer)
        refused += 1

    for p in range(n):
        # unknown peer
        for bp in (n, n + 7, -1, -(2 ** 31)):
            bad(f"put to peer {bp}", lambda: mesh.put(bp, U, 0, U, 0, 1), f"peer {bp}", "out of range")
            bad(f"get from peer {bp}", lambda: mesh.get(bp, U, 0, U, 0, 1), f"peer {bp}", "out of range")
            bad(f"put_signal to peer {bp}", lambda: mesh.put_signal(bp, U, 0, U, 0, 1, 0), f"peer {bp}")
            bad(f"signal to peer {bp}", lambda: mesh.signal(bp, 0), f"peer {bp}")
            bad(f"batch_put to peer {bp}", lambda: mesh.batch_put(bp, U, U, [(0, 0, 1)]), f"peer {bp}")
            if bp != -1:  # flush(-1) means every peer
                bad(f"flush peer {bp}", lambda: mesh.flush(bp, timeout=1), f"peer {bp}")
        bad("context 1 of 1", lambda: mesh.put(p, U, 0, U, 0, 1, context=1), "context 1")
        # unknown window
        for bw in (99, 2 ** 32 - 1):
            bad(f"put from window #{bw}", lambda: mesh.put(p, bw, 0, U, 0, 1), f"window #{bw}", "not registered")
            bad(f"put to window #{bw}", lambda: mesh.put(p, U, 0, bw, 0, 1), f"window #{bw}", "not registered")
            bad(f"get from window #{bw}", lambda: mesh.get(p, bw, 0, U, 0, 1), f"window #{bw}")
            bad(f"get into window #{bw}", lambda: mesh.get(p, U, 0, bw, 0, 1), f"window #{bw}")
            bad(f"signal window #{bw}", lambda: mesh.signal(p, 0, signal_window=bw), f"window #{bw}")
            bad(f"read_signal window #{bw}", lambda: mesh.read_signal(0, window=bw), f"window #{bw}")
        # local range
        for off, size in ((len(u), 1), (len(u) - 10, 11), (0, len(u) + 1), (len(u) + 1, 0), (E, 2), (1, E),
                          (E, 0), (E, E)):
            bad(f"put local [{off}, +{size})", lambda: mesh.put(p, U, off, U, 0, size), "local range",
                f"window #{U.index}", peer=p)
            bad(f"get local [{off}, +{size})", lambda: mesh.get(p, U, 0, U, off, size), "local range", peer=p)
        for off, size in ((asize, 1), (0, asize + 1), (E - 1, 3)):
            bad(f"put_signal local alloc [{off}, +{size})",
                lambda: mesh.put_signal(p, A, off, A, 0, size, 0), "local range", f"window #{A.index}")
        # remote range: the peer's windows have their own sizes
        cases = [(usz[p], 1), (usz[p] - 3, 4), (usz[p] + 1, 0), (E, 2), (E - 1, 1), (E, 0)]
        if usz[p] < len(u):
            cases.append((0, usz[p] + 1))  # local range fine, the peer's window is smaller
        for off, size in cases:
            bad(f"put remote [{off}, +{size})", lambda: mesh.put(p, U, 0, U, off, size),
                "remote range", f"of peer {p}", f"({usz[p]} bytes)", peer=p)
            bad(f"get remote [{off}, +{size})", lambda: mesh.get(p, U, off, U, 0, size),
                "remote range", f"of peer {p}", peer=p)
            if size:  # size 0 = signal only: the data windows are not used
                bad(f"put_signal remote [{off}, +{size})",
                    lambda: mesh.put_signal(p, U, 0, U, off, size, 0), "remote range", peer=p)
        bad("put alloc remote", lambda: mesh.put(p, U, 0, A, asz[p] - 7, 8), "remote range", str(asz[p]))
        # signal slots
        for slot in (nslots, nslots + 1, 2 ** 32, E):
            bad(f"signal slot {slot}", lambda: mesh.signal(p, slot), f"slot {slot}", "out of range", peer=p)
            bad(f"put_signal slot {slot}", lambda: mesh.put_signal(p, U, 0, U, 0, 8, slot), f"slot {slot}")
            bad(f"read_signal slot {slot}", lambda: mesh.read_signal(slot), f"slot {slot}")
            bad(f"wait_signal slot {slot}", lambda: mesh.wait_signal(slot, 1, timeout=1), f"slot {slot}")
        # a signal window as a data window, a data window as a signal window
        bad("put from a signal window", lambda: mesh.put(p, S, 0, U, 0, 8), "signal window")
        bad("put into a signal window", lambda: mesh.put(p, U, 0, S, 0, 8), "signal window")
        bad("get into a signal window", lambda: mesh.get(p, U, 0, S, 0, 8), "signal window")
        bad("get from a signal window", lambda: mesh.get(p, S, 0, U, 0, 8), "signal window")
        bad("batch_put into a signal window", lambda: mesh.batch_put(p, U, S, [(0, 0, 8)]), "signal window")
        for w in (U, A):
            bad(f"signal on {w.kind} window", lambda: mesh.signal(p, 0, signal_window=w),
                f"window #{w.index}", "not a signal window")
            bad(f"put_signal on {w.kind} window",
                lambda: mesh.put_signal(p, U, 0, U, 0, 8, 0, signal_window=w), "not a signal window")
            bad(f"read_signal of {w.kind} window", lambda: mesh.read_signal(0, window=w), "not a signal slot")
            bad(f"wait_signal on {w.kind} window", lambda: mesh.wait_signal(0, 1, timeout=1, window=w),
                "not a signal slot")
        bad("signal op 'mul'", lambda: mesh.signal(p, 0, op="mul"), "'mul'")
        # deregistered window (#0)
        bad("put from a deregistered window", lambda: mesh.put(p, gone, 0, U, 0, 1), "#0", "deregistered")
        bad("put into a deregistered window", lambda: mesh.put(p, U, 0, gone, 0, 1), "#0", "deregistered")
        bad("get from a deregistered window", lambda: mesh.get(p, gone, 0, U, 0, 1), "deregistered")
        bad("batch_put into a deregistered window", lambda: mesh.batch_put(p, U, gone, [(0, 0, 1)]),
            "deregistered")
        bad("describe a deregistered window", lambda: gone.describe(), "deregistered")
        # batch_put: one bad entry refuses the whole batch (the good entries must not land)
        bad("batch_put with one bad entry", lambda: mesh.batch_put(
            p, U, U, [(0, 0, 64), (100, 200, 300), (0, usz[p], 1), (5, 5, 5)]), "remote range")
        bad("batch_put with a bad last entry", lambda: mesh.batch_put(
            p, A, A, [(0, 0, 16), (asize, 0, 1)]), "local range")
    # bad registrations: local, refused before any collective step
    bad("register a non-contiguous view", lambda: mesh.register_window(np.zeros(64, np.uint8)[::2]),
        "contiguous")
    bad("register a 2-d column slice", lambda: mesh.register_window(np.zeros((8, 8), np.uint8)[:, 1]),
        "contiguous")
    bad("register a read-only array", lambda: mesh.register_window(np.frombuffer(b"x" * 64, np.uint8)),
        "writable")
    bad("register bytes", lambda: mesh.register_window(b"abc"), "writable")
    bad("register an int", lambda: mesh.register_window(42), "register_window")
    bad("signal_window(0)", lambda: mesh.signal_window(0), "nslots")
    # the indices still line up: the next collective registration gets the same index everywhere
    extra = np.zeros(16, np.uint8)
    X = mesh.register_window(extra)
    idx = mesh.allgather(str(X.index).encode(), timeout=TIMEOUT)
    check(len(set(idx)) == 1 and X.index == S.index + 1, f"indices after refused registrations: {idx}")
    check(mesh.read_counter() == counter, f"bad input moved read_counter from {counter} to {mesh.read_counter()}")
    mesh.flush(timeout=TIMEOUT)
    mesh.barrier(timeout=TIMEOUT)
    after = snapshot()
    everyone = [s.decode().split("|") for s in
                mesh.allgather(("|".join(before) + "|" + "|".join(after)).encode(), timeout=TIMEOUT)]
    for q, row in enumerate(everyone):
        check(row[:4] == row[4:], f"rank {q}'s windows changed (user, alloc, signal, deregistered): "
                                  f"before {row[:4]}, after {row[4:]}")
    X.close()
    bad("put to a window after Window.close()", lambda: mesh.put(r, X, 0, U, 0, 1), "deregistered")
    X.close()  # idempotent
    mesh.barrier(timeout=TIMEOUT)
    mesh.close()
    check(mesh.closed, "mesh.closed is False after close()")
    for what, fn in (
        ("put", lambda: mesh.put(0, U, 0, U, 0, 1)),
        ("put_signal", lambda: mesh.put_signal(0, U, 0, U, 0, 1, 0)),
        ("signal", lambda: mesh.signal(0, 0)),
        ("get", lambda: mesh.get(0, U, 0, U, 0, 1)),
        ("batch_put", lambda: mesh.batch_put(0, U, U, [(0, 0, 1)])),
        ("flush", lambda: mesh.flush()),
        ("read_counter", lambda: mesh.read_counter()),
        ("wait_counter", lambda: mesh.wait_counter(1, timeout=1)),
        ("read_signal", lambda: mesh.read_signal(0)),
        ("wait_signal", lambda: mesh.wait_signal(0, 1 << 40, timeout=1)),
        ("register_window", lambda: mesh.register_window(np.zeros(8, np.uint8))),
        ("alloc_window", lambda: mesh.alloc_window(8)),
        ("signal_window", lambda: mesh.signal_window(1)),
        ("Window.close", lambda: U.close()),
        ("barrier", lambda: mesh.barrier(timeout=1)),
    ):
        bad(f"{what} after mesh.close()", fn, "closed", exc=MeshClosed)
    check(sha(u) == before[0], "the user window changed after mesh.close()")
    log(f"bad_input: {refused} bad calls refused, every window unchanged")


# ----------------------------------------------------------------------------- timeout

def scenario_timeout(mesh, args) -> None:
    n, r = mesh.nranks, mesh.rank
    U = mesh.register_window(np.zeros(4096, np.uint8))
    A = mesh.alloc_window(4096)
    S = mesh.signal_window(4)
    check_paths(mesh, user=U, alloc=A, signal=S)
    t0 = time.monotonic()
    e = expect_raises(MeshTimeout, "wait_signal on a slot nobody signals",
                      lambda: mesh.wait_signal(0, 1, timeout=0.5), "slot 0", "expected >= 1", "current 0",
                      "never signalled")
    took = time.monotonic() - t0
    check(0.45 <= took <= 2.0, f"wait_signal(timeout=0.5) raised after {took:.2f} s")
    # slot 1 of rank r is signalled once (set 3) by rank (r + 1) % n; slot 2 by self (add 2)
    signaller = (r - 1) % n
    mesh.signal((r + 1) % n, 1, 3, op="set")
    mesh.signal(r, 2, 2)
    mesh.flush(timeout=TIMEOUT)
    mesh.barrier(timeout=TIMEOUT)
    for slot, cur, by in ((1, 3, signaller), (2, 2, r)):
        t0 = time.monotonic()
        e = expect_raises(MeshTimeout, f"wait_signal on slot {slot}",
                          lambda: mesh.wait_signal(slot, 10, timeout=0.2), f"slot {slot}", "expected >= 10",
                          f"current {cur}", f"last signalled by rank {by}")
        took = time.monotonic() - t0
        check(0.15 <= took <= 2.0, f"wait_signal(timeout=0.2) raised after {took:.2f} s")
        check(e.peer == by, f"MeshTimeout.peer is {e.peer}, expected the last signaller {by}")
    # the window keyword and SignalWindow.wait say the same
    expect_raises(MeshTimeout, "SignalWindow.wait", lambda: S.wait(1, 4, timeout=0.2), "current 3")
    mesh.wait_signal(1, 3, timeout=0.5)  # already reached: returns at once
    t0 = time.monotonic()
    expect_raises(MeshTimeout, "wait_counter beyond the issued ops",
                  lambda: mesh.wait_counter(mesh.read_counter() + 1, timeout=0.2), "wait_counter", "timed out")
    check(time.monotonic() - t0 <= 2.0, "wait_counter(timeout=0.2) took more than 2 s")
    mesh.barrier(timeout=TIMEOUT)
    for w in (U, A, S):
        w.close()
    log("timeout: wait_signal / wait_counter time out naming slot, values and signaller")


# ----------------------------------------------------------------------------- peer death

def idle_cpu(seconds: float = 0.5) -> float:
    """CPU seconds this process uses per second while the main thread sleeps."""
    c0 = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(seconds)
    c1 = resource.getrusage(resource.RUSAGE_SELF)
    return ((c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)) / seconds


def proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def fork_for_peer_death() -> None:
    """Rank 1 of peer_death: the launcher's child forks the real rank 1 and waits for it. Its
    SIGKILL (the point of the scenario) becomes exit 0, so the launcher lets the survivors
    finish; any other end of the real rank 1 is passed on as a failure."""
    child = os.fork()
    if child == 0:
        return
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        how, code = f"killed by signal {os.WTERMSIG(status)}", 0 if os.WTERMSIG(status) == signal.SIGKILL else 1
    else:
        how, code = f"exit {os.WEXITSTATUS(status)}", os.WEXITSTATUS(status) or 1
    print(f"rank 1 (parent): the rank 1 process {child} ended: {how}", flush=True)
    os._exit(code)


def scenario_peer_death(mesh, args) -> None:
    """Rank 1 stops itself (SIGSTOP) right after registration; every survivor queues 16 MiB
    of puts and a get to it (over tcp they stay in flight: nothing lands at a stopped
    process), checks that flush times out naming it, then rank 0 SIGKILLs it: flush and
    wait_signal must raise PeerLost naming rank 1 within seconds."""
    n, r = mesh.nranks, mesh.rank
    size = 1 << 20
    buf = np.ones(16 * size, np.uint8)
    U = mesh.register_window(buf)
    A = mesh.alloc_window(16 * size)
    S = mesh.signal_window(4)
    check_paths(mesh, user=U, alloc=A, signal=S)
    pid1 = int(mesh.allgather(str(os.getpid()).encode(), timeout=TIMEOUT)[1])
    mesh.barrier(timeout=TIMEOUT)
    if r == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # SIGKILLed by rank 0 while stopped
        time.sleep(TIMEOUT)
        raise Fail("rank 1 was not killed")
    deadline = time.monotonic() + 10
    while proc_state(pid1) != "T":
        check(time.monotonic() < deadline, f"rank 1 (pid {pid1}) did not stop: state {proc_state(pid1)}")
        time.sleep(0.01)
    issued = 0
    for i in range(16):
        mesh.put(1, U, i * size, U, i * size, size)
        issued += 1
    mesh.get(1, U, 0, A, 0, size)
    issued += 1
    tcp = transport() == "tcp"
    if tcp:  # nothing lands at a stopped process: flush times out naming it
        t0 = time.monotonic()
        expect_raises(MeshTimeout, "flush(timeout=0.5) with ops to a stopped peer",
                      lambda: mesh.flush(timeout=0.5), "peer 1", "not completed", peer=1)
        check(time.monotonic() - t0 < 2.5, f"flush(timeout=0.5) took {time.monotonic() - t0:.2f} s")
    # survivors tell rank 0 they are done with the stopped peer; rank 0 kills it
    if r == 0:
        for p in range(2, n):
            check(mesh.recv(p, timeout=TIMEOUT) == b"ready", f"bad message from rank {p}")
        os.kill(pid1, signal.SIGKILL)
    else:
        mesh.send(0, b"ready")
    t0 = time.monotonic()
    if tcp:  # the ops are still in flight when rank 1 dies
        e = expect_raises(PeerLost, "flush(timeout=30) with ops to a dead peer",
                          lambda: mesh.flush(timeout=30), "peer 1", peer=1)
        outcome = f"{type(e).__name__}: {e}"
    else:  # cma / shm ops complete in place even at a stopped process (unless cma is refused)
        try:
            mesh.flush(timeout=30)
            outcome = "completed"
        except PeerLost as e:
            check(e.peer == 1 and "peer 1" in str(e), f"PeerLost does not name peer 1: {e} (.peer {e.peer})")
            outcome = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    check(took < 10, f"flush took {took:.1f} s to report the dead peer")
    log(f"flush after {issued} ops to rank 1, {took:.2f} s after the kill: {outcome}")
    t0 = time.monotonic()
    expect_raises(PeerLost, "wait_signal while a peer is dead",
                  lambda: mesh.wait_signal(0, 1, timeout=30), "peer 1", "lost", peer=1)
    took = time.monotonic() - t0
    check(took < 10, f"wait_signal took {took:.1f} s to report the dead peer")
    expect_raises(PeerLost, "wait_signal(timeout=None) while a peer is dead",
                  lambda: mesh.wait_signal(0, 1), "peer 1")
    if tcp:  # its ops never complete: waiting for them fails at once
        expect_raises(PeerLost, "wait_counter with ops pending at a dead peer",
                      lambda: mesh.wait_counter(mesh.read_counter() + 1, timeout=30), "peer 1", peer=1)
    cpu_idle = [idle_cpu()] if args.check_cpu else []
    # more ops to the dead peer after the loss is known: refused, or failing at flush, quickly
    t0 = time.monotonic()
    try:
        mesh.put(1, U, 0, U, 0, size)
        mesh.signal(1, 0)
        mesh.get(1, U, 0, A, 0, 64)
        expect_raises(PeerLost, "flush after new ops to a lost peer", lambda: mesh.flush(1, timeout=30),
                      "peer 1", peer=1)
    except PeerLost as e:  # refusing new ops to a lost peer is fine too
        check(e.peer == 1, f"PeerLost for a new op names peer {e.peer}: {e}")
    check(time.monotonic() - t0 < 5, "ops to a lost peer took more than 5 s to fail")
    if args.check_cpu:
        cpu_idle.append(idle_cpu())
        print(f"rank {r}: cpu while idle after the loss: {cpu_idle[0]:.2f} s/s, after more ops to "
              f"the lost peer: {cpu_idle[1]:.2f} s/s", flush=True)
        check(max(cpu_idle) < 0.3, f"the process burnt {cpu_idle} s of CPU per s idle after peer 1 was "
                                   f"lost (before / after posting more ops to it): the progress thread spins")
    # the survivors still reach each other (no barrier: it needs every rank)
    survivors = [p for p in range(n) if p != 1]
    for p in survivors:
        mesh.put(p, U, 0, A, r * 64, 64)
        mesh.flush(p, timeout=TIMEOUT)
    for p in survivors:
        mesh.send(p, b"done")
    for p in survivors:
        check(mesh.recv(p, timeout=TIMEOUT) == b"done", f"bad message from rank {p}")
    t0 = time.monotonic()
    mesh.close()
    check(time.monotonic() - t0 < 5, f"mesh.close() took {time.monotonic() - t0:.1f} s with a dead peer")
    log("peer_death: flush and wait_signal raised PeerLost naming rank 1")


# ----------------------------------------------------------------------------- main

SCENARIOS = {
    "integrity": scenario_integrity,
    "ordering": scenario_ordering,
    "threads": scenario_threads,
    "bad_input": scenario_bad_input,
    "timeout": scenario_timeout,
    "peer_death": scenario_peer_death,
}


def main(argv=None) -> int:
    global RANK, SCENARIO
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ops", type=int, default=24, help="integrity: ops per (initiator, phase)")
    p.add_argument("--count", type=int, default=2000, help="ordering: put_signal count")
    p.add_argument("--chunk", type=int, default=64 << 10, help="ordering: bytes per put_signal")
    p.add_argument("--iters", type=int, default=12, help="threads: puts per (thread, peer)")
    p.add_argument("--check-cpu", action="store_true", help="peer_death: fail on a spinning process")
    p.add_argument("--deadline", type=float, default=100.0,
                   help="dump every thread's stack and exit after this many seconds")
    args = p.parse_args(argv)
    SCENARIO = args.scenario
    if args.scenario == "peer_death" and os.environ.get("FLAGCX_MESH_RANK") == "1":
        fork_for_peer_death()
    faulthandler.dump_traceback_later(args.deadline, exit=True)
    t0 = time.monotonic()
    try:
        contexts = 2 if args.scenario == "threads" else 1
        mesh = Mesh.from_launcher(contexts=contexts, timeout=TIMEOUT)
        RANK = mesh.rank
        SCENARIOS[args.scenario](mesh, args)
        if not mesh.closed:
            mesh.close()
    except BaseException as e:  # noqa: BLE001 - every failure ends the rank with a message
        sys.stdout.flush()
        print(f"FAIL rank {RANK} {SCENARIO}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    print(f"OK rank {RANK} {SCENARIO} ({transport()}) in {time.monotonic() - t0:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
