"""Dynamic peers: an :class:`Agent` registers memory once and serves whichever
agents connect (prefill/decode disaggregation, the NIXL / Mooncake model).

Each process makes one agent with a name and a shared secret; it listens on an
ephemeral port of the chosen interface (``FLAGCX_MESH_IFNAME``). Registration
is local (``register`` / ``alloc``) and returns a :class:`Region` whose
``descriptor`` bytes peers use to address it. ``agent.metadata()`` is sent to
peers by any channel; ``peer.connect(metadata)`` opens an authenticated
connection (both sides prove the secret). Writes and reads return a
:class:`Handle`; a notification sent with a transfer reaches the target after
the data landed, where ``agent.notifications(timeout)`` returns it. See
docs/agent.md.
"""

from __future__ import annotations

import ctypes
from typing import Iterable, Optional, Sequence, Union

from . import _core
from . import cuda as _cuda
from .errors import InvalidArgument
from ._timeouts import call_timeout
from ._args import _byte_view

__all__ = ["Agent", "AgentConnection", "Region", "Handle", "Notification", "NotificationWait", "region_info"]

Desc = Union[bytes, "Region"]


def _desc(d: Desc) -> bytes:
    if isinstance(d, Region):
        return d.descriptor
    if isinstance(d, (bytes, bytearray, memoryview)):
        return bytes(d)
    raise InvalidArgument(f"a region descriptor must be a Region or bytes, not {type(d).__name__}")


def _op_list(ops: Iterable[Op]) -> list:
    """A batch's ops as the core takes them (it checks each: descriptors, offsets, sizes)."""
    return ops if type(ops) is list else list(ops)


def _table(table):
    """A table of ops as the core reads it: a buffer. A torch tensor (which has none) is viewed
    through ctypes, without numpy; the caller keeps it alive for the call (the core reads the
    table before it returns)."""
    if not type(table).__module__.startswith("torch") or not hasattr(table, "data_ptr"):
        return table
    if table.device.type != "cpu":
        raise InvalidArgument(f"table must be in host memory, not on {table.device}")
    if str(table.dtype) not in ("torch.int64", "torch.uint64") or table.dim() != 2 or table.shape[1] not in (3, 5):
        raise InvalidArgument(f"table must be an (n, 5) or (n, 3) tensor of 64-bit integers, got {table.dtype} "
                              f"of shape {tuple(table.shape)}")
    if not table.is_contiguous():
        raise InvalidArgument("table must be a contiguous tensor (call .contiguous())")
    rows, cols = table.shape
    cell = ctypes.c_int64 if str(table.dtype) == "torch.int64" else ctypes.c_uint64
    return ((cell * cols) * rows).from_address(table.data_ptr()) if rows else ((cell * cols) * 0)()


def _stream(stream) -> Optional[int]:
    return stream if stream is None else _cuda.stream_handle(stream)


def region_info(descriptor: bytes) -> dict:
    """The fields of a descriptor: agent, incarnation, index, size, kind."""
    return _core.region_info(_desc(descriptor))


class Region:
    """A region registered with an agent. ``descriptor`` (bytes) is what peers
    address it by; ``view`` is the memory of a host region (None for device memory);
    ``kind`` is "user", "shm" or "device"."""

    def __init__(self, agent: "Agent", descriptor: bytes, keepalive=None):
        self._agent = agent
        self.descriptor = descriptor
        self._keepalive = keepalive
        info = _core.region_info(descriptor)
        self.index: int = info["index"]
        self.size: int = info["size"]
        self.kind: str = info["kind"]

    @property
    def view(self) -> Optional[memoryview]:
        return self._agent._core.region_view(self.descriptor)

    def deregister(self, timeout: Optional[float] = None) -> None:
        self._agent.deregister(self, timeout)

    def __bytes__(self) -> bytes:
        return self.descriptor

    def __repr__(self) -> str:
        return f"Region(agent={self._agent.name!r}, index={self.index}, size={self.size}, kind={self.kind})"


MAX_NOTIFICATION_BYTES = _core.AGENT_MAX_NOTIFICATION_BYTES  # 64 MiB (docs/agent.md, "Sizes")


class _Completion:
    """What a core handle offers: ``done()`` polls, ``wait(timeout)`` raises its error."""

    __slots__ = ("_core",)

    def __init__(self, core):
        self._core = core

    def done(self) -> bool:
        return self._core.done()

    def wait(self, timeout: Optional[float] = None) -> None:
        self._core.wait(call_timeout(timeout, "wait: timeout"))


# The completion of one write/read call, as the core returns it (no wrapper: a blocking
# connector pays for each object on every call). ``done()`` polls; ``wait(timeout)`` raises the
# call's error (PeerLost naming the peer, InvalidArgument when the target refused, MeshTimeout);
# ``call`` names the call ("write of 3 transfer(s) to agent b"); ``ops`` and ``nbytes``: its ops
# and the bytes they move (known at issue: no table to sum afterwards).
Handle = _core.AgentHandle


