"""The two ends of `bench notify` (notify.py): per tool, one process's side of a ping-pong of an
8-byte write with its notification.

  flagcx_mesh  an Agent; conn.write(local, remote, 8, local_offset, remote_offset,
               notification=...) to the peer, then agent.wait_notification(peer) for the answer
  nixl         a NIXL agent (UCX backend), as vLLM's NixlConnector drives it: prepped descriptor
               lists (prep_xfer_dlist, one 8-byte slot a descriptor), make_prepped_xfer("WRITE",
               local, [i], remote, [i], notif_msg=...) + transfer, then, until the answer is
               there, check_xfer_state of the write in flight and get_new_notifs() in turn (NIXL
               sends a write's notification once its initiator saw the write complete)

Each end registers one buffer of 2 x n 8-byte slots (host memory, or device memory from
bench/_gpumem.py). Round trip i of a run: the initiator writes its slot i of half 0 into the
target's slot i of half 0 with the slot's value as the notification; the target, once that
notification is there, writes its slot i of half 1 into the initiator's slot i of half 1 the same
way. Before a run each end fills the half it sends from with that run's values and zeroes the
half it receives into (`fill`); every notification must carry the value expected, on host memory
the 8 bytes must be there when it is, and after the run every received slot must hold its value
(`verify`, a read back of device memory).
"""

from __future__ import annotations

import os
import struct
import time
from typing import Dict

SECRET = "bench-notify"
WAIT_S = 30.0  # seconds one answer may take before the run fails
PONG = 1 << 62  # the answers' values: the question's with this bit set


class Mismatch(RuntimeError):
    """A notification or its bytes were not what the round trip sent."""


def value(run: int, i: int, half: int) -> int:
    return (run << 32) + i + 1 + (PONG if half else 0)


class Slots:
    """The 2 x n slots of one end, in host memory (numpy) or device memory (_gpumem's buffer)."""

    def __init__(self, n: int, device: str, memory: str, kind: str):
        import numpy as np

        self.np, self.n, self.nbytes = np, n, 16 * n
        if device == "cpu":
            self.array = np.zeros(self.nbytes, np.uint8)
            self.dev, self.ptr, self.obj = None, self.array.ctypes.data, self.array
        else:
            from .. import _gpumem

            self.dev = _gpumem.make(memory).buffer(self.nbytes, kind)
            self.ptr, self.obj, self.array = self.dev.ptr, self.dev.obj, None

    @staticmethod
    def offset(i: int, half: int, n: int) -> int:
        return (half * n + i) * 8

    def _values(self, run: int, half: int):
        return self.np.array([value(run, i, half) for i in range(self.n)], dtype="<u8")

    def fill(self, run: int, send_half: int) -> None:
        words = self.np.zeros(2 * self.n, dtype="<u8")
        words[send_half * self.n:(send_half + 1) * self.n] = self._values(run, send_half)
        if self.dev is None:
            self.array[:] = words.view(self.np.uint8)
        else:
            self.dev.write(words.view(self.np.uint8))

    def landed(self, i: int, half: int) -> bytes:
        """The 8 bytes of slot i (host memory only)."""
        at = self.offset(i, half, self.n)
        return self.array[at:at + 8].tobytes()

    def verify(self, run: int, recv_half: int) -> None:
        data = self.array if self.dev is None else self.dev.read()
        got = data.view("<u8")[recv_half * self.n:(recv_half + 1) * self.n]
        bad = self.np.nonzero(got != self._values(run, recv_half))[0]
        if len(bad):
            raise Mismatch(f"{len(bad)} of {self.n} slots did not receive their bytes (first: slot {bad[0]})")


def _check(what: str, got: bytes, want: bytes) -> None:
    if got != want:
        raise Mismatch(f"{what}: {got!r} where {want!r} was sent")


class _End:
    """What both tools share: the round trip's order and its checks. A tool gives _send(i, half, v)
    and _receive() -> the notification's bytes."""

    def __init__(self, slots: Slots):
        self.slots = slots

    def _arrived(self, i: int, half: int, v: bytes) -> None:
        _check("notification", self._receive(), v)
        if self.slots.dev is None:
            _check("the 8 bytes before their notification", self.slots.landed(i, half), v)

    def ping(self, run: int, i: int) -> None:
        self._send(i, 0, struct.pack("<Q", value(run, i, 0)))
        self._arrived(i, 1, struct.pack("<Q", value(run, i, 1)))

    def pong(self, run: int, i: int) -> None:
        self._arrived(i, 0, struct.pack("<Q", value(run, i, 0)))
        self._send(i, 1, struct.pack("<Q", value(run, i, 1)))


