"""The communicator: FlagCX's one-sided calls over one flagcx_mesh Mesh."""

from __future__ import annotations

import threading
from typing import List, Optional

from ..mesh import Mesh
from ._checks import _Reg
from ._onesided import _OneSided
from ._register import _Registration
from ._windows import _WindowForms


class Comm(_Registration, _OneSided, _WindowForms):
    """A communicator: FlagCX's one-sided calls over one :class:`flagcx_mesh.Mesh`.

    Made by :func:`comm_init_rank` / :func:`comm_init_from_env`, or ``Comm(mesh)`` to wrap
    a mesh you built (the communicator then owns it: :meth:`destroy` closes it). All
    operations are thread-safe; registrations are collective and must be made in the
    same order on every rank.

    Attributes: ``rank`` (this rank, 0..nranks-1, ``flagcxCommUserRank``), ``nranks`` (the
    number of ranks, ``flagcxCommCount``), ``mesh`` (the :class:`flagcx_mesh.Mesh` underneath,
    read-only). Both ints are fixed at creation.
    """

    def __init__(self, mesh: Mesh, timeout: Optional[float] = None):
        self._mesh = mesh
        self.rank: int = mesh.rank
        self.nranks: int = mesh.nranks
        self._timeout = timeout
        self._regs: List[Optional[_Reg]] = []
        self._sig: Optional[_Reg] = None
        self._lock = threading.Lock()  # registrations: index order == collective order
        self._destroyed = False
        self._last_error = ""

    @property
    def mesh(self) -> Mesh:
        """The underlying :class:`flagcx_mesh.Mesh` (for send/recv, allgather, barrier)."""
        return self._mesh

    def get_last_error(self) -> str:
        """The message of this communicator's last failure, or ""."""
        return self._last_error

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else f"{len(self._regs)} window(s)"
        return f"<flagcx_mesh.compat.Comm rank {self.rank} of {self.nranks}, {state}>"

    # -- lifetime ----------------------------------------------------------------
    def destroy(self) -> None:
        """Close the communicator (every connection and window). Idempotent; also on ``with``
        exit. Ops blocked in other threads raise InvalidUsage; later calls too."""
        self._destroyed = True
        self._mesh.close()

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()
