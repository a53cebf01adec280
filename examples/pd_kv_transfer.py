"""Prefill -> decode KV-cache transfer, in the shape of a FlagCX KV connector.

Two ranks: rank 0 is the prefill instance, rank 1 the decode instance. Both register a
KV buffer (layers x chunks x chunk bytes) and a signal buffer (one 64-bit slot per layer).
Prefill fills every layer with seeded bytes, then sends each layer chunk by chunk: put() for
all chunks but the last, put_signal(..., sig_val=1) for the last, so decode's slot for that
layer becomes 1 only once the whole layer has landed. Decode waits layer by layer
(wait_signal(peer=0, sig_off=layer*8, expected=1)) and checksums each layer as it arrives.

With --rounds R the whole cache is sent R times with new contents; the slots ADD up, so
round r is complete at value r + 1.

With --device cuda the KV buffer is a torch CUDA tensor (as a serving engine's KV cache is):
prefill issues its puts on a CUDA stream, decode queues each layer's wait on its stream
(wait_signal(..., stream)) and takes the layer's arrival from an event recorded after the wait.

Verification: prefill sends its own per-layer checksums (blake2b) to decode over the mesh
as a message after the last put; decode compares every layer against them, and regenerates
the first and last layers from the seed to compare them byte for byte. Decode reports the
verdict back, so both ranks exit non-zero on any mismatch or timeout.

Run (any launcher flagcx_mesh.Mesh.from_env recognises):

    python -m flagcx_mesh.launch -n 2 examples/pd_kv_transfer.py
    mpiexec -n 2 python examples/pd_kv_transfer.py                    # MPICH
    mpiexec --allow-run-as-root -n 2 python examples/pd_kv_transfer.py  # Open MPI as root
    torchrun --nproc_per_node=2 examples/pd_kv_transfer.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

try:
    import numpy as np
except ModuleNotFoundError:  # one line naming the extra, not a traceback
    sys.exit(f"{__file__} needs numpy: pip install 'flagcx_mesh[bench]' (or pip install numpy)")

from flagcx_mesh import MeshError
from flagcx_mesh.bootstrap import detect_launch
from flagcx_mesh import compat as fc

PREFILL, DECODE = 0, 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8, help="KV layers (one signal slot each)")
    p.add_argument("--chunks", type=int, default=16, help="chunks per layer")
    p.add_argument("--chunk-bytes", type=int, default=256 << 10, help="bytes per chunk")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for the build and every wait")
    p.add_argument("--rounds", type=int, default=3,
                   help="transfers of the whole cache (new contents each round; per-layer lines for the last)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the KV contents")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the KV cache lives")
    p.add_argument("--corrupt-layer", type=int, default=-1, metavar="L",
                   help="(to test the checks) prefill flips one byte of layer L after checksumming it")
    a = p.parse_args(argv)
    if min(a.layers, a.chunks, a.chunk_bytes, a.rounds) < 1 or a.timeout <= 0:
        p.error("--layers, --chunks, --chunk-bytes, --rounds and --timeout must be positive")
    return a


def layer_bytes(a) -> int:
    return a.chunks * a.chunk_bytes


def make_layer(a, rnd: int, layer: int) -> np.ndarray:
    """Layer ``layer``'s deterministic contents in round ``rnd`` (the stand-in for computed KV)."""
    return np.frombuffer(np.random.default_rng([a.seed, rnd, layer]).bytes(layer_bytes(a)), np.uint8)


