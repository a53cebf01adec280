"""The target of tests/test_agent_host_batch.py: one agent in its own process (so that cma
writes another process's memory) holding one zeroed host region.

    target DIR SIZE   registers a SIZE-byte region, writes DIR/target.meta and target.region,
                      then serves until a "bye" notification (or 120 s); prints "target ok"
"""

import sys
import time

import numpy as np

from flagcx_mesh.agent import Agent
from meshutil import publish

SECRET = "agent-host-batch-secret"


def target(d: str, size: int) -> None:
    buf = np.zeros(size, dtype=np.uint8)
    with Agent("target", SECRET) as a:
        region = a.register(buf)
        publish(d, "target.region", region.descriptor)
        publish(d, "target.meta", a.metadata())
        end = time.monotonic() + 120
        while time.monotonic() < end:
            if any(n.data == b"bye" for n in a.notifications(timeout=0.2)):
                break
    try:
        print("target ok", flush=True)
    except BrokenPipeError:
        pass


if __name__ == "__main__":
    if sys.argv[1] != "target":
        raise SystemExit(f"unknown role {sys.argv[1]}")
    target(sys.argv[2], int(sys.argv[3]))
