"""One rank of the staged random-traffic job (issue 17, item 6), on the fake driver or a GPU.

Run under the embedded launcher, with every device window forced to staged::

    FLAGCX_MESH_CUDA_PATH=staged python -m flagcx_mesh.launch -n 4 --timeout T -- \\
        python tests/staged_traffic_prog.py staged_traffic --device fake|torch [--max-size B] [--ops K]

Each rank runs --threads threads (default 2) at once, one round: thread t of rank s makes --ops
random ops (puts, put_signals and batch_puts of 1..8 entries, each entry 1 B .. --max-size
bytes, half of them on the thread's own stream) to random peers, itself included, from its part
of a cuMem window into its own region of every peer's user window (cudaMalloc / torch memory).
Every op of a pair is FIFO, so each target replays the plans (seeded by source rank and thread)
and checks every byte of its window, and each put_signal's slot. Every wait is bounded (the
mesh timeout for each call, --round-timeout for the round, the launcher's --timeout): a stuck
rank fails, never hangs. The longest op call is printed (a figure, to set against the mesh timeout).
Each rank prints ``staged_traffic rank R: ... in S s; B bytes checked`` and rank 0 the totals;
a failing rank prints ``FAIL rank R staged_traffic: why`` and exits 1, a passing one ends with
``OK rank R staged_traffic``.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import random
import sys
import threading
import time
import traceback

from flagcx_mesh import Mesh

from gpu_prog import Fail, FakeDevice, TorchDevice, check, check_paths, pattern

SCENARIO = "staged_traffic"


def entry_size(rng: random.Random, max_size: int) -> int:
    """1 B .. max_size, log-uniform, with both ends and a few odd sizes common."""
    pick = rng.random()
    if pick < 0.1:
        return 1
    if pick < 0.2:
        return max_size
    if pick < 0.3:
        return rng.choice([7, 4095, 4097, 65537]) if max_size > 65537 else rng.randrange(1, max_size + 1)
    return max(1, min(max_size, int(2 ** rng.uniform(0, math.log2(max_size)))))


def plan(src: int, thread: int, nranks: int, args) -> list:
    """The ops thread `thread` of rank `src` makes, in order: (peer, kind, entries, on_stream),
    entries (src_off, dst_off, size) relative to its source part and its region at the peer."""
    rng = random.Random(args.seed * 1000003 + src * 1009 + thread)
    region = 2 * args.max_size
    ops = []
    for _ in range(args.ops):
        kind = rng.choice(["put", "put", "put_signal", "batch_put"])
        count = rng.randrange(1, 9) if kind == "batch_put" else 1
        entries = []
        for _ in range(count):
            size = entry_size(rng, args.max_size)
            entries.append((rng.randrange(0, region - size + 1), rng.randrange(0, region - size + 1), size))
        ops.append((rng.randrange(nranks), kind, entries, rng.random() < args.on_stream))
    return ops


class Traffic:
    def __init__(self, mesh: Mesh, dev, args):
        self.mesh, self.dev, self.args = mesh, dev, args
        n, t = mesh.nranks, args.threads
        self.region = 2 * args.max_size
        self.src = mesh.alloc_window(t * self.region, device=0)  # cuMem
        self.user = dev.buffer(n * t * self.region)
        self.dst = mesh.register_window(self.user)
        self.sig = mesh.signal_window(n * t)
        self.longest = (0.0, "none")  # the longest op call (seconds, kind): a figure
        check_paths(mesh, self.src, "staged", "source (cuMem)")
        check_paths(mesh, self.dst, "staged", "target (user)")
        srcb = dev.window_bytes(self.src)
        for k in range(t):
            srcb.write(k * self.region, pattern(self.seed(mesh.rank, k), self.region))

    def seed(self, src: int, thread: int) -> int:
        return self.args.seed * 7919 + src * 31 + thread

    def at_peer(self, src: int, thread: int) -> int:
        """Where the region of (src, thread) starts in every rank's target window."""
        return (src * self.args.threads + thread) * self.region

    def run_thread(self, thread: int) -> None:
        m, r = self.mesh, self.mesh.rank
        stream = self.dev.stream()
        base, slot = self.at_peer(r, thread), r * self.args.threads + thread
        for peer, kind, entries, on_stream in plan(r, thread, m.nranks, self.args):
            s = stream if on_stream else None
            src_off, dst_off, size = entries[0]
            t0 = time.monotonic()
            if kind == "put":
                m.put(peer, self.src, thread * self.region + src_off, self.dst, base + dst_off, size, stream=s)
            elif kind == "put_signal":
                m.put_signal(peer, self.src, thread * self.region + src_off, self.dst, base + dst_off, size, slot,
                             1, signal_window=self.sig, stream=s)
            else:
                m.batch_put(peer, self.src, self.dst,
                            [(thread * self.region + so, base + do, n) for so, do, n in entries], stream=s)
            self.longest = max(self.longest, (time.monotonic() - t0, kind))
        m.flush(timeout=self.args.mesh_timeout)

    def round(self) -> float:
        """Both threads at once; the first error of either, else the seconds the round took."""
        errors = []

        def body(k: int) -> None:
            try:
                self.run_thread(k)
            except BaseException as e:  # noqa: BLE001 - raised by the caller
                errors.append(e)

        t0 = time.monotonic()
        threads = [threading.Thread(target=body, args=(k,), daemon=True) for k in range(self.args.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, t0 + self.args.round_timeout - time.monotonic()))
        if any(t.is_alive() for t in threads):
            faulthandler.dump_traceback(all_threads=True)  # where it is stuck
            if os.environ.get("STAGED_TRAFFIC_GDB"):  # and the native stacks (a diagnosis aid)
                os.system(f"gdb -p {os.getpid()} -batch -ex 'thread apply all bt' >&2")
            raise Fail("a traffic thread is still running (hang)")
        if errors:
            raise errors[0]
        self.mesh.flush(timeout=self.args.mesh_timeout)
        self.mesh.barrier(timeout=self.args.mesh_timeout * 2)
        return time.monotonic() - t0

    def check_all(self) -> int:
        """Every byte of this rank's target window and every put_signal's slot; bytes checked."""
        m, r, t = self.mesh, self.mesh.rank, self.args.threads
        got = self.user.read(0, m.nranks * t * self.region)
        for s in range(m.nranks):
            for k in range(t):
                model, signals = bytearray(self.region), 0
                ps = pattern(self.seed(s, k), self.region)
                for peer, kind, entries, _ in plan(s, k, m.nranks, self.args):
                    if peer != r:
                        continue
                    signals += kind == "put_signal"
                    for so, do, n in entries:
                        model[do:do + n] = ps[so:so + n]
                at = self.at_peer(s, k)
                seen = got[at:at + self.region]
                if seen != bytes(model):
                    bad = next(i for i in range(self.region) if seen[i] != model[i])
                    raise Fail(f"region of rank {s} thread {k}: first wrong byte at {bad} "
                               f"(got {seen[bad]}, want {model[bad]})")
                value = m.read_signal(s * t + k, window=self.sig)
                check(value == signals, f"slot of rank {s} thread {k}: {value}, want {signals} put_signals")
        return len(got)