def checksum(data) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class KVCache:
    """The KV buffer: a numpy array on the host, or a torch tensor on the GPU (--device cuda)."""

    def __init__(self, a):
        self.lb, n = layer_bytes(a), a.layers * layer_bytes(a)
        self.torch = None
        if a.device == "cuda":
            import torch

            self.torch = torch
            self.buf = torch.zeros(n, dtype=torch.uint8, device="cuda")
            self.stream = torch.cuda.Stream()
        else:
            self.buf = np.zeros(n, np.uint8)  # every page touched, as a preallocated KV cache is
            self.stream = None

    def fill(self, layer: int, data: np.ndarray) -> None:
        part = slice(layer * self.lb, (layer + 1) * self.lb)
        if self.torch is None:
            self.buf[part] = data
        else:
            self.buf[part].copy_(self.torch.from_numpy(data.copy()))
            self.torch.cuda.synchronize()

    def host(self, layer: int) -> np.ndarray:
        part = slice(layer * self.lb, (layer + 1) * self.lb)
        return self.buf[part] if self.torch is None else self.buf[part].cpu().numpy()

    def flip(self, at: int) -> None:
        self.buf[at] ^= 0xFF

    def arrived(self):
        """Something whose wait() returns once the decode stream has passed the last wait queued."""
        if self.torch is None:
            return None
        ev = self.torch.cuda.Event()
        ev.record(self.stream)
        return ev


def log(rank: int, text: str) -> None:
    role = "prefill" if rank == PREFILL else "decode"
    print(f"{role}: {text}", flush=True)


# ----------------------------------------------------------------------------- prefill

