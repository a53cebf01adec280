"""Two processes: a target agent registers host memory and, when told, deregisters a region;
the initiator writes to it over FLAGCX_MESH_TRANSPORT (cma: region checks load from the target's
cookie table, mapped on first use). Prints "cookie ok" when the writes before the deregistration
landed and those after it were refused with nothing written."""

import multiprocessing as mp
import sys

import numpy as np

from flagcx_mesh import InvalidArgument
from flagcx_mesh.agent import Agent

SECRET = "cookie-secret"


def target(requests, answers):
    with Agent("cookie-target", SECRET, timeout=20) as b:
        bufs = [np.zeros(4096, np.uint8) for _ in range(3)]
        regions = [b.register(x) for x in bufs]
        answers.put((b.metadata(), [r.descriptor for r in regions]))
        while True:
            op = requests.get(timeout=60)
            if op == "bye":
                return
            regions[op].deregister()
            bufs[op][:] = 0
            answers.put(("deregistered", op, [int(x.sum()) for x in bufs]))


def main() -> int:
    mp.set_start_method("spawn")
    requests, answers = mp.Queue(), mp.Queue()
    p = mp.Process(target=target, args=(requests, answers), daemon=True)
    p.start()
    try:
        meta, descs = answers.get(timeout=60)
        with Agent("cookie-initiator", SECRET, timeout=20) as a:
            src = a.register(np.full(4096, 9, np.uint8))
            conn = a.connect(meta, timeout=10)
            for d in descs:  # maps the table (first check), then many checks are loads
                for _ in range(50):
                    conn.write(src, d, 4096).wait(10)
            print("path", conn.path_to(descs[0], src), flush=True)
            requests.put(1)
            _, _, sums = answers.get(timeout=60)
            try:
                conn.write(src, descs[1], 4096).wait(10)
                print("FAIL: a write to a deregistered region was taken", flush=True)
                return 1
            except InvalidArgument as e:
                print("refused:", e, flush=True)
            conn.write(src, descs[2], 4096).wait(10)  # the others still work
            requests.put("bye")
        p.join(30)
        if sums[1] != 0:
            print("FAIL: the deregistered region holds bytes", sums, flush=True)
            return 1
        print("cookie ok", flush=True)
        return 0
    finally:
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    sys.exit(main())