def totals(nranks: int, args) -> tuple:
    ops = moved = 0
    for s in range(nranks):
        for k in range(args.threads):
            for _, _, entries, _ in plan(s, k, nranks, args):
                ops += 1
                moved += sum(n for _, _, n in entries)
    return ops, moved


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=[SCENARIO])
    ap.add_argument("--device", choices=("fake", "torch"), default="fake")
    ap.add_argument("--max-size", type=int, default=8 << 20, help="largest entry in bytes (default 8 MiB)")
    ap.add_argument("--ops", type=int, default=100, help="ops per thread")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--on-stream", type=float, default=0.5, help="the share of ops issued on a stream")
    ap.add_argument("--mesh-timeout", type=float, default=60)
    ap.add_argument("--round-timeout", type=float, default=300,
                    help="a thread still running after this many seconds is reported as a hang")
    args = ap.parse_args()
    dev = FakeDevice() if args.device == "fake" else TorchDevice()
    with Mesh.from_launcher(timeout=args.mesh_timeout) as mesh:
        r, traffic = mesh.rank, None
        try:
            traffic = Traffic(mesh, dev, args)
            mesh.barrier(timeout=args.mesh_timeout)
            took = traffic.round()
            checked = traffic.check_all()
            mesh.barrier(timeout=args.mesh_timeout)
        except Exception as e:  # noqa: BLE001
            longest = f" (longest op call {traffic.longest[0]:.3f} s, {traffic.longest[1]})" if traffic else ""
            print(f"FAIL rank {r} {SCENARIO}: {type(e).__name__}: {e}{longest}", flush=True)
            traceback.print_exc()
            sys.stdout.flush()
            os._exit(1)
        print(f"staged_traffic rank {r}: round of {args.threads} threads in {took:.2f} s; "
              f"{checked} bytes checked; longest call {traffic.longest[0]:.3f} s ({traffic.longest[1]})", flush=True)
        if r == 0:
            ops, moved = totals(mesh.nranks, args)
            print(f"staged_traffic: {mesh.nranks} ranks x {args.threads} threads, {ops} ops, {moved} bytes put "
                  f"(entries 1 B .. {args.max_size} B) in {took:.2f} s; {checked * mesh.nranks} bytes checked",
                  flush=True)
        print(f"OK rank {r} {SCENARIO}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
