"""The mesh's own puts beside the agent's writes in `bench agent --device cuda`.

The bench (rank 0) and its flagcx_mesh target process (rank 1) also form a 2-rank mesh whose
window 0 is, on each side, the buffer the agent registered: the mesh's puts then take the same
path (FLAGCX_MESH_CUDA_PATH is forced in both processes), the same memory and the same block
layout as the agent's writes, in the same processes, and the two take turns (agent_gpu.Run), so
the goal "the agent's bandwidth at least the mesh's own" compares like with like in one run.
"""

from __future__ import annotations

from typing import Callable, List, Tuple

from ._gpu_peers import XFER_TIMEOUT


class MeshBeside:
    def __init__(self, target, buf, timeout: float):
        from ...mesh import Mesh, get_unique_id

        uid = get_unique_id()
        target.ask({"op": "mesh", "uid": uid.hex()})  # it joins on a thread of its own
        self.target = target
        self.mesh = Mesh(2, uid, 0, timeout=timeout)
        try:
            self.win = self.mesh.register_window(buf.obj)
        except BaseException:
            self.close()
            raise

    def prepare(self, pairs: List[Tuple[int, int]], block: int) -> Tuple[Callable[[], None], List[Callable[[], None]]]:
        """(all the blocks' puts then one flush, [one block's put + flush for each block])."""
        put, flush, win = self.mesh.put, self.mesh.flush, self.win

        def pipelined() -> None:
            for s, d in pairs:
                put(1, win, s, win, d, block)
            flush(1, timeout=XFER_TIMEOUT)

        def single(s: int, d: int) -> Callable[[], None]:
            def run() -> None:
                put(1, win, s, win, d, block)
                flush(1, timeout=XFER_TIMEOUT)
            return run

        return pipelined, [single(s, d) for s, d in pairs]

    def path(self) -> str:
        return self.mesh._core.window_info(self.win.index)["paths"][1][0]

    def close(self) -> None:
        """Both ranks close at once (the close is collective): the target is asked first."""
        self.target.send({"op": "mesh-close"})
        try:
            self.mesh.close()
        finally:
            self.target.answer({"op": "mesh-close"})
