"""FlagCX's vLLM connector's P2P engine sequence on flagcx_mesh.compat.p2p, one process per role.

    pair [--device cpu|cuda] [--timeout S]   runs a decode and a prefill process (below), each
                                             bounded by the timeout; exit 0 when both passed
    decode DIR [--device ...]                the connector's decode worker
    prefill DIR [--device ...]               the connector's prefill worker

The calls are the connector's, through P2pLibrary (FlagCX's wrapper's method names). Decode:
flagcxP2pEngineCreate, flagcxP2pRegister per KV layer (and flagcxP2pRegisterHost for a host
buffer), flagcxP2pGetRpcPort, flagcxP2pStartRpcServer; then it sends its metadata (hostname,
rpc port, the layers' base addresses and block lengths, the request's block ids) to prefill's
side channel and waits for the answer. Prefill: the same create and registrations; on the
metadata, flagcxP2pGetConn("host:port") (cached), block lists coalesced into contiguous runs,
flagcxP2pBatchWriteSync by absolute addresses, then the refusal cases (each must raise
InvalidArgument and write nothing), and the answer b"trans_done". Decode then checks every byte
of its memory: the requested blocks hold prefill's bytes, everything else (the blocks the refused
writes aimed at, the gaps between layers) is still zero.

The side channel is a plain TCP socket with length-prefixed JSON (the connector uses msgpack
over ZMQ; pyzmq is not a test dependency). --device cuda puts the KV layers in torch CUDA
tensors (scripts/test-gpu.sh runs it on a GPU).
"""

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

from flagcx_mesh.compat import FlagcxError, Result
from flagcx_mesh.compat.p2p import P2pLibrary

NLAYERS, NBLOCKS, BLOCK, GAP, HOST_BYTES = 3, 16, 4096, 4096, 8192
LAYER = NBLOCKS * BLOCK
ARENA = NLAYERS * (LAYER + GAP)
PREFILL_BLOCKS = [3, 4, 5, 9, 10]   # prefill's blocks of the request ...
DECODE_BLOCKS = [0, 1, 2, 7, 11]    # ... land in these of decode
UNTOUCHED_BLOCK = 12                # a refused batch aims one good entry here
SECRET = "p2p-test-secret"


def pattern(seed: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed) % 251).astype(np.uint8)


class Memory:
    """One arena of bytes on the CPU (numpy) or a CUDA device (torch)."""

    def __init__(self, nbytes: int, device: str):
        self.device = device
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise SystemExit("--device cuda: torch sees no CUDA device")
            self.buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
            self.addr = self.buf.data_ptr()
        else:
            self.buf = np.zeros(nbytes, dtype=np.uint8)
            self.addr = self.buf.ctypes.data

    def fill(self, data: np.ndarray) -> None:
        if self.device == "cuda":
            import torch

            self.buf.copy_(torch.from_numpy(data))
            torch.cuda.synchronize()
        else:
            self.buf[:] = data

    def read(self) -> np.ndarray:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            return self.buf.cpu().numpy()
        return self.buf.copy()


def layer_base(mem: Memory, layer: int) -> int:
    return mem.addr + layer * (LAYER + GAP)


def register_all(lib, engine, kv: Memory, host: Memory) -> None:
    """The connector registers every KV storage with flagcxP2pRegister; the host buffer here
    goes through flagcxP2pRegisterHost. Layers are separate registrations with unregistered
    gaps between them."""
    for layer in range(NLAYERS):
        lib.flagcxP2pRegister(engine, layer_base(kv, layer), LAYER)
    lib.flagcxP2pRegisterHost(engine, host.addr, HOST_BYTES)