def prefill(comm: fc.Comm, a, kv: KVCache, kv_idx: int, rnd: int) -> bool:
    """One round: fill every layer, then send it; True when decode reports PASS."""
    lb = layer_bytes(a)
    sums = []
    for layer in range(a.layers):  # "compute" every layer before the timed transfer
        kv.fill(layer, make_layer(a, rnd, layer))
        sums.append(checksum(kv.host(layer)))
        if layer == a.corrupt_layer:
            kv.flip(layer * lb + lb // 2)
    comm.mesh.barrier(timeout=a.timeout)
    t0 = time.monotonic()
    issued = []
    for layer in range(a.layers):
        issued.append(time.monotonic() - t0)
        send_layer(comm, a, layer, kv_idx, kv.stream)
    comm.flush(DECODE, timeout=a.timeout)
    took = time.monotonic() - t0
    log(comm.rank, f"round {rnd}: sent {a.layers} layers ({a.layers * lb / 2**20:.1f} MiB) in "
                   f"{took * 1e3:.2f} ms (issue + flush), {a.layers * lb / took / 1e9:.2f} GB/s; "
                   f"{comm.read_counter()} ops completed so far")
    comm.mesh.send(DECODE, json.dumps({"checksums": sums, "issued": issued}).encode(), timeout=a.timeout)
    verdict = comm.mesh.recv(DECODE, timeout=a.timeout).decode()
    log(comm.rank, f"round {rnd}: decode says {verdict}")
    return verdict.startswith("PASS")


def send_layer(comm: fc.Comm, a, layer: int, kv_idx: int, stream) -> None:
    """put() every chunk of ``layer`` but the last; put_signal() the last (ADD 1 to slot ``layer``),
    on ``stream`` when the cache is on the GPU."""
    base, cb = layer * layer_bytes(a), a.chunk_bytes
    for c in range(a.chunks - 1):
        off = base + c * cb
        comm.put(DECODE, off, off, cb, kv_idx, kv_idx, stream)
    off = base + (a.chunks - 1) * cb
    comm.put_signal(DECODE, off, off, cb, layer * fc.SLOT_BYTES, kv_idx, kv_idx, 1, stream)


# ----------------------------------------------------------------------------- decode

def decode(comm: fc.Comm, a, kv: KVCache, rnd: int) -> bool:
    """One round: wait for and checksum each layer as it lands, then verify; True on PASS."""
    lb = layer_bytes(a)
    comm.mesh.barrier(timeout=a.timeout)
    t0 = time.monotonic()
    arrived, pending = [], []
    with ThreadPoolExecutor(1) as hasher:  # checksums a layer while the next ones land
        for layer in range(a.layers):  # the slots ADD up: round r completes at value r + 1
            comm.wait_signal(PREFILL, layer * fc.SLOT_BYTES, rnd + 1, kv.stream, timeout=a.timeout)
            event = kv.arrived()  # GPU: the stream's wait passed once this event completes
            if event is not None:
                event.synchronize()
            arrived.append(time.monotonic() - t0)
            pending.append(hasher.submit(checksum, kv.host(layer)))
        got = [f.result() for f in pending]
    total, hashed = arrived[-1], time.monotonic() - t0
    sent = json.loads(comm.mesh.recv(PREFILL, timeout=a.timeout))
    problems = compare(comm, a, kv, rnd, got, sent["checksums"])
    if rnd == a.rounds - 1 or problems:
        for layer in range(a.layers):
            latency = arrived[layer] - sent["issued"][layer]
            log(comm.rank, f"round {rnd} layer {layer}: at +{arrived[layer] * 1e3:.2f} ms, latency "
                           f"{latency * 1e3:.2f} ms (from prefill's first put of the layer), {lb / 2**20:.2f} MiB, "
                           f"checksum {'ok' if got[layer] == sent['checksums'][layer] else 'MISMATCH'}")
    if problems:
        verdict = f"FAIL: {'; '.join(problems)}"
    else:
        verdict = (f"PASS: {a.layers} layers x {a.chunks} chunks x {a.chunk_bytes} B "
                   f"({a.layers * lb / 2**20:.1f} MiB) landed in {total * 1e3:.2f} ms, "
                   f"{a.layers * lb / total / 1e9:.2f} GB/s (all checksummed by +{hashed * 1e3:.2f} ms); checksums match prefill's for all "
                   f"{a.layers} layers; layers {sorted({0, a.layers - 1})} also match the seed byte for byte")
    log(comm.rank, f"round {rnd}: {verdict}")
    comm.mesh.send(PREFILL, verdict.encode(), timeout=a.timeout)
    return not problems


def compare(comm: fc.Comm, a, kv: KVCache, rnd: int, got, sums) -> list:
    """Every layer against prefill's checksum; the first and last against the seed;
    every slot exactly ``rnd + 1`` (one ADD per layer per round)."""
    lb, problems = layer_bytes(a), []
    for layer in range(a.layers):
        if got[layer] != sums[layer]:
            problems.append(f"layer {layer}: checksum {got[layer]} != prefill's {sums[layer]}")
        value = comm.read_signal(layer * fc.SLOT_BYTES)
        if value != rnd + 1:
            problems.append(f"layer {layer}: signal slot is {value}, expected exactly {rnd + 1}")
    for layer in sorted({0, a.layers - 1}):
        mine = kv.host(layer)
        diff = np.flatnonzero(mine != make_layer(a, rnd, layer))
        if diff.size:
            problems.append(f"layer {layer}: {diff.size} bytes differ from the seed, first at byte {diff[0]}")
    return problems


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        comm = fc.comm_init_from_env(timeout=a.timeout)
    except (fc.FlagcxError, RuntimeError) as e:
        print(f"pd_kv_transfer: cannot start: {e}\n(run it under python -m flagcx_mesh.launch -n 2, "
              f"mpiexec -n 2 or torchrun --nproc_per_node=2)", file=sys.stderr)
        return 2
    with comm:
        if comm.nranks != 2:
            print(f"pd_kv_transfer: needs exactly 2 ranks, got {comm.nranks}", file=sys.stderr)
            return 2
        try:
            return 0 if run(comm, a) else 1
        except (fc.FlagcxError, MeshError) as e:
            print(f"pd_kv_transfer: rank {comm.rank} failed: {e}", file=sys.stderr)
            return 1


def run(comm: fc.Comm, a) -> bool:
    kv = KVCache(a)
    kv_idx = comm.one_side_register(kv.buf)
    comm.signal_register(a.layers * fc.SLOT_BYTES)
    if comm.rank == PREFILL:
        log(comm.rank, f"launcher {detect_launch()}; KV cache on {a.device}; {a.layers} layers x {a.chunks} chunks x "
                       f"{a.chunk_bytes} B, {a.rounds} round(s); {comm.window_describe(kv_idx)}")
    ok = True
    for rnd in range(a.rounds):
        ok = (prefill(comm, a, kv, kv_idx, rnd) if comm.rank == PREFILL else decode(comm, a, kv, rnd)) and ok
        if not ok:
            break
    if ok and comm.rank == DECODE:
        log(comm.rank, f"all {a.rounds} round(s) passed: checksums match")
    return ok


if __name__ == "__main__":
    sys.exit(main())
