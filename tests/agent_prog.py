"""Agent scenario programs for tests/test_agent*.py, one process per role.

    serve DIR NAME COUNT   registers a user region and a shm region, writes
                           DIR/NAME.meta, NAME.user, NAME.shm, then answers
                           notifications "check <region> <off> <len> <seed>"
                           (checks the bytes landed before it, answers "ok"/"bad")
                           until COUNT peers said "bye"; prints "served N"
    write DIR NAME TAG     connects to NAME, batch-writes, notifies, reads back
    hold DIR NAME          connects to NAME and waits for stdin to close
    spam DIR NAME          connects to NAME and writes 1 MiB batches until killed
    decode DIR NAME ME SECONDS
                           for SECONDS, stays of 1-4 requests under the name ME (each stay a new
                           agent: a new incarnation): connects to NAME, asks for blocks
                           ("req <id> <count>" + its region descriptor), checks every block the
                           answer ("done <id> <gen> <b,b,...> " + the cache's descriptor) names,
                           reads one cache block back and checks it, says "bye", leaves; appends
                           "connect" and "ok <written> <read>" lines to DIR/ME.<pid>.log
FLAGCX_MESH_TRANSPORT in the environment forces the path (tcp, cma, shm).
"""

import os
import sys
import time

import numpy as np

import flagcx_mesh
import flagcx_mesh.agent
from flagcx_mesh.agent import Agent
from meshutil import publish, read_published

SECRET = "agent-test-secret"
SIZE = 1 << 20


def pattern(seed: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed) % 251).astype(np.uint8)


def serve(d: str, name: str, count: int) -> None:
    buf = np.zeros(SIZE, dtype=np.uint8)
    with Agent(name, SECRET) as a:
        user = a.register(buf)
        shm = a.alloc(SIZE)
        views = {"user": memoryview(buf), "shm": shm.view}
        publish(d, f"{name}.user", user.descriptor)
        publish(d, f"{name}.shm", shm.descriptor)
        publish(d, f"{name}.meta", a.metadata())
        served = byes = 0
        end = time.monotonic() + 120
        while byes < count and time.monotonic() < end:
            for n in a.notifications(timeout=0.5):
                words = n.data.decode().split()
                if words[0] == "bye":
                    byes += 1
                if words[0] != "check":
                    continue
                region, off, ln, seed = words[1], int(words[2]), int(words[3]), int(words[4])
                got = np.frombuffer(views[region], dtype=np.uint8)[off:off + ln]
                ok = np.array_equal(got, pattern(seed, ln))
                conn = a.connection(n.peer)
                try:
                    if conn is not None:
                        conn.notify(b"ok" if ok else b"bad")
                except flagcx_mesh.PeerLost:
                    pass  # that peer left without waiting for the answer
                served += 1
        print(f"served {served}", flush=True)


def write(d: str, name: str, tag: int) -> None:
    with Agent(f"writer-{tag}-{os.getpid()}", SECRET) as a:
        conn = a.connect(read_published(d, f"{name}.meta"))
        for region in ("user", "shm"):
            remote = read_published(d, f"{name}.{region}")
            src = np.zeros(SIZE, dtype=np.uint8)
            local = a.register(src)
            off, ln = (tag * 4096) % (SIZE // 2), 3 * 1000
            src[:ln] = pattern(tag, ln)
            ops = [(local, i * 1000, remote, off + i * 1000, 1000) for i in range(3)]
            h = conn.batch_write(ops, notification=f"check {region} {off} {ln} {tag}".encode())
            h.wait(30)
            answer = a.notifications(timeout=30)
            assert answer and answer[0].data == b"ok", answer
            back = np.zeros(ln, dtype=np.uint8)
            local_back = a.register(back)
            conn.read(local_back, remote, ln, remote_offset=off).wait(30)
            assert np.array_equal(back, pattern(tag, ln)), "read back differs"
            print(f"{region} over {conn.path_to(remote)}", flush=True)
        conn.notify(b"bye")
        print("write ok", flush=True)


def hold(d: str, name: str) -> None:
    with Agent(f"holder-{os.getpid()}", SECRET) as a:
        a.connect(read_published(d, f"{name}.meta"))
        print("connected", flush=True)
        sys.stdin.read()


def spam(d: str, name: str) -> None:
    with Agent(f"spammer-{os.getpid()}", SECRET) as a:
        conn = a.connect(read_published(d, f"{name}.meta"))
        remote = read_published(d, f"{name}.user")
        local = a.register(np.full(SIZE, 1, dtype=np.uint8))
        ops = [(local, i * (SIZE // 16), remote, i * (SIZE // 16), SIZE // 16) for i in range(16)]
        conn.batch_write(ops).wait(30)
        print("writing", flush=True)
        while True:
            conn.batch_write(ops)


BLOCK = 64 << 10
REQ_BLOCKS = 16


def block_pattern(gen: int, block: int) -> np.ndarray:
    """Cache block `block` of cache generation `gen` (the prefill fills its cache with these)."""
    return pattern(gen * 100003 + block, BLOCK)


def decode_stay(a: Agent, meta: bytes, rng, log) -> None:
    buf = np.zeros(REQ_BLOCKS * BLOCK, dtype=np.uint8)
    mine = a.register(buf)
    back = np.zeros(BLOCK, dtype=np.uint8)
    local_back = a.register(back)
    conn = a.connect(meta)
    log.write("connect\n")
    for req in range(int(rng.integers(1, 5))):
        count = int(rng.integers(1, REQ_BLOCKS + 1))
        conn.notify(f"req {req} {count} ".encode() + mine.descriptor)
        answer = a.notifications(timeout=30)
        assert len(answer) == 1 and answer[0].data.startswith(f"done {req} ".encode()), answer
        _, _, gen, blocks, cache = answer[0].data.split(b" ", 4)
        blocks = [int(b) for b in blocks.split(b",")]
        for i, b in enumerate(blocks):
            assert np.array_equal(buf[i * BLOCK:(i + 1) * BLOCK], block_pattern(int(gen), b)), f"block {b} differs"
        read = 0
        b = int(rng.integers(0, flagcx_mesh.agent.region_info(cache)["size"] // BLOCK))
        try:
            conn.read(local_back, cache, BLOCK, remote_offset=b * BLOCK).wait(30)
            assert np.array_equal(back, block_pattern(int(gen), b)), f"cache block {b} read back differs"
            read = BLOCK
        except flagcx_mesh.InvalidArgument as e:  # the prefill re-registered its cache meanwhile
            assert "deregistered" in str(e), e
        log.write(f"ok {len(blocks) * BLOCK} {read}\n")
    conn.notify(b"bye")


def decode(d: str, name: str, me: str, seconds: float) -> None:
    meta = read_published(d, f"{name}.meta")
    rng = np.random.default_rng(os.getpid())
    end = time.monotonic() + seconds
    with open(os.path.join(d, f"{me}.{os.getpid()}.log"), "w", buffering=1) as log:
        while time.monotonic() < end:
            with Agent(me, SECRET) as a:
                decode_stay(a, meta, rng, log)
    print("decode done", flush=True)


def main() -> None:
    role, d, name = sys.argv[1], sys.argv[2], sys.argv[3]
    if role == "serve":
        serve(d, name, int(sys.argv[4]))
    elif role == "write":
        write(d, name, int(sys.argv[4]))
    elif role == "spam":
        spam(d, name)
    elif role == "decode":
        decode(d, name, sys.argv[4], float(sys.argv[5]))
    elif role == "hold":
        hold(d, name)
    else:
        raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    flagcx_mesh  # imported for its error types in tracebacks
    main()