def send_msg(sock: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise SystemExit("the side channel closed early")
        out += chunk
    return out


def recv_msg(sock: socket.socket):
    (n,) = struct.unpack("<I", recv_exact(sock, 4))
    return json.loads(recv_exact(sock, n))


def publish(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def wait_file(path: str, timeout: float) -> str:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise SystemExit(f"{path} never appeared")
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


# ---------------------------------------------------------------- decode

def decode(d: str, device: str, timeout: float) -> None:
    lib = P2pLibrary(secret=os.environ.get("FLAGCX_MESH_AGENT_SECRET", SECRET))
    engine = lib.flagcxP2pEngineCreate()
    kv, host = Memory(ARENA, device), Memory(HOST_BYTES, "cpu")
    register_all(lib, engine, kv, host)
    rpc_port = lib.flagcxP2pGetRpcPort(engine)
    lib.flagcxP2pStartRpcServer(engine)
    side_port = int(wait_file(os.path.join(d, "prefill.side"), timeout))
    metadata = {
        "remote_hostname": engine.host, "remote_port": rpc_port, "remote_tp_size": 1, "remote_tp_rank": 0,
        "req_blocks": {"req-0": ["xfer-0", [DECODE_BLOCKS]]},
        "kv_caches_base_addr": [layer_base(kv, layer) for layer in range(NLAYERS)],
        "block_lens": [BLOCK] * NLAYERS, "host_base_addr": host.addr,
    }
    with socket.create_connection(("127.0.0.1", side_port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        send_msg(sock, metadata)
        answer = recv_msg(sock)
    if answer != "trans_done":
        raise SystemExit(f"decode: prefill answered {answer!r}")
    check_landed(kv.read(), host.read())
    lib.flagcxP2pEngineDestroy(engine)
    print(f"decode: PASS: {len(DECODE_BLOCKS)} blocks x {NLAYERS} layers and {HOST_BYTES // 2} host bytes "
          f"landed ({device}); the refused writes left every other byte zero", flush=True)


def check_landed(kv: np.ndarray, host: np.ndarray) -> None:
    src = pattern(1, ARENA)
    want = np.zeros(ARENA, dtype=np.uint8)
    for layer in range(NLAYERS):
        base = layer * (LAYER + GAP)
        for p, q in zip(PREFILL_BLOCKS, DECODE_BLOCKS):
            want[base + q * BLOCK:base + (q + 1) * BLOCK] = src[base + p * BLOCK:base + (p + 1) * BLOCK]
    bad = np.flatnonzero(kv != want)
    if bad.size:
        at = int(bad[0])
        layer, off = divmod(at, LAYER + GAP)
        raise SystemExit(f"decode: {bad.size} wrong KV bytes, the first at layer {layer} offset {off} "
                         f"(block {off // BLOCK}{', in the gap' if off >= LAYER else ''}): "
                         f"{kv[at]} instead of {want[at]}")
    want_host = np.zeros(HOST_BYTES, dtype=np.uint8)
    want_host[HOST_BYTES // 2:] = pattern(2, HOST_BYTES)[:HOST_BYTES // 2]
    if not np.array_equal(host, want_host):
        raise SystemExit(f"decode: {int((host != want_host).sum())} wrong host bytes")


# ---------------------------------------------------------------- prefill

def runs(local, remote):
    """Contiguous runs of both block lists (the connector's group_concurrent_contiguous)."""
    out = [[[local[0]], [remote[0]]]]
    for a, b in zip(zip(local, local[1:]), zip(remote, remote[1:])):
        if a[1] - a[0] == 1 and b[1] - b[0] == 1:
            out[-1][0].append(a[1])
            out[-1][1].append(b[1])
        else:
            out.append([[a[1]], [b[1]]])
    return out


def prefill(d: str, device: str, timeout: float) -> None:
    lib = P2pLibrary(secret=os.environ.get("FLAGCX_MESH_AGENT_SECRET", SECRET))
    engine = lib.flagcxP2pEngineCreate()
    kv, host = Memory(ARENA, device), Memory(HOST_BYTES, "cpu")
    kv.fill(pattern(1, ARENA))
    host.fill(pattern(2, HOST_BYTES))
    register_all(lib, engine, kv, host)
    lib.flagcxP2pGetRpcPort(engine)
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(timeout)
        publish(os.path.join(d, "prefill.side"), str(server.getsockname()[1]))
        sock, _ = server.accept()
    with sock:
        sock.settimeout(timeout)
        meta = recv_msg(sock)
        try:
            problems = send_kv(lib, engine, kv, host, meta)
        except FlagcxError as e:
            problems = [f"the write failed: {e}"]
        send_msg(sock, "trans_done" if not problems else "trans_error: " + "; ".join(problems))
    lib.flagcxP2pEngineDestroy(engine)
    if problems:
        raise SystemExit("prefill: " + "; ".join(problems))
    print("prefill: PASS: one batch written, 6 refusals with nothing written", flush=True)


def send_kv(lib, engine, kv: Memory, host: Memory, meta) -> list:
    session = f"{meta['remote_hostname']}:{meta['remote_port']}"
    conn = lib.flagcxP2pGetConn(engine, session)
    if lib.flagcxP2pGetConn(engine, session) is not conn:
        return ["a second flagcxP2pGetConn of the session made another connection"]
    _, (remote_blocks,) = meta["req_blocks"]["req-0"]
    src_vas, dst_vas, sizes = [], [], []
    for layer, (dst_base, block_len) in enumerate(zip(meta["kv_caches_base_addr"], meta["block_lens"])):
        for local, remote in runs(PREFILL_BLOCKS, remote_blocks):
            src_vas.append(layer_base(kv, layer) + local[0] * BLOCK)
            dst_vas.append(dst_base + remote[0] * block_len)
            sizes.append(len(local) * BLOCK)
    src_vas.append(host.addr)
    dst_vas.append(meta["host_base_addr"] + HOST_BYTES // 2)
    sizes.append(HOST_BYTES // 2)
    src_vas.append(0)  # a size-0 entry is skipped, whatever its addresses
    dst_vas.append(0)
    sizes.append(0)
    lib.flagcxP2pBatchWriteSync(conn, src_vas, dst_vas, sizes)
    return refusals(lib, conn, kv, meta)


def refusals(lib, conn, kv: Memory, meta) -> list:
    """Writes that must be refused (InvalidArgument, nothing written: decode checks the bytes)."""
    d0, d1 = meta["kv_caches_base_addr"][:2]
    s0, s1 = layer_base(kv, 0), layer_base(kv, 1)
    cases = {
        "dst past the end of a layer": ([s0], [d0 + LAYER - BLOCK // 2], [BLOCK]),
        "dst in the gap after a layer": ([s0], [d0 + LAYER + 16], [64]),
        "dst below every registration": ([s0], [8], [64]),
        "src in an unregistered gap": ([s0 + LAYER + 16], [d0], [64]),
        "one good entry and one bad": ([s1, s0], [d1 + UNTOUCHED_BLOCK * BLOCK, d0 + LAYER + 16], [BLOCK, 64]),
        "argument lengths differ": ([s0, s0], [d0], [64]),
    }
    problems = []
    for name, (src, dst, size) in cases.items():
        try:
            lib.flagcxP2pBatchWriteSync(conn, src, dst, size)
            problems.append(f"{name}: accepted")
        except FlagcxError as e:
            if e.code != Result.InvalidArgument:
                problems.append(f"{name}: {e} (expected InvalidArgument)")
            elif "lengths" not in name and "nothing was written" not in str(e):
                problems.append(f"{name}: the message does not say nothing was written: {e}")
    return problems


# ---------------------------------------------------------------- the pair

def pair(device: str, timeout: float) -> int:
    env = dict(os.environ)
    env.setdefault("FLAGCX_MESH_AGENT_SECRET", SECRET)
    with tempfile.TemporaryDirectory() as d:
        args = ["--device", device, "--timeout", str(timeout)]
        procs = {role: subprocess.Popen([sys.executable, os.path.abspath(__file__), role, d, *args], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for role in ("decode", "prefill")}
        end, status = time.monotonic() + timeout + 30, 0
        for role, p in procs.items():
            try:
                out, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                out += f"\n{role}: killed after {timeout + 30:g} s\n"
            print(f"--- {role} (exit {p.returncode})\n{out.rstrip()}", flush=True)
            status = status or int(p.returncode != 0)
    print("pair: PASS" if status == 0 else "pair: FAIL", flush=True)
    return status


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", choices=["pair", "decode", "prefill"])
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args()
    if a.role == "pair":
        sys.exit(pair(a.device, a.timeout))
    if not a.dir:
        ap.error(f"{a.role} needs DIR")
    (decode if a.role == "decode" else prefill)(a.dir, a.device, a.timeout)


if __name__ == "__main__":
    main()
