"""Registered memory windows (one-sided targets) and signal windows."""

from __future__ import annotations

from typing import List, Optional, Tuple, Union


class Window:
    """A memory window registered collectively on a mesh.

    ``index`` is the registration order, identical on every rank. ``mode``
    says how this rank reaches the other ranks' copies of the window
    (``"shm"``, ``"cma"``, ``"tcp"``, or ``"self"`` for a one-rank mesh; for
    device windows ``"cuda-vmm"``, ``"cuda-ipc"``, ``"staged"`` or ``"cuda-self"``);
    ``device`` is the CUDA device of this rank's copy (None: host memory);
    ``paths`` gives it per peer, with the reason whenever a preferred path was
    not taken; ``peer_sizes`` the size of every rank's copy. Deregister with
    :meth:`close` (collective).
    """

    def __init__(self, mesh, index: int, keepalive=None):
        self._mesh = mesh
        self.index = index
        self._keepalive = keepalive  # (byte view, the user's object) for user windows
        info = mesh._core.window_info(index)
        self.kind: str = info["kind"]
        self.size: int = info["size"]
        self.mode: str = info["mode"]
        self.paths: List[Tuple[str, str]] = [tuple(p) for p in info["paths"]]
        # Bytes of every rank's copy, as the ranks published them at registration.
        self.peer_sizes: Tuple[int, ...] = tuple(info["peer_sizes"])
        self.device: Optional[int] = None if info["device"] < 0 else info["device"]
        self._address: int = info["address"]
        self.closed = False

    @property
    def __cuda_array_interface__(self) -> dict:
        """Device windows: the window's bytes as a CUDA array (``torch.as_tensor(w, device="cuda")``)."""
        if self.device is None:
            raise AttributeError("a host window has no __cuda_array_interface__; use .buffer")
        if self.closed:
            raise ValueError(f"window #{self.index} was closed: its device memory is gone")
        return {"shape": (self.size,), "typestr": "|u1", "data": (self._address, False), "version": 3,
                "strides": None}

    @property
    def buffer(self) -> memoryview:
        """The window's own bytes (library-allocated windows); for user windows, the user's buffer."""
        if self.device is not None:
            raise ValueError(f"window #{self.index} is CUDA memory: use torch.as_tensor(window, device='cuda')")
        if self._keepalive is not None:
            return self._keepalive[0]
        return memoryview(self._mesh._core.window_memory(self.index))

    def describe(self) -> str:
        """One line: index, kind, size, mode, and the path (and reason) per peer."""
        return self._mesh._core.window_info(self.index)["describe"]

    def __repr__(self) -> str:
        return f"<flagcx_mesh.Window #{self.index} {self.kind} {self.size} bytes mode={self.mode}>"

    def close(self) -> None:
        """Deregister (collective: every rank closes the same window). Ops on it then fail."""
        if not self.closed:
            self._mesh._core.deregister(self.index)
            self.closed = True
            self._keepalive = None


class SignalWindow(Window):
    """A window of 64-bit signal slots, the target of ``signal`` / ``put_signal``."""

    @property
    def nslots(self) -> int:
        return self.size // 8

    def read(self, slot: int) -> int:
        """The current value of ``slot`` in this rank's copy."""
        return self._mesh.read_signal(slot, window=self)

    def wait(self, slot: int, expected: int, timeout: Optional[float] = None) -> None:
        """Wait until ``slot`` >= ``expected``; see :meth:`Mesh.wait_signal`."""
        self._mesh.wait_signal(slot, expected, timeout=timeout, window=self)


WindowLike = Union[Window, int]


def index_of(w: WindowLike) -> int:
    if type(w) is int:  # the common case, kept cheap
        return w
    return w.index if isinstance(w, Window) else int(w)