class NotificationWait(_Completion):
    """A stream wait on a notification (``Agent.stream_wait_notification``).
    ``done()``: released (the stream goes on), by its notification or by a
    failure; ``wait(timeout)`` waits on the host until then (0: until it is
    released, which its own timeout bounds) and raises the failure:
    ``MeshTimeout`` when the notification did not arrive in time, ``PeerLost``
    naming the peer when it went first, ``MeshClosed`` when the agent closed.
    ``error``: that failure's message ("" while pending or once matched);
    ``sender``: the peer whose notification released it."""

    __slots__ = ()

    @property
    def error(self) -> str:
        return self._core.error

    @property
    def sender(self) -> str:
        return self._core.sender

    def __repr__(self) -> str:
        state = "pending" if not self.done() else (f"failed: {self.error}" if self.error else f"from {self.sender}")
        return f"NotificationWait({state})"


class Notification(tuple):
    """(peer name, peer incarnation, bytes)."""

    __slots__ = ()

    def __new__(cls, peer: str, incarnation: str, data: bytes):
        return super().__new__(cls, (peer, incarnation, data))

    peer = property(lambda self: self[0])
    incarnation = property(lambda self: self[1])
    data = property(lambda self: self[2])

    def __repr__(self) -> str:
        return f"Notification(peer={self[0]!r}, incarnation={self[1]!r}, data={self[2]!r})"


Op = Sequence  # (local, local_offset, remote, remote_offset, size)


class AgentConnection:
    """An authenticated connection to one peer agent (either side may transfer)."""

    def __init__(self, core):
        self._core = core

    def __repr__(self) -> str:
        return f"AgentConnection(peer={self.peer_name!r}, incarnation={self.peer_incarnation})"

    @property
    def peer_name(self) -> str:
        return self._core.peer_name

    @property
    def peer_incarnation(self) -> str:
        return self._core.peer_incarnation

    @property
    def tcp_lanes(self) -> int:
        """The TCP connections this connection is made of: the smaller
        ``FLAGCX_MESH_TCP_LANES`` of the two agents (each side's default fits its
        cores). Writes of 1 MiB or more over tcp to host memory are striped over them."""
        return self._core.tcp_lanes

    # write / read and their _sync forms: each argument is checked in the core's call (an
    # InvalidArgument naming it), so that a blocking connector pays one Python frame per call.
    def write(self, local: Desc, remote: Desc, size: int, local_offset: int = 0, remote_offset: int = 0,
              notification: Optional[bytes] = None, stream=None) -> Handle:
        """Copies ``size`` bytes of ``local`` (at ``local_offset``) into the peer's
        ``remote`` region (at ``remote_offset``). ``stream`` (a torch.cuda.Stream,
        a handle, 0: the legacy default stream): the copy starts after the work
        queued on it so far."""
        return self._core.transfer_one(local, remote, size, local_offset, remote_offset, False, notification,
                                       _stream(stream))

    def read(self, local: Desc, remote: Desc, size: int, local_offset: int = 0, remote_offset: int = 0,
             notification: Optional[bytes] = None, stream=None) -> Handle:
        """Copies ``size`` bytes of the peer's ``remote`` region into ``local``."""
        return self._core.transfer_one(local, remote, size, local_offset, remote_offset, True, notification,
                                       _stream(stream))

    def write_sync(self, local: Desc, remote: Desc, size: int, local_offset: int = 0, remote_offset: int = 0,
                   notification: Optional[bytes] = None, stream=None, timeout: Optional[float] = None) -> None:
        """``write(...).wait(timeout)`` in one call, without a handle: returns once the bytes
        landed (and the notification was sent); raises what ``wait`` would. ``timeout``
        0 or None: the agent's."""
        self._core.transfer_one_sync(local, remote, size, local_offset, remote_offset, False, notification,
                                     _stream(stream), call_timeout(timeout, "write_sync: timeout"))

    def read_sync(self, local: Desc, remote: Desc, size: int, local_offset: int = 0, remote_offset: int = 0,
                  notification: Optional[bytes] = None, stream=None, timeout: Optional[float] = None) -> None:
        """``read(...).wait(timeout)`` in one call, without a handle."""
        self._core.transfer_one_sync(local, remote, size, local_offset, remote_offset, True, notification,
                                     _stream(stream), call_timeout(timeout, "read_sync: timeout"))

    def batch_write(self, ops: Iterable[Op], notification: Optional[bytes] = None, stream=None) -> Handle:
        """Every op (local, local_offset, remote, remote_offset, size) is checked
        before any byte moves; the notification follows the data."""
        return self._core.transfer(_op_list(ops), False, notification, _cuda.stream_handle(stream))

    def batch_read(self, ops: Iterable[Op], notification: Optional[bytes] = None, stream=None) -> Handle:
        return self._core.transfer(_op_list(ops), True, notification, _cuda.stream_handle(stream))

    def write_blocks(self, local, remote, table, notification: Optional[bytes] = None, stream=None) -> Handle:
        """Many ops in one call, as a table rather than a list of tuples: the KV blocks of a request.

        ``table`` is an (n, 5) array of 64-bit integers (numpy, a CPU torch tensor, anything with
        the buffer protocol), one op a row: (local_index, local_offset, remote_index,
        remote_offset, size), the indices naming entries of ``local`` and ``remote`` (sequences of
        Regions or descriptors); or an (n, 3) array (local_offset, remote_offset, size) when
        ``local`` and ``remote`` are one region each. The table is read in C++, no Python object
        per op; every op is checked before any byte moves, and errors name the row as ``op N``.
        What follows is ``batch_write``'s: one submission per path, the notification after the data."""
        return self._core.transfer_table(local, remote, _table(table), False, notification,
                                         _stream(stream))

    def read_blocks(self, local, remote, table, notification: Optional[bytes] = None, stream=None) -> Handle:
        """``write_blocks``' reads: each row's bytes of ``remote`` land in ``local``."""
        return self._core.transfer_table(local, remote, _table(table), True, notification,
                                         _stream(stream))

    def notify(self, data: bytes) -> None:
        """A notification alone, after the transfers already issued on this connection."""
        self._core.notify(data)

    def path_to(self, remote: Desc, local: Optional[Desc] = None) -> str:
        """The path transfers to ``remote`` take from ``local`` (default: from host
        memory): self, shm, cma, ucx or tcp; with device memory on either side cuda-self,
        cuda-vmm, cuda-ipc or staged. Chosen on first use; why a better one was not
        taken is logged (FLAGCX_MESH_LOG=info)."""
        return self._core.path_to(_desc(remote), None if local is None else _desc(local))

    def gone(self) -> str:
        """"" while usable, else why not."""
        return self._core.gone()

    def close(self) -> None:
        self._core.close()


