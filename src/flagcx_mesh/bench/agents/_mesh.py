"""The mesh's own puts beside the agent's writes in `bench agent` (host memory, one process).

Rank 0 and rank 1 of a 2-rank mesh run on two threads of the bench's process, as its two agents
do: rank 0's window is the initiator's source buffer, rank 1's the target's buffer (over shm,
windows both ranks allocate, as the agent's target allocates its region). The same blocks then go
over the path FLAGCX_MESH_TRANSPORT forces for both, pipelined (every put, then one flush) and
blocking (put + flush per block), so that "the agent's bandwidth at least the mesh's own" is
read off one run.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Tuple

BUILD_TIMEOUT = 30.0


def _on_threads(*bodies: Callable[[], object]) -> list:
    """Runs each body on a thread of its own (the mesh's collective calls); re-raises the first error."""
    out: list = [None] * len(bodies)
    errors: list = []

    def run(i: int) -> None:
        try:
            out[i] = bodies[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BUILD_TIMEOUT + 15)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("bench agent: a rank of the mesh beside the agents did not finish in time")
    return out


class HostMeshBeside:
    def __init__(self, src, dst, shm: bool):
        import flagcx_mesh

        uid = flagcx_mesh.get_unique_id()
        self.meshes = _on_threads(*(lambda r=r: flagcx_mesh.Mesh(2, uid, r, timeout=BUILD_TIMEOUT) for r in (0, 1)))
        try:
            if shm:  # (a collective: both ranks make the same call)
                self.src_win, self.dst_win = _on_threads(*(lambda m=m: m.alloc_window(dst.nbytes) for m in self.meshes))
            else:
                self.src_win, self.dst_win = _on_threads(lambda: self.meshes[0].register_window(src),
                                                         lambda: self.meshes[1].register_window(dst))
        except BaseException:
            self.close()
            raise

    def path(self) -> str:
        return self.meshes[0]._core.window_info(self.dst_win.index)["paths"][1][0]

    def figures(self, pairs: List[Tuple[int, int]], block: int, reps: int) -> Dict[str, float]:
        """GB/s of the same blocks: all the puts then one flush, and put + flush per block."""
        m, s, d = self.meshes[0], self.src_win, self.dst_win
        put, flush = m.put, m.flush

        def pipelined() -> None:
            for a, b in pairs:
                put(1, s, a, d, b, block)
            flush(1, timeout=60)

        def blocking() -> None:
            for a, b in pairs:
                put(1, s, a, d, b, block)
                flush(1, timeout=60)

        pipelined()  # paths chosen, pages touched
        total = block * len(pairs) * reps / 1e9
        out = {}
        for name, f in (("pipelined_GBps", pipelined), ("blocking_GBps", blocking)):
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            out[name] = total / (time.perf_counter() - t0)
        return out

    def close(self) -> None:
        """Both ranks close at once (the close is collective)."""
        _on_threads(*(lambda m=m: m.close() for m in self.meshes if m is not None))
