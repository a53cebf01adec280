"""Roles of tests/test_agent_answers.py: readers that ask an owner for large reads and stop
reading; the owner's memory for their answers stays bounded.

    owner DIR KIND SIZE  registers SIZE bytes ("host": numpy memory, "device": the fake CUDA
                         driver's) of pattern(3), writes DIR/owner.meta and DIR/owner.region,
                         waits for DIR/stopped (the test stopped the readers), then samples its
                         stats() and its RssAnon for a second and prints "held H peak P grew G"
                         (the most of each seen; G: RssAnon growth since the region was
                         registered), writes DIR/measured and waits for the readers' "bye"
    reader DIR NAME SIZE reads SIZE bytes of the owner's region into host memory, stops itself
                         (SIGSTOP) right after the read was issued, and once continued checks
                         every byte
Each role prints "<role> ok" when it passed; any failure exits non-zero.
"""

import os
import signal
import sys
import time

import numpy as np

from flagcx_mesh.agent import Agent
from meshutil import publish, read_published

SECRET = "agent-answer-test-secret"
TIMEOUT = 90.0


def pattern(seed: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed) % 251).astype(np.uint8)


def rss_anon() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("FAILED: no RssAnon in /proc/self/status")


def owner(d: str, kind: str, size: int) -> None:
    with Agent("owner", SECRET, timeout=TIMEOUT) as a:
        data = pattern(3, size)
        if kind == "device":
            import fakecuda
            from gpu_prog import FakeBuf

            cu = fakecuda.FakeCuda.get()
            buf = FakeBuf(cu, cu.alloc(size), size)
            buf.write(0, data.tobytes())
            region = a.register(buf)
        else:
            buf = data
            region = a.register(buf)
        del data
        base = rss_anon()
        publish(d, "owner.region", region.descriptor)
        publish(d, "owner.meta", a.metadata())
        read_published(d, "stopped", timeout=TIMEOUT)
        held = peak = grew = 0
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            s = a.stats()
            held = max(held, s.get("get_answer_bytes_held", -1))
            peak = max(peak, s.get("get_answer_bytes_peak", -1))
            grew = max(grew, rss_anon() - base)
            time.sleep(0.02)
        print(f"held {held} peak {peak} grew {grew}", flush=True)
        publish(d, "measured", b"")
        byes, end = 0, time.monotonic() + TIMEOUT
        while byes < 2:
            if time.monotonic() > end:
                raise SystemExit("FAILED: the readers never said bye")
            byes += sum(n.data == b"bye" for n in a.notifications(timeout=1))
    print("owner ok", flush=True)


def reader(d: str, name: str, size: int) -> None:
    with Agent(name, SECRET, timeout=TIMEOUT) as a:
        conn = a.connect(read_published(d, "owner.meta", timeout=TIMEOUT))
        remote = read_published(d, "owner.region", timeout=TIMEOUT)
        dst = np.zeros(size, dtype=np.uint8)
        local = a.register(dst)
        h = conn.read(local, remote, size)
        os.kill(os.getpid(), signal.SIGSTOP)  # a reader that stops reading
        h.wait(TIMEOUT)
        if not np.array_equal(dst, pattern(3, size)):
            raise SystemExit(f"FAILED: {int((dst != pattern(3, size)).sum())} bytes of the read are wrong")
        conn.notify(b"bye")
    print("reader ok", flush=True)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "owner":
        owner(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif role == "reader":
        reader(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(f"unknown role {role}")