class Agent:
    """One process's endpoint for dynamic peers.

    ``name``: how peers know it (1..200 bytes). ``secret``: what every peer must
    prove (default: ``FLAGCX_MESH_AGENT_SECRET``). ``timeout``: connect deadline
    and default wait (default ``FLAGCX_MESH_TIMEOUT``). ``allow``: names admitted
    (default: any agent that proves the secret).
    """

    def __init__(self, name: str, secret: Union[str, bytes, None] = None, *, timeout: Optional[float] = None,
                 header_timeout: float = 5.0, allow: Optional[Iterable[str]] = None):
        if isinstance(secret, bytes):
            secret = secret.decode("latin-1")
        self._core = _core.AgentCore(name, secret or "", call_timeout(timeout, "Agent: timeout"),
                                     call_timeout(header_timeout, "Agent: header_timeout") or 5.0,
                                     None if allow is None else set(allow))
        self._regions: dict[int, Region] = {}

    name = property(lambda self: self._core.name)

    incarnation = property(lambda self: self._core.incarnation)
    address = property(lambda self: self._core.address)

    def metadata(self) -> bytes:
        """Bytes a peer passes to ``connect``."""
        return self._core.metadata()

    def register(self, buffer) -> Region:
        """Registers a writable, contiguous buffer: host memory (numpy, bytearray,
        torch CPU tensor, anything with the buffer protocol) or CUDA memory (a torch
        CUDA tensor, anything with ``__cuda_array_interface__`` or DLPack on a CUDA
        device), as ``Mesh.register_window`` takes them. It must stay alive and
        unmoved until deregistered. No peer is involved."""
        what = f"agent {self.name}: register"
        try:
            dev = _cuda.device_buffer(buffer, what)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        if dev is not None:
            r = Region(self, self._core.register_device(dev.ptr, dev.nbytes), keepalive=(None, dev.keepalive))
            self._regions[r.index] = r
            return r
        view = _byte_view(buffer, what)
        r = Region(self, self._core.register(view), keepalive=(view, buffer))
        self._regions[r.index] = r
        return r

    def alloc(self, nbytes: int) -> Region:
        """Allocates zero-filled shared memory (local peers reach it over shm)."""
        r = Region(self, self._core.alloc(int(nbytes)))
        self._regions[r.index] = r
        return r

    def deregister(self, region: Desc, timeout: Optional[float] = None) -> None:
        """Waits for this agent's transfers in flight (MeshTimeout: the region stays
        registered), then closes the region: peers' later transfers to it are refused.
        A peer's transfer still landing in it (or reading it) is waited for until the
        timeout, then cut off: MeshTimeout says so, and the region is closed all the
        same (nothing lands in it any more; it may hold part of what was landing).
        See docs/agent.md, "Deregistering"."""
        d = _desc(region)
        self._core.deregister(d, call_timeout(timeout, "deregister: timeout"))
        self._regions.pop(_core.region_info(d)["index"], None)

    def connect(self, peer: Union[bytes, str], timeout: Optional[float] = None) -> AgentConnection:
        """Connects to the agent whose ``metadata()`` this is, or to "host:port"."""
        seconds = call_timeout(timeout, "connect: timeout")
        if isinstance(peer, str):
            return AgentConnection(self._core.connect_address(peer, seconds))
        return AgentConnection(self._core.connect(bytes(peer), seconds))

    def connection(self, name: str) -> Optional[AgentConnection]:
        """The open connection to agent ``name`` (either direction), or None."""
        c = self._core.connection(name)
        return None if c is None else AgentConnection(c)

    def peers(self) -> list:
        """(name, incarnation, address) of every open connection."""
        return self._core.peers()

    def notifications(self, timeout: Optional[float] = None) -> list:
        """Notifications that arrived, waiting up to ``timeout`` for the first."""
        return [Notification(*n) for n in self._core.notifications(call_timeout(timeout, "notifications: timeout"))]

    def await_notifications(self, timeout: Optional[float] = None) -> bool:
        """Waits up to ``timeout`` seconds (None or 0: not at all) until ``notifications()`` has
        something to return, taking nothing: True once it has; False at the deadline or when
        ``wake_notifications()`` woke it. For a thread that waits and then takes what arrived under
        a lock of its own (another thread may take it first)."""
        return self._core.await_notifications(call_timeout(timeout, "await_notifications: timeout"))

    def wake_notifications(self) -> None:
        """Makes a ``notifications()`` call waiting in another thread return now (with what
        arrived, maybe nothing); with none waiting, the next call returns at once (wakes do not
        add up). For a thread that waits on notifications and also takes work from others.
        After ``close()`` it does nothing."""
        self._core.wake_notifications()

    def stream_wait_notification(self, data: bytes, stream, peer: Optional[str] = None,
                                 timeout: Optional[float] = None) -> NotificationWait:
        """Queues on ``stream`` (a torch.cuda.Stream, a stream handle, 0: the legacy
        default stream) a wait: the stream's later work runs once a notification of
        exactly ``data`` arrived (from agent ``peer``, default: any). It consumes
        that notification (``notifications()`` does not return it); one that
        arrived and is unread releases it at once. It is released as well, the
        stream going on, after ``timeout`` (0: the agent's timeout), when ``peer``
        is gone, or when the agent closes: the returned wait's ``wait()`` raises
        why. See docs/agent.md, "Stream waits on notifications"."""
        seconds = call_timeout(timeout, "stream_wait_notification: timeout")
        handle = _cuda.stream_handle(stream)
        if handle is None:
            raise InvalidArgument("stream_wait_notification needs a stream (0: the legacy default stream)")
        return NotificationWait(self._core.stream_wait_notification(data, handle, peer or "", seconds))

    def wait_notification(self, peer: str, timeout: Optional[float] = None,
                          data: Optional[bytes] = None) -> Notification:
        """Waits on the host for agent ``peer``'s notification of exactly ``data``
        (default: its next one, whatever its bytes) and returns it, consumed: other
        notifications stay for ``notifications()``; one already arrived and unread
        returns at once. Raises ``PeerLost`` naming ``peer`` when it is gone before
        sending it, ``MeshTimeout`` after ``timeout`` (None or 0: the agent's timeout; a
        number > 0; inf: no limit), ``MeshClosed`` when the agent closes. See docs/agent.md,
        "Waiting for a peer's notification"."""
        seconds = call_timeout(timeout, "wait_notification: timeout")
        return Notification(*self._core.wait_notification(peer, data, seconds))

    def stats(self) -> dict:
        """accepted, connected, accept_fd_exhausted, rejected (by reason) at the listener;
        get_answer_bytes_held and get_answer_bytes_peak: the memory answers to peers' reads
        hold; notification_drains: the times waits for notifications looked at the connections;
        waiter_reads: the socket reads waiting threads made themselves; progress_late_wakes: the
        connections' progress threads' lost wake-ups (0 expected) (docs/agent.md)."""
        return self._core.stats()

    def close(self) -> None:
        self._core.close()
        self._regions.clear()

    @property
    def closed(self) -> bool:
        return self._core.closed

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if self.closed else ""
        return f"Agent(name={self.name!r}, incarnation={self.incarnation}, address={self.address}{state})"