class FlagcxEnd(_End):
    name = "flagcx_mesh"

    def __init__(self, role: str, slots: Slots, progress_thread: bool = True):
        from ...agent import Agent

        super().__init__(slots)
        self.agent = Agent(f"bench-notify-{role}-{os.getpid()}", SECRET)
        self.region = self.agent.register(slots.obj)
        self.conn = self.peer = self.remote = self.handle = None

    def hello(self) -> Dict[str, str]:
        return {"metadata": self.agent.metadata().hex(), "region": self.region.descriptor.hex()}

    def meet(self, info: Dict[str, str]) -> None:
        self.conn = self.agent.connect(bytes.fromhex(info["metadata"]))
        self.peer, self.remote = self.conn.peer_name, bytes.fromhex(info["region"])

    def path(self) -> str:
        return self.conn.path_to(self.remote, self.region)

    def _send(self, i: int, half: int, v: bytes) -> None:
        if self.handle is not None:  # the previous write's completion (landed long ago: its answer came)
            self.handle.wait(WAIT_S)
        at = Slots.offset(i, half, self.slots.n)
        self.handle = self.conn.write(self.region, self.remote, 8, at, at, notification=v)

    def _receive(self) -> bytes:
        return self.agent.wait_notification(self.peer, timeout=WAIT_S).data

    def settle(self) -> None:
        """The last write's completion (after a run, before the peer hears anything else)."""
        if self.handle is not None:
            self.handle.wait(WAIT_S)
            self.handle = None

    def close(self) -> None:
        self.agent.close()


class NixlEnd(_End):
    """NIXL's side (importing nixl raises what is missing: the bench reports it as NOT RUN)."""

    name = "nixl"

    def __init__(self, role: str, slots: Slots, progress_thread: bool = True):
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        from nixl._api import nixl_agent, nixl_agent_config

        super().__init__(slots)
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        self.agent = nixl_agent(f"bench-notify-nixl-{role}-{os.getpid()}", config)
        self.progress_thread = progress_thread
        self.mem = "DRAM" if slots.dev is None else "VRAM"
        if self.agent.register_memory([(slots.ptr, slots.nbytes, 0, "")], self.mem) is None:
            raise RuntimeError(f"NIXL register_memory of {slots.nbytes} bytes of {self.mem} failed")
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._descs(slots.ptr), self.mem)
        self.peer = self.remote = self.handle = None

    def _descs(self, base: int) -> list:
        return [(base + 8 * k, 8, 0) for k in range(2 * self.slots.n)]

    def hello(self) -> Dict[str, object]:
        return {"metadata": self.agent.get_agent_metadata().hex(), "ptr": self.slots.ptr}

    def meet(self, info: Dict[str, object]) -> None:
        self.peer = self.agent.add_remote_agent(bytes.fromhex(info["metadata"]))
        self.agent.make_connection(self.peer)
        self.remote = self.agent.prep_xfer_dlist(self.peer, self._descs(int(info["ptr"])), self.mem)
        self.notifier = self.peer.decode() if isinstance(self.peer, bytes) else self.peer  # get_new_notifs' key

    def path(self) -> str:
        thread = "" if self.progress_thread else ", no progress thread"
        return "UCX_TLS=" + os.environ.get("UCX_TLS", "(default)") + thread

    def settle(self) -> None:
        """The last write's completion (after a run, before the peer hears anything else)."""
        if self.handle is None:
            return
        end = time.monotonic() + WAIT_S
        while (state := self.agent.check_xfer_state(self.handle)) == "PROC":
            if time.monotonic() > end:
                raise TimeoutError(f"a NIXL WRITE stayed in PROC for {WAIT_S:.0f} s")
        if state != "DONE":
            raise RuntimeError(f"a NIXL WRITE ended {state}")
        self.agent.release_xfer_handle(self.handle)
        self.handle = None

    def _send(self, i: int, half: int, v: bytes) -> None:
        self.settle()
        k = half * self.slots.n + i
        self.handle = self.agent.make_prepped_xfer("WRITE", self.local, [k], self.remote, [k], notif_msg=v)
        if self.agent.transfer(self.handle) == "ERR":
            raise RuntimeError("a NIXL WRITE failed to post")

    def _poll_done(self) -> None:
        """One look at the write in flight (NIXL's UCX backend sends a write's notification once
        its initiator saw it complete: vLLM's connector looks at its transfers every step too)."""
        if self.handle is None:
            return
        state = self.agent.check_xfer_state(self.handle)
        if state == "DONE":
            self.agent.release_xfer_handle(self.handle)
            self.handle = None
        elif state != "PROC":
            raise RuntimeError(f"a NIXL WRITE ended {state}")

    def _receive(self) -> bytes:
        end = time.monotonic() + WAIT_S
        while True:
            self._poll_done()
            got = self.agent.get_new_notifs().get(self.notifier)
            if got:
                return got[-1]
            if time.monotonic() > end:
                raise TimeoutError(f"no NIXL notification from {self.peer} within {WAIT_S:.0f} s")

    def close(self) -> None:
        self.agent.remove_remote_agent(self.peer)


TOOLS = {"flagcx_mesh": FlagcxEnd, "nixl": NixlEnd}
