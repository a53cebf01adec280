"""The transfer part of the vLLM connector: KV blocks pushed from a prefill into a decode's
registered KV cache over one :class:`flagcx_mesh.Agent` per worker. No vLLM import: it runs
with torch tensors alone (CPU; CUDA once the agent registers device memory).

One :class:`KVTransfer` per worker (per tensor-parallel rank) registers every layer's KV cache
once and serves both roles:

- prefill: :meth:`hold` a finished request's blocks; a decode that asks for them (a ``W``
  message, protocol.py) gets them pushed into its blocks, one batched write per layer, the
  last one carrying the ``D`` notification. hold() offers the blocks to the core at once: a
  want in its binary form (``w``, on a connection whose decode layout the core has tables for)
  is served by the core's puller thread (agent/block_pull.h, want_server.h) with no Python thread
  on the way, which posts the push's start and end for the transfer thread to count and watch;
  one the core cannot serve comes to the transfer thread as a ``W``, which hands it back to the
  core once it can serve it (a ``W`` in the binary form made here; the thread pushes only what the
  core hands back twice, or ids too long for that form). The blocks are released (reported in
  ``poll().sending``) when the decode acknowledges them, when it cancels, or after
  ``hold_timeout`` when no decode came. A push that fails (the decode died) keeps the blocks
  held, so a decode that restarts and asks again is served. A push that has not completed
  by its deadline (``push_timeout`` after it started, and never later than the request's
  ``hold_timeout``: a decode that stopped, its kernel keeping the connection open) is
  abandoned: the connection to that decode is closed, which stops its engine, so no byte of
  the source blocks is read for it any more, and only then are the blocks released.
- decode: :meth:`fetch` connects to the prefill's agent (its metadata came in the request's
  ``kv_transfer_params``), sends its layout once per connection and a ``W`` naming its own
  block ids, and reports the request in ``poll().recving`` when ``D`` arrives, or in
  ``poll().failed`` (with its block ids) when the prefill refused, died, or nothing came
  within ``fetch_timeout``. The ``D`` is awaited by the core (agent/block_pull.h): matched in the
  agent's inbox as it arrives, its ``A`` sent and the outcome posted for :meth:`poll`, with no
  Python thread on the way (an ``F``, or the ``D`` of a prefill of before the nonce, comes to the
  transfer thread).

A decode may instead read the blocks itself (a pull: no ``W``, no ``D``, two hops and the
prefill's thread off the request's path), where all of these hold: the prefill's layout came on
this connection or an earlier one to the same prefill agent (a prefill answers a decode's layout
with its own, so from the second request on), the path between the two KV caches moves the bytes on this host (cuda-ipc,
cuda-vmm, cuda-self, cma, shm, self, between every pair of the two workers' regions: no read
waits on a network), the request's hold is known to last (``hold_until``, the prefill's wall
clock, which the caller vouches for, more than ``pull_margin`` seconds ahead), and this decode
did not read that prefill's request before. The read is the core's (agent/block_pull.h): its
thread makes the ops from the block ids, reads, sends the ``A`` (carrying ``readers``) once the
bytes landed, or a ``C`` when the read failed, and posts the outcome, which :meth:`poll` reports
(a failed read once no byte of it can land any more). The prefill releases the blocks on the
``A`` as after a push. Anything else is pushed as before.

From the second fetch from a prefill on (its connection known, no command waiting for the
thread), :meth:`fetch` does the fetch itself: it hands a pull's read to the core, so no step of a
pull waits for the interpreter lock that a busy engine thread holds, or sends a push's ``W``.
Every other agent call runs on one background thread; the public methods only queue commands
(or do what is said above) and drain results, so the engine's step never waits on the network.
Where that thread has not finished a step for ``ASSIST_AFTER`` seconds and is not in one,
:meth:`poll` does part of one itself: it runs the queued holds and handles what arrived
(notifications, the core's events of served pushes), as the thread would (the rare push the thread
starts itself is then issued, and on a host path copied, on the caller's thread).
A busy engine thread that gives the interpreter lock up for a moment at each call into C (torch's
calls, I/O) and takes it straight back can keep the transfer thread from the lock for seconds; the
engine's own poll() in each step then answers a decode's layout and first want, and releases the
blocks a decode acknowledged, in that step. The other commands and the deadlines stay the
thread's; its connects (which may wait on the network) are made before its step takes its lock,
so poll() may do the step's part meanwhile.
The thread takes any bytes a peer sends: a notification that is not a well-formed message is
counted (``stats()``), logged (at most one line per ``LOG_EVERY`` seconds for each kind of
trouble) and ignored, and the other notifications of its batch are handled as if it had not come.
"""

from __future__ import annotations

import array
import atexit
import itertools
import logging
import queue
import threading
import time
import traceback
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

from .. import _core
from ..agent import Agent
from ..errors import InvalidArgument, MeshError
from . import protocol
from .groups import Groups, as_groups, flat, split
from .layout import WHOLE, LayerGeometry, LayoutError, RowPlan, block_id_tensor, check_part, describe_layers

log = logging.getLogger("vllm.flagcx_mesh")  # under vLLM's logger: its lines show in `vllm serve`

FORGET_AFTER = 4096  # how many served / expired request ids a prefill remembers
MAX_EARLY = 4096     # wants awaiting their hold at once (more are refused)
LOG_EVERY = 10.0     # seconds between two log lines of one kind of peer trouble
ANSWER_SLACK = 30.0  # seconds the core awaits a push's D past fetch_timeout (the thread fails it at that)
EARLY = " before its hold"  # a request released before this worker's hold of it came (_on_release)
STATS = (  # KVTransfer.stats()
    "bad_messages",           # notifications ignored: not a well-formed message, or one that failed
    "unexpected_answers",     # D / F for a request not awaited from that peer (late, or made up)
    "refused",                # F sent: unknown or released request, layout mismatch, bad block ids
    "pushes",                 # pushes issued
    "pushes_served",          # of those, pushes the core served (their want taken with no Python thread)
    "pushes_done",            # pushes completed
    "pushes_failed",          # pushes that failed (the decode died or refused)
    "pushes_abandoned",       # pushes past their deadline, abandoned with their connection
    "connections_abandoned",  # connections closed for them
    "bytes_pushed",           # bytes of the pushes issued
    "push_seconds",           # seconds the completed pushes took, summed
    "released_served", "released_cancelled", "released_expired", "released_abandoned",
    "fetches_done",           # decode: fetches whose blocks landed
    "fetch_seconds",          # decode: seconds those took (asked to done), summed
    "fetches_failed",         # decode: fetches reported as failed (load errors)
    "pulls",                  # decode: fetches read by the decode itself (no push asked for)
    "bytes_pulled",           # decode: bytes of those reads
)
SERVED_STARTED, SERVED_ENDED, SERVED_LATE = (  # the kinds of the core's served-push events (_on_served)
    _core._BlockPuller.SERVED_STARTED, _core._BlockPuller.SERVED_ENDED, _core._BlockPuller.SERVED_LATE)
ASSIST_AFTER = 0.01  # seconds since the thread's last step after which poll() does its part (_assist)
ASSIST_WAIT = 0.0005  # seconds poll() waits for a step of the thread under way before it does its part (_assist)
PULL_PATHS = frozenset(("cuda-ipc", "cuda-vmm", "cuda-self", "cma", "shm", "self"))  # a read of them waits on no network


class _Throttled:
    """A warning at most once per ``every`` seconds; the lines it held back are counted in
    the next one."""

    def __init__(self, every: float = LOG_EVERY):
        self.every, self.next_at, self.held_back = every, 0.0, 0

    def warn(self, fmt: str, *args) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.held_back += 1
            return
        if self.held_back:
            fmt += " (and %d more like it in the last %.0f s)"
            args = args + (self.held_back, self.every)
        self.next_at, self.held_back = now + self.every, 0
        log.warning(fmt, *args)


@dataclass
class Finished:
    """What completed since the last poll: requests whose blocks a prefill released
    (``sending``), requests a decode finished receiving, successfully or not (``recving``),
    and of those the ones that failed, with their local block ids (``failed``)."""

    sending: Set[str] = field(default_factory=set)
    recving: Set[str] = field(default_factory=set)
    failed: Dict[str, List[int]] = field(default_factory=dict)


@dataclass
class _Closing:
    """A connection being closed on a thread of its own (a stalled peer makes the close wait
    for its engine, up to about 2 s); ``done`` once it returned: its engine is stopped."""

    peer: str
    done: threading.Event
    thread: Optional[threading.Thread] = None


@dataclass
class _Push:
    peer: str
    tag: str
    handles: list
    started: float
    conn: object = None
    deadline: float = float("inf")
    closing: Optional[_Closing] = None  # abandoned: its connection is being closed
    failed: bool = False  # counted in pushes_failed already


class _Served:
    """A push the core serves (its want taken by the core, csrc/agent/block_pull.h), as a push's
    handle: over once the core posted its end (_on_served)."""

    def __init__(self, push: int):
        self.push, self.over, self.error = push, False, ""

    def done(self) -> bool:
        return self.over

    def wait(self, timeout: float = 0.0) -> None:
        if self.error:
            raise MeshError(self.error)


@dataclass
class _Held:
    blocks: Groups  # per KV cache group (groups.py)
    deadline: float
    ids: object = None  # the blocks as an int64 tensor per group, made at hold time (the source half of each push)
    pushes: List[_Push] = field(default_factory=list)
    release_when_idle: str = ""  # why, once the pushes in flight are over
    abandoned_peer: str = ""
    parts: int = 1  # decode ranks that read these blocks (another TP size there, or replicated heads)
    acked: Set[str] = field(default_factory=set)  # the decode agents that acknowledged theirs
    offers: List[int] = field(default_factory=list)  # its tokens at the puller, which serves its wants (the
    # last one offered now; earlier ones of the same request id held again, whose pushes may still run)


@dataclass
class _Fetch:
    tag: str
    peer_metadata: bytes
    remote_req: str
    src: Groups  # per KV cache group (groups.py)
    dst: Groups
    deadline: float
    conn: object = None
    peer: str = ""
    cancelled: bool = False
    started: float = 0.0
    part: Tuple[int, ...] = WHOLE
    readers: int = 0
    hold_until: float = 0.0  # the prefill's wall clock: its hold lasts until then (0: not known)
    reading: bool = False  # a pull's read is in flight: only its outcome reports the fetch (_take_pulls)
    token: int = 0  # at the puller: the pull's read, or the push's D awaited (0: none)
    nonce: int = 0  # its want's ``n``, which the prefill's answer echoes (_on_answer)
    over: bool = False  # reported (_forget): a second report of it is dropped


def _incarnation(conn) -> str:
    try:
        return conn.peer_incarnation
    except Exception:  # noqa: BLE001
        return ""


def _same_connection(a, b) -> bool:
    if a is b:
        return True
    try:
        return a is not None and b is not None and a.peer_incarnation == b.peer_incarnation
    except Exception:  # noqa: BLE001
        return False


def _answer_to(want: dict) -> dict:
    """The fields that name a want in its answer (D / F): its tag, and its nonce where it carried
    one (a decode of before the nonce sends none)."""
    named = {"tag": str(want.get("tag", ""))}
    if "n" in want:
        named["n"] = want["n"]
    return named


def _remember(seen: "OrderedDict", key, value) -> None:
    """Keeps key -> value in ``seen``, the oldest forgotten past FORGET_AFTER entries."""
    seen[key] = value
    while len(seen) > FORGET_AFTER:
        seen.popitem(last=False)


def _close_at_exit(ref) -> None:
    """An engine that exits without shutting its connector down must not leave the thread
    inside the agent while the interpreter finalizes."""
    x = ref()
    if x is not None:
        x.close()


class KVTransfer:
    """See the module's docstring. ``kv_caches``: ``{layer name: tensor}`` with blocks on
    ``block_dim``; ``num_blocks``: blocks per layer; ``name``: this worker's agent name;
    ``secret``: what both ends prove (default ``FLAGCX_MESH_AGENT_SECRET``); ``push_timeout``:
    seconds a push may take before it is abandoned (a push is abandoned at its request's hold
    deadline in any case). ``layer_groups``: each layer's KV cache group (``{layer name: index}``;
    default: one group), whose block ids that layer's blocks take (groups.py). ``pull``: whether a
    decode reads blocks itself where it can (see the module; ``pull_margin``: seconds of a hold
    that must be left for that)."""

    def __init__(self, name: str, kv_caches: dict, num_blocks: int, *, secret=None, block_dim: int = 0,
                 hold_timeout: float = 120.0, fetch_timeout: float = 120.0, connect_timeout: float = 10.0,
                 push_timeout: float = 60.0, poll_interval: float = 0.005, layer_groups: Optional[dict] = None,
                 pull: bool = True, pull_margin: float = 10.0):
        storages, self.layers = describe_layers(kv_caches, num_blocks, block_dim)
        self.layer_group = [int((layer_groups or {}).get(g.name, 0)) for g in self.layers]
        self.num_blocks = num_blocks
        self.hold_timeout, self.fetch_timeout = float(hold_timeout), float(fetch_timeout)
        self.push_timeout = float(push_timeout)
        self.pull, self.pull_margin = bool(pull), float(pull_margin)
        self.connect_timeout, self._interval = float(connect_timeout), float(poll_interval)
        self.agent = Agent(name, secret, timeout=connect_timeout)
        try:
            self._storages = storages
            self._regions = [self.agent.register(s) for s in storages]
        except BaseException:
            self.agent.close()
            raise
        self.name = self.agent.name
        self.metadata: bytes = self.agent.metadata()
        self._layout_msg = protocol.encode(
            "L", regions=[protocol.b64(r.descriptor) for r in self._regions],
            layers=[g.to_wire() for g in self.layers], w=1)
        self._commands: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._holds: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()  # hold commands (poll() may run them: _assist)
        self._step_lock = threading.Lock()  # one step at a time: the thread's, or poll()'s part of it (_assist)
        self._stepped = time.monotonic()  # when the thread last finished a step (_assist)
        self._connecting = False  # the thread's step waits on a connect: poll() does not wait for it (_assist)
        self._ahead: Dict[bytes, object] = {}  # connects made before the step: a connection or its MeshError
        self._lock = threading.RLock()  # (re-entrant: a close() from a handler run while it is held)
        self._done = Finished()
        self._stats = dict.fromkeys(STATS, 0)
        self._warn_bad, self._warn_refused, self._warn_odd = _Throttled(), _Throttled(), _Throttled()
        self._warn_internal = _Throttled()
        # prefill side
        self._held: Dict[str, _Held] = {}
        self._early: Dict[str, List[Tuple[str, dict, float]]] = {}
        self._gone: "OrderedDict[str, str]" = OrderedDict()
        # connections being abandoned, by (peer, incarnation), and the wants that came meanwhile
        self._closing: Dict[Tuple[str, str], _Closing] = {}
        self._after_close: Dict[Tuple[str, str], List[Tuple[str, dict, str]]] = {}
        self._peer_layouts: Dict[Tuple[str, str], Tuple[List[bytes], Dict[str, LayerGeometry]]] = {}
        self._plans: Dict[Tuple[str, str], Dict[tuple, RowPlan]] = {}  # per peer layout: its row plans by part
        self._early_acks: Dict[str, Tuple[Set[str], int, float]] = {}  # acks of requests not held yet (pulled first)
        self._offered: Dict[int, str] = {}  # the requests the puller serves wants of, by their offer's token
        self._handed: "OrderedDict[Tuple[str, str, int], None]" = OrderedDict()  # wants the thread gave the core (_to_core)
        self._holds_run = 0  # the highest offer token whose hold command ran (tokens grow: hold(), one caller thread)
        self._ended_idle: Set[str] = set()  # held requests whose last push may have ended (_take_served)
        self._served_later: List[tuple] = []  # the core's events taken early (_forget_offers), for _take_served
        self._takes_w: Set[Tuple[str, str]] = set()  # peer layouts that said they take binary wants (w)
        # decode side
        self._fetches: Dict[str, _Fetch] = {}  # by tag: the one fetch of each that is out
        self._waiting: Dict[str, List[_Fetch]] = {}  # fetches of a tag whose earlier fetch is still out
        self._fetch_lock = threading.Lock()  # every change of both, of _pulled and _pulling (fetch() and poll() too)
        self._layout_sent: Dict[Tuple[str, str], object] = {}  # the connection each peer got it on
        self._pull_path: Dict[Tuple[str, str], bool] = {}  # per prefill layout: whether its path suits a pull
        self._pulled: "OrderedDict[Tuple[str, str], None]" = OrderedDict()  # (prefill, its request) read once
        # pulls: read, acked (or released) and posted by the core's thread (agent/block_pull.h), reported
        # by poll(); its wait is poll(timeout)'s, woken by _finish too
        self._puller = _core._BlockPuller(self.agent._core)
        self._puller.serve_wants(True)  # (wants of what hold() offered: served by the core, _on_served)
        self._pulling: Dict[int, _Fetch] = {}  # the fetches the puller has (reads, pushes' D awaited), by token
        self._tokens = itertools.count(1)
        self._nonces = itertools.count()  # one per fetch: its want's ``n`` (protocol.py)
        self._conn_of: Dict[bytes, object] = {}  # the connection a fetch made, by the prefill's metadata
        self._queued = 0  # commands but holds not done yet: fetch() does a fetch itself only when none is (_fetch_now)
        self._next_prune = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-transfer-{name}", daemon=True)
        self._thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    # ---- the public side: commands in, results out -------------------------------------

    def hold(self, req_id: str, block_ids: Sequence) -> None:
        """Prefill: keep ``req_id``'s blocks (a list, or one per KV cache group: groups.py) for a
        decode until it took them, cancelled, or ``hold_timeout`` passed; the request then appears
        in ``poll().sending``. The blocks are offered to the core at once: from then on it serves
        a decode's want of them itself (a binary ``w`` on a connection whose layout it has), with
        no step on the transfer thread."""
        req, groups = str(req_id), as_groups(block_ids)
        token = next(self._tokens)
        try:  # (before the hold is queued: the hold's withdraw, for a request gone already, comes after it)
            self._puller.offer(token, req, [array.array("q", g) for g in groups], self._served_timeout())
        except Exception:  # noqa: BLE001 - (ids that are no integers, closed): its wants go to the thread
            pass
        self._command("hold", req, groups, token)

    def _served_timeout(self) -> float:
        """Seconds a push the core serves may take before it is reported late (then abandoned)."""
        return min(self.push_timeout, self.hold_timeout)

    def fetch(self, req_id: str, peer_metadata: bytes, remote_req_id: str, remote_block_ids: Sequence,
              local_block_ids: Sequence, part: Sequence[int] = WHOLE, readers: int = 0,
              hold_until: float = 0.0) -> None:
        """Decode: ask the prefill agent ``peer_metadata`` to push its request
        ``remote_req_id`` into ``local_block_ids`` (the last ``len(local_block_ids)`` of
        ``remote_block_ids``: blocks this decode already had from its prefix cache are not
        sent); ``req_id`` then appears in ``poll().recving`` (and ``failed`` on failure). ``part``
        (another tensor-parallel size on the prefill): ``(si, sn, di, dn)``, slice ``si`` of ``sn``
        of the prefill's blocks into slice ``di`` of ``dn`` of these (layout.write_ops); ``readers``:
        how many decode ranks read from that prefill rank (heads.readers; 0: ``sn``). Block ids: a
        list, or one per KV cache group (groups.py), the same number of groups on both sides.
        ``hold_until``: the prefill's wall clock (``time.time()``) until which it holds the blocks
        at least (its ``kv_transfer_params``); where it is more than ``pull_margin`` seconds ahead
        this decode may read them itself (see the module); 0: unknown, they are pushed. A ``req_id``
        whose earlier fetch is still under way (cancelled: its blocks may still land) is fetched once
        that one was reported; each is reported on its own."""
        local, remote = as_groups(local_block_ids), as_groups(remote_block_ids)
        args = (str(req_id), bytes(peer_metadata), str(remote_req_id), remote, local,
                check_part(tuple(int(v) for v in part)), int(readers), float(hold_until))
        if not self._fetch_now(*args):
            self._command("fetch", *args)

    def cancel(self, req_id: str) -> None:
        """Decode: the request was aborted. The prefill is told to release its blocks; the
        request is still reported in ``recving`` once no byte can land in its blocks any more
        (a fetch of it that waits for an earlier one, see :meth:`fetch`: at once)."""
        self._command("cancel", str(req_id))

    def release(self, peer_metadata: bytes, remote_req_id: str) -> None:
        """Decode: a request that will never be fetched (aborted before its blocks were
        allocated); the prefill releases its blocks now instead of at its timeout."""
        self._command("release", bytes(peer_metadata), str(remote_req_id))

    def _command(self, *cmd) -> None:
        """Queues a command for the thread and wakes it (it takes it now, not at its next poll).
        A hold goes to a queue of its own, which poll() runs too (_assist)."""
        if cmd[0] == "hold":
            self._holds.put(cmd)
        else:
            with self._lock:
                self._queued += 1
            self._commands.put(cmd)
        self.agent.wake_notifications()

    def poll(self, timeout: float = 0.0) -> Finished:
        """What completed since the last poll (see :class:`Finished`). ``timeout``: seconds to
        wait, when nothing completed yet, for the first request that does (0: return at once);
        a waiting caller is woken by the completion itself, not by a timer."""
        timeout = timeout if timeout > 0 else 0.0  # (NaN: 0)
        end = time.monotonic() + timeout
        self._assist()
        while True:
            seen = self._puller.seq()
            self._take_pulls()
            with self._lock:
                left = end - time.monotonic()
                if self._has_done() or left <= 0 or self._stop.is_set():
                    out, self._done = self._done, Finished()
                    return out
            self._puller.wait(seen, left)  # (the GIL released) until a pull's outcome, a _finish, or the end

    def _has_done(self) -> bool:  # (self._lock held)
        return bool(self._done.sending or self._done.recving)

    def busy(self) -> bool:
        """Whether blocks are held or fetches are under way (the engine should keep stepping)."""
        return bool(self._held or self._fetches or self._waiting or self._closing or self._queued
                    or not self._commands.empty()
                    or not self._holds.empty())

    def stats(self) -> Dict[str, int]:
        """Counters since the start (see ``STATS``)."""
        with self._lock:
            return dict(self._stats)

    def alive(self) -> bool:
        """Whether the transfer thread runs (it ends only at close)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stops the thread and closes the agent (peers' pending handles fail with PeerLost)."""
        self._stop.set()
        self._puller.wake()  # a poll(timeout) in another thread returns now
        if not self.agent.closed:
            self.agent.wake_notifications()  # out of its wait now
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._puller.close()  # (reads in flight are not waited for: a poll() after this reports them failed)
        for c in list(self._closing.values()):  # connections abandoned: their engines stop first
            if c.thread is not None and c.thread is not threading.current_thread():
                c.thread.join(timeout=30)
        if not self.agent.closed:
            self.agent.close()

    # ---- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.agent.await_notifications(self._interval)  # (taking nothing: poll() may take it first)
                commands = self._take_commands()
                try:
                    self._connect_ahead(commands)
                except Exception:  # noqa: BLE001 - the commands taken must still run (the step connects)
                    log.exception("%s: connecting before the step failed", self.name)
                try:
                    with self._step_lock:
                        self._step(commands)
                        self._stepped = time.monotonic()
                finally:
                    self._ahead.clear()  # (the step's: a later one connects again)
            except Exception:  # one bad event must not stop the transfers of every other request
                if self._stop.is_set():
                    break
                log.exception("%s: KV transfer step failed", self.name)
                time.sleep(self._interval)

    def _step(self, commands: Sequence[tuple] = ()) -> None:
        self._run_commands(commands)
        self._take_arrivals()
        now = time.monotonic()
        self._check_held(now)
        self._check_fetches(now)
        if now > self._next_prune:
            self._prune_layouts()
            self._next_prune = now + 1.0

    def _take_arrivals(self) -> None:
        """What arrived: the notifications, then the core's events of the pushes it serves."""
        notes = self.agent.notifications(timeout=0)
        self._take_served()  # (after the notifications: a served push's start precedes its decode's ack)
        for n in notes:
            try:  # each on its own: whatever one peer sent must not cost the others theirs
                self._on_notification(n.peer, n.incarnation, n.data)
            except Exception as e:  # noqa: BLE001
                self._bad_message(n.peer, f"{type(e).__name__}: {str(e)[:200]}")

    def _assist(self) -> None:
        """poll()'s part of the thread's step, on the caller's thread, where the thread is not in
        a step: the holds queued and what arrived (_take_arrivals). A busy engine thread that keeps
        taking the interpreter lock back (each torch call gives it up for a moment) can keep the
        transfer thread from it for seconds; the engine's own poll() then does that work. The other
        commands (a connect may wait on the network) and the deadlines stay the thread's. Only once
        the thread has not finished a step for ASSIST_AFTER seconds (a thread that keeps up does it
        all: a push's copy on a host path, a send to a peer that stopped reading, stay off the
        engine's thread); a step of the thread under way is then waited for up to ASSIST_WAIT (the
        wait gives the thread the lock), not at all while it connects."""
        if self._stop.is_set() or time.monotonic() - self._stepped < max(ASSIST_AFTER, 2 * self._interval):
            return  # (the thread keeps up: the pushes and sends stay off the engine's thread)
        if not self._step_lock.acquire(timeout=0 if self._connecting else ASSIST_WAIT):
            return
        try:
            self._run_commands()
            self._take_arrivals()
        except MeshError as e:  # (the agent closed meanwhile)
            log.debug("%s: poll()'s part of a step: %s", self.name, e)
        except Exception:  # noqa: BLE001 - never raised into the engine's step
            log.exception("%s: poll()'s part of a KV transfer step failed", self.name)
        finally:
            self._step_lock.release()

    def _take_commands(self) -> List[tuple]:
        """The commands queued but holds, taken before the step (_connect_ahead looks at them);
        still counted as queued until they ran (_run_commands)."""
        out = []
        while True:
            try:
                out.append(self._commands.get_nowait())
            except queue.Empty:
                return out

    def _run_commands(self, commands: Sequence[tuple] = ()) -> None:
        """The queued holds, then ``commands`` (_take_commands), each in its order."""
        while True:
            try:
                self._run_command(self._holds.get_nowait())
            except queue.Empty:
                break
        for cmd in commands:
            try:
                self._run_command(cmd)
            finally:
                with self._lock:
                    self._queued -= 1

    def _run_command(self, cmd: tuple) -> None:
        try:
            getattr(self, "_cmd_" + cmd[0])(*cmd[1:])
        except Exception:  # noqa: BLE001 - the next commands must still run
            log.exception("%s: the %s command failed", self.name, cmd[0])

    def _take_served(self) -> None:
        """Takes the core's events of the pushes it serves (_on_served). One of a request whose
        hold command has not run yet runs the queued holds first; one whose hold is not even
        queued yet (hold() offers the blocks, then queues it) is kept for the next take."""
        events, self._served_later = self._served_later + self._puller.take_served(), []
        if any(e[0] not in self._offered for e in events):
            self._served_later = events  # (what a hold released at once counts first: _forget_offers)
            self._run_commands()
            events = self._served_later
            self._served_later = [e for e in events if e[0] > self._holds_run]
            events = [e for e in events if e[0] <= self._holds_run]
        for event in events:
            try:
                self._on_served(*event)
            except Exception:  # noqa: BLE001 - the next events must still be taken
                self._warn_internal.warn("%s: a served push's event failed:\n%s", self.name, traceback.format_exc())
        ended, self._ended_idle = self._ended_idle, set()
        for req in ended:  # (after every event of the batch: none is dropped by a release in the loop)
            held = self._held.get(req)
            if held is not None and held.release_when_idle:
                try:
                    self._check_one_held(req, held, time.monotonic())
                except Exception:  # noqa: BLE001
                    self._warn_internal.warn("%s: releasing %s failed:\n%s", self.name, req, traceback.format_exc())

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _bad_message(self, peer: str, why: str) -> None:
        self._count("bad_messages")
        self._warn_bad.warn("%s: ignored a notification from %s: %s", self.name, peer, why)

    def _on_notification(self, peer: str, incarnation: str, data: bytes) -> None:
        try:
            kind, f = protocol.decode(data)
        except protocol.ProtocolViolation as e:
            return self._bad_message(peer, str(e))
        try:
            if kind == "L":
                self._on_layout(peer, incarnation, f)
            elif kind == "W":
                raw = data if data.startswith(_core.WANT_PREFIX) else None  # (a binary want the core handed back)
                self._on_want(peer, incarnation, f, time.monotonic(), raw)
            elif kind == "A":
                self._on_ack(peer, f["req"], f.get("readers", 1))
            elif kind == "C":
                self._on_release(f["req"], "cancelled")
            elif kind in "DF":
                self._on_answer(peer, f["tag"], kind == "D", str(f.get("why", "")), f.get("n"))
        except (KeyError, TypeError, ValueError) as e:
            self._bad_message(peer, f"a malformed {kind} message: {str(e)[:200]}")

    def _finish(self, *, sending: Optional[str] = None, recving: Optional[str] = None,
                failed: Optional[List[int]] = None) -> None:
        with self._lock:
            if sending is not None:
                self._done.sending.add(sending)
            if recving is not None:
                self._done.recving.add(recving)
                if failed is not None:
                    self._done.failed[recving] = list(failed)
        self._puller.wake()  # a poll(timeout) returns it now

    # ---- prefill side -------------------------------------------------------------------

    def _cmd_hold(self, req: str, blocks: Groups, offer: int = 0) -> None:
        if offer:
            self._offered[offer] = req
            self._holds_run = max(self._holds_run, offer)
        try:
            ids = [block_id_tensor(g, self.num_blocks, f"request {req}") for g in blocks]  # hold() made the groups
        except LayoutError:
            ids = None  # refused to whoever asks for them (_push_table says why)
        held = _Held(blocks, time.monotonic() + self.hold_timeout, ids, offers=[offer] if offer else [])
        before = self._held.get(req)
        if before is not None:  # held again: the pushes of the earlier hold still count (the core's too)
            held.pushes, held.offers = before.pushes, before.offers + held.offers
        if ids is None:
            self._withdraw(held)  # (its wants come to the thread, which refuses them)
        if req in self._gone:  # the decode cancelled (or read it) before the prefill's worker heard of it
            why = self._gone[req]
            if self._withdraw(held):  # a want the core served meanwhile: released once that push is over
                held.release_when_idle = why[:-len(EARLY)] if why.endswith(EARLY) else "served"
                self._held[req] = held
                return
            self._held[req] = held  # (while the core's events of its pushes, all over, are counted)
            self._forget_offers(held)
            del self._held[req]
            if why.endswith(EARLY):
                self._count("released_" + why[:-len(EARLY)])
            self._finish(sending=req)
            return
        self._held[req] = held
        acked, parts, _ = self._early_acks.pop(req, (set(), 0, 0.0))
        for peer, f, _ in self._early.pop(req, []):  # (pushed by the core where it can: _to_core)
            self._start_push(req, peer, f)
        for peer in acked:  # decodes that read it before it was held here
            self._on_ack(peer, req, parts)

    def _on_layout(self, peer: str, incarnation: str, f: dict) -> None:
        regions = [protocol.unb64(r) for r in f["regions"]]
        layers = {g.name: g for g in (LayerGeometry.from_wire(w) for w in f["layers"])}  # LayoutError: ignored
        for key in [k for k in self._peer_layouts if k[0] == peer]:  # an older incarnation's
            self._drop_layout(key)
        self._drop_layout((peer, incarnation))
        self._peer_layouts[(peer, incarnation)] = (regions, layers)
        if f.get("w"):
            self._takes_w.add((peer, incarnation))
        conn = self.agent.connection(peer)
        if conn is not None and conn.peer_incarnation == incarnation:
            self._tell_layout(conn)  # a decode's: answered with this worker's (it may then read)
            self._forget_tables(conn)  # (any its earlier layout on this connection made)
            self._serve_layout(conn, (peer, incarnation), WHOLE)
            if self.pull and any(c.peer_name == peer for c in self._conn_of.values()):  # a prefill's
                self._ready_pulls(conn, (peer, incarnation))

    def _drop_layout(self, key: Tuple[str, str]) -> None:
        """Forgets a peer layout and what was made of it (the core forgets its tables of a
        connection itself once the connection is gone)."""
        self._peer_layouts.pop(key, None)
        self._plans.pop(key, None)
        self._pull_path.pop(key, None)
        self._takes_w.discard(key)

    def _forget_tables(self, conn) -> None:
        """Has the core forget the tables it serves wants on ``conn`` with (their layout was
        replaced): the wants of parts not served again go to the thread."""
        try:
            self._puller.forget_layouts(conn._core)
        except Exception as e:  # noqa: BLE001 - (closed: nothing is served any more)
            log.debug("%s: %s", self.name, e)

    def _serve_layout(self, conn, key: Tuple[str, str], part, plans=None) -> None:
        """Has the core serve the wants of ``part`` that come on ``conn`` (a decode's, whose layout
        is ``key``'s): its row plans' tables, this worker's regions onto the decode's. A layout
        that does not fit is left to the thread (which refuses its wants, saying why)."""
        layout = self._peer_layouts.get(key)
        if layout is None:
            return
        try:
            if plans is None:
                plans = self._row_plans(key, layout, part, max(self.layer_group, default=0) + 1)
            self._puller.serve_layout(conn._core, tuple(part), self._regions, layout[0],
                                      [p.tables() if p is not None else [] for p in plans])
        except Exception as e:  # noqa: BLE001 - (a layout that does not fit, closed): the thread serves them
            log.debug("%s: wants of %s are served by the thread: %s", self.name, key[0], e)

    def _ready_pulls(self, conn, key: Tuple[str, str]) -> None:
        """Readies what a pull from this prefill takes (its path checked, the row plans of whole
        blocks made) as its layout comes, so that fetch() may start the next one itself."""
        layout = self._peer_layouts[key]
        if self._path_fits(key, conn, layout):
            try:
                self._row_plans(key, layout, WHOLE, max(self.layer_group, default=0) + 1)
            except LayoutError:  # (a fetch says so)
                pass

    def _tell_layout(self, conn) -> None:
        """Sends this worker's layout on ``conn`` unless it went there already (once a connection:
        a decode's precedes its first want, a prefill's answers it; never one for another)."""
        key = (conn.peer_name, conn.peer_incarnation)
        told = self._layout_sent.get(key)
        if told is not None and not told.gone():
            return
        conn.notify(self._layout_msg)
        self._layout_sent = {k: c for k, c in self._layout_sent.items() if k[0] != key[0]}
        self._layout_sent[key] = conn

    def _prune_layouts(self) -> None:
        """Forgets the layouts of decodes whose connection closed (they send it again), and the
        connections fetches made that are gone."""
        self._conn_of = {md: c for md, c in self._conn_of.items() if not c.gone()}
        for key in list(self._peer_layouts):
            conn = self.agent.connection(key[0])
            if conn is None or conn.peer_incarnation != key[1]:
                self._drop_layout(key)

    def _on_want(self, peer: str, incarnation: str, f: dict, now: float, raw: Optional[bytes] = None) -> None:
        """A decode's want (``raw``: its binary form, where it came so): pushed, refused, or kept
        until its hold comes (_cmd_hold)."""
        req = f["req"]
        if req in self._held:
            self._start_push(req, peer, f, incarnation, raw)
        elif req in self._gone:
            self._refuse_gone(peer, f, req)
        elif sum(len(w) for w in self._early.values()) >= MAX_EARLY:
            self._refuse(peer, f, f"request {req} is not known here, and {MAX_EARLY} others await their hold")
        else:  # the scheduler's word that it finished may come after the decode's request
            self._early.setdefault(req, []).append((peer, dict(f, _inc=incarnation, _raw=raw), now + self.hold_timeout))

    def _refuse(self, peer: str, f: dict, why: str) -> None:
        self._count("refused")
        self._warn_refused.warn("%s: cannot serve %s: %s", self.name, peer, why)
        conn = self.agent.connection(peer)
        if conn is not None:
            try:
                conn.notify(protocol.encode("F", **_answer_to(f), why=why[:2000]))
            except MeshError:
                pass

    def _refuse_gone(self, peer: str, f: dict, req: str) -> None:
        self._refuse(peer, f, f"request {req} is no longer held here ({self._gone[req]})")

    def _start_push(self, req: str, peer: str, f: dict, incarnation: Optional[str] = None,
                    raw: Optional[bytes] = None) -> None:
        """Serves a want of a held request: handed to the core (_to_core), else pushed from here
        (every check made, a refusal saying why)."""
        held = self._held[req]
        incarnation = incarnation or f.get("_inc", "")
        if (peer, incarnation) in self._closing:  # on the connection being closed, or on a new one
            self._after_close.setdefault((peer, incarnation), []).append((req, f, incarnation))
            return  # refused once the close returned (_check_closing)
        conn = self.agent.connection(peer)
        if conn is None or conn.peer_incarnation != incarnation:
            return  # that decode is gone; its successor will ask again
        layout = self._peer_layouts.get((peer, incarnation))
        if layout is None:
            return self._refuse(peer, f, "no layout was received on this connection")
        try:  # (the table checks the want: one refused here counts no readers, and the core never sees it)
            part = check_part(f.get("part", WHOLE))
            plans = self._row_plans((peer, incarnation), layout, part, len(held.blocks))
            table = self._push_table(held.blocks if held.ids is None else held.ids, [int(b) for b in f["dst"]],
                                     layout, part, f.get("groups"), plans)
        except LayoutError as e:
            return self._refuse(peer, f, str(e))
        self._serve_layout(conn, (peer, incarnation), part, plans)  # (the next wants of this part: the core's)
        held.parts = max(held.parts, f.get("readers") or part[1])
        if self._to_core(held, conn, f, raw or f.get("_raw")):
            return
        tag = str(f["tag"])
        done = protocol.encode("D", **_answer_to(f))
        handles = []
        try:
            if len(table):  # every layer's blocks in one call, the notification after them
                handles.append(conn.write_blocks(self._regions, layout[0], table, notification=done))
            else:
                conn.notify(done)
        except MeshError as e:
            self._count("pushes_failed")
            log.warning("%s: push of %s to %s failed: %s", self.name, req, peer, e)
            if isinstance(e, InvalidArgument):
                self._refuse(peer, f, str(e))
            if handles:  # the layers issued may still be read: it is in flight until they are done
                held.pushes.append(_Push(peer, tag, handles, time.monotonic(), conn, self._push_deadline(held),
                                         failed=True))
            return
        self._count("pushes")
        self._count("bytes_pushed", handles[0].nbytes if handles else 0)
        held.pushes.append(_Push(peer, tag, handles, time.monotonic(), conn, self._push_deadline(held)))

    def _to_core(self, held: _Held, conn, f: dict, raw: Optional[bytes]) -> bool:
        """Hands a want of offered blocks to the core's puller, which pushes it (no copy, no wait
        for a landing on this thread, which may be the engine's: _assist): a want that came before
        its hold, or before its part's tables were served, or as a ``W`` (a decode's first on a
        connection, sent before this prefill's layout told it of the binary form, which is made
        here). Once per want: one the core hands back again (it cannot serve it) is the thread's,
        which pushes or refuses it. False: the thread pushes it."""
        if held.ids is None or not held.offers:
            return False  # (the core has no blocks to serve it from)
        try:
            want = raw if raw is not None else protocol.encode_want(f, protocol.encode("D", **_answer_to(f)))
        except (ValueError, KeyError, TypeError):  # (ids longer than the binary form carries)
            return False
        key = (conn.peer_name, conn.peer_incarnation, hash(want))
        if key in self._handed:  # handed back to the thread: what the core cannot serve
            del self._handed[key]
            return False
        try:
            if not self._puller.resubmit(conn._core, want):
                return False
        except Exception:  # noqa: BLE001 - (closed meanwhile): the thread pushes it
            return False
        _remember(self._handed, key, None)
        return True

    def _push_deadline(self, held: _Held) -> float:
        return min(time.monotonic() + self.push_timeout, held.deadline)

    def _push_table(self, held_blocks, dst: List[int], layout, part=WHOLE, counts=None, plans=None):
        """The op table (layout.request_rows) of every layer's blocks of a request (``part``: a
        slice of each block's heads into a slice of the peer's, layout.write_ops), each layer
        with its KV cache group's blocks: ``dst`` cut into groups of ``counts`` blocks (None: one
        group), each the tail of that group's held blocks (``held_blocks``: one list of block ids
        per group (groups.py; hold() makes them), or one int64 tensor per group, made at hold
        time). ``plans``: the layout's RowPlan per group for ``part`` (_row_plans), made here when
        not given."""
        held = list(held_blocks)
        try:
            dst_groups = split(dst, [len(dst)] if counts is None else counts)
        except ValueError as e:
            raise LayoutError(str(e)) from None
        if plans is None:
            plans = self._make_plans(layout, part, len(held))
        if len(dst_groups) != len(held):
            raise LayoutError(f"blocks of {len(dst_groups)} KV cache groups asked for, {len(held)} held")
        tables = []
        for i, (src, d) in enumerate(zip(held, dst_groups)):
            if len(d) > len(src):
                raise LayoutError(f"{len(d)} blocks asked for, {len(src)} held" + (f" (group {i})" if i else ""))
            if d and plans[i] is not None:
                tables.append(plans[i].rows(src[len(src) - len(d):], d))
        if len(tables) == 1:
            return tables[0]
        import torch

        return torch.cat(tables) if tables else torch.empty((0, 5), dtype=torch.int64)

    def _row_plans(self, key: Tuple[str, str], layout, part, groups: int) -> list:
        """The RowPlans (one per KV cache group; None for a group without layers) of this worker's
        layers onto a peer's layout for ``part``: made at the first transfer with that layout, kept
        while the layout is (LayoutError when they do not fit). A pull reads by the same plans as a
        push writes, the two sides' roles swapped: its ``part`` swapped (_pull)."""
        plans = self._plans.setdefault(key, {})
        made = plans.get((part, groups))
        if made is None:
            made = plans[(part, groups)] = self._make_plans(layout, part, groups)
        return made

    def _make_plans(self, layout, part, groups: int) -> list:
        return [RowPlan(pairs, part) if pairs else None for pairs in self._layer_pairs(layout, groups)]

    def _layer_pairs(self, layout, groups: int) -> List[list]:
        """Per KV cache group, (layer here, its region, the peer's layer, its region) of each of
        its layers; LayoutError for a layer the peer lacks, or layers of another number of groups."""
        regions, peer_layers = layout
        if max(self.layer_group, default=0) + 1 != groups:
            raise LayoutError(f"blocks of {groups} KV cache groups held, layers of "
                              f"{max(self.layer_group, default=0) + 1} groups here")
        pairs: List[list] = [[] for _ in range(groups)]
        for g, group in zip(self.layers, self.layer_group):
            pg = peer_layers.get(g.name)
            if pg is None:
                raise LayoutError(f"layer {g.name} is not in the peer's KV cache (its layout names no such layer)")
            if not 0 <= pg.region < len(regions):
                raise LayoutError(f"layer {g.name}: region {pg.region} not described")
            pairs[group].append((g, g.region, pg, pg.region))
        return pairs

    def _on_ack(self, peer: str, req: str, readers: int = 1) -> None:
        """A decode agent took its blocks (``readers``: how many decode agents read this request,
        as its want said, or its ack where it read them itself); with several decode ranks each
        taking a slice of them, the blocks are released once as many agents as slices
        acknowledged. An ack of a request not held yet (a decode read it before this worker's
        hold() came) is kept until it is, or until ``hold_timeout``."""
        held = self._held.get(req)
        if held is None and readers > 1 and req not in self._gone:
            acked, parts, _ = self._early_acks.get(req, (set(), 1, 0.0))
            if req in self._early_acks or len(self._early_acks) < MAX_EARLY:
                self._early_acks[req] = (acked | {peer}, max(parts, readers),
                                         time.monotonic() + self.hold_timeout)
            else:
                self._warn_odd.warn("%s: an ack of %s from %s, not held yet, with %d others awaiting their "
                                    "hold: dropped (the blocks are released at their hold timeout)",
                                    self.name, req[:200], peer, MAX_EARLY)
            return
        if held is not None:
            held.parts = max(held.parts, readers)
            held.acked.add(peer)
            if len(held.acked) < held.parts:
                return
        self._on_release(req, "served")

    def _on_release(self, req: str, why: str) -> None:
        held = self._held.get(req)
        if held is None:
            self._early_acks.pop(req, None)
            if req not in self._gone:  # (the first word on it stands)
                self._remember_gone(req, why + EARLY)  # counted when its hold comes (_cmd_hold)
            for peer, f, _ in self._early.pop(req, []):  # never served now: answered, not left to their fetch_timeout
                self._refuse_gone(peer, f, req)
            return
        # Not while a push may still read the blocks (another decode's, or the acknowledged
        # push's last completions): once they are over (or abandoned, at their deadline).
        if not self._active(req, held, time.monotonic()):
            self._release(req, why)
        else:
            held.release_when_idle = held.release_when_idle or why

    def _withdraw(self, held: _Held) -> int:
        """Stops the core serving the wants of a held request; how many pushes it serves of it are
        still in flight (once 0, none starts any more)."""
        return sum(self._puller.withdraw(t) for t in held.offers)

    def _serving(self, held: _Held) -> bool:
        """Whether the core serves a push of this request now (its end not posted yet)."""
        return any(self._puller.in_flight(t) > 0 for t in held.offers)

    def _forget_offers(self, held: _Held) -> None:
        """A hold going: the core's events of its pushes, all ended, counted first (taken now; the
        others' kept for the next _take_served), then its tokens forgotten."""
        if not held.offers:
            return
        events = self._served_later + self._puller.take_served()
        self._served_later = [e for e in events if e[0] not in held.offers]
        for event in events:
            if event[0] in held.offers:
                self._on_served(*event)
        self._active("", held, time.monotonic())  # (counts the pushes that ended)
        for t in held.offers:
            self._offered.pop(t, None)

    def _release(self, req: str, why: str) -> None:
        held = self._held.get(req)
        if held is not None:
            if self._withdraw(held):  # a push the core began since it was found idle: once it is over
                held.release_when_idle = held.release_when_idle or why
                return
            self._forget_offers(held)
        self._held.pop(req, None)
        self._remember_gone(req, why)
        self._count("released_" + why)
        log.debug("%s: released %s (%s)", self.name, req, why)
        self._finish(sending=req)

    def _remember_gone(self, req: str, why: str) -> None:
        _remember(self._gone, req, why)

    def _active(self, req: str, held: _Held, now: float) -> bool:
        """Drops the pushes that are over: completed, failed, or abandoned once their
        connection's close returned; abandons those past their deadline. True while one may
        still read the blocks."""
        still = []
        for p in held.pushes:
            if p.closing is not None:
                if not p.closing.done.is_set():
                    still.append(p)
                elif not held.release_when_idle:  # its decode fails its fetch: nobody asks again
                    held.release_when_idle, held.abandoned_peer = "abandoned", p.peer
                continue
            if not all(h.done() for h in p.handles):
                if now > p.deadline:
                    self._abandon(p, f"the push of {req} to {p.peer} did not complete within "
                                     f"{now - p.started:.1f} s")
                still.append(p)
                continue
            try:
                for h in p.handles:
                    h.wait(1.0)
            except MeshError as e:  # the decode died or refused: keep the blocks for another try
                if not p.failed:
                    self._count("pushes_failed")
                    log.warning("%s: push of %s to %s failed: %s", self.name, req, p.peer, e)
            else:
                if not p.failed:
                    self._count("pushes_done")
                    self._count("push_seconds", now - p.started)
        held.pushes = still
        return bool(still) or self._serving(held)

    def _on_served(self, token: int, push: int, kind: int, peer: str, incarnation: str, readers: int, _ops: int,
                   nbytes: int, error: str, at: float) -> None:
        """The core's word on a push it serves (a want it took: csrc/agent/block_pull.h): started
        (counted, and kept among the request's pushes until it is over), ended, or late (past
        _served_timeout: abandoned with its connection, as a push of the thread's is)."""
        req = self._offered.get(token)
        held = self._held.get(req) if req is not None else None
        if held is None or token not in held.offers:
            return
        if kind == SERVED_STARTED:
            held.parts = max(held.parts, readers)
            conn = self.agent.connection(peer)
            if conn is None or conn.peer_incarnation != incarnation:
                conn = None  # its connection already ended (its decode restarted): its write fails on its own
            held.pushes.append(_Push(peer, "", [_Served(push)], at, conn,  # abandoned at the thread's deadline too
                                     float("inf") if conn is None else min(at + self.push_timeout, held.deadline)))
            self._count("pushes")
            self._count("pushes_served")
            self._count("bytes_pushed", nbytes)
            return
        p = next((p for p in held.pushes if p.handles and getattr(p.handles[0], "push", None) == push), None)
        if p is None:
            return
        if kind == SERVED_ENDED:
            p.handles[0].over, p.handles[0].error = True, error
            if held.release_when_idle:  # (its ack came first: released after this batch, _take_served)
                self._ended_idle.add(req)
        elif kind == SERVED_LATE and p.closing is None and p.conn is not None:
            self._abandon(p, f"the push of {req} to {peer} did not complete within "
                             f"{time.monotonic() - p.started:.1f} s")

    def _abandon(self, push: _Push, why: str) -> None:
        """Closes the connection of a push past its deadline on a thread of its own; every push
        on it is over once that close returned (the engine stopped: no byte of their source
        blocks is read any more; what the kernel took before stays valid, it was read before)."""
        key = (push.peer, _incarnation(push.conn))
        closing = self._closing.get(key)
        if closing is None:
            self._count("connections_abandoned")
            log.warning("%s: %s; abandoning it: closing the connection to %s (every push on it "
                        "fails), then releasing the blocks", self.name, why, push.peer)
            conn = push.conn
            closing = _Closing(push.peer, threading.Event())

            def close_it() -> None:
                try:
                    if conn is not None:
                        conn.close()
                except Exception:  # noqa: BLE001
                    log.exception("%s: closing the connection to %s failed", self.name, push.peer)
                finally:
                    closing.done.set()

            closing.thread = threading.Thread(target=close_it, name=f"kv-abandon-{push.peer}", daemon=True)
            self._closing[key] = closing
            closing.thread.start()
        else:
            log.warning("%s: %s; abandoned with its connection", self.name, why)
        for held in self._held.values():  # every push on that connection is abandoned with it
            for p in held.pushes:
                if p.closing is None and p.peer == push.peer and (p is push or _same_connection(p.conn, push.conn)):
                    p.closing = closing
                    self._count("pushes_abandoned")

    def _check_closing(self) -> None:
        for key, c in list(self._closing.items()):
            if not c.done.is_set():
                continue
            del self._closing[key]
            peer = key[0]
            log.info("%s: the connection to %s is closed", self.name, peer)
            # Wants that came meanwhile are refused: one that came on the closed connection
            # belongs to a fetch its decode failed when the connection went, and nothing says
            # which connection a notification came on (a push over a new one could write into
            # blocks that decode no longer keeps for it). One that came on a new connection is
            # failed at once instead of at its fetch timeout.
            for req, f, inc in self._after_close.pop(key, []):
                self._refuse(peer, f, f"request {req}: asked while the connection to {peer} was being "
                                      "closed (a push to it was abandoned)")

    def _check_held(self, now: float) -> None:
        self._check_closing()
        for req, held in list(self._held.items()):
            try:  # one request's trouble must not keep the others from their deadlines
                self._check_one_held(req, held, now)
            except Exception:  # noqa: BLE001
                self._warn_internal.warn("%s: checking held request %s failed:\n%s", self.name, req,
                                         traceback.format_exc())
        for req in [r for r, (_, _, until) in self._early_acks.items() if now > until]:
            del self._early_acks[req]
        for req, waiting in list(self._early.items()):
            late = [w for w in waiting if now > w[2]]
            waiting[:] = [w for w in waiting if now <= w[2]]
            if not waiting:
                del self._early[req]
            for peer, f, _ in late:
                self._refuse(peer, f, f"request {req} is not known here")

    def _check_one_held(self, req: str, held: _Held, now: float) -> None:
        active = self._active(req, held, now)
        if held.release_when_idle and not active:
            if held.release_when_idle == "abandoned":
                log.warning("%s: released %s after its push to %s was abandoned", self.name, req,
                            held.abandoned_peer)
            self._release(req, held.release_when_idle)
        elif now > held.deadline and not active:
            log.warning("%s: no decode took %s within %.0f s; releasing its blocks",
                        self.name, req, self.hold_timeout)
            self._release(req, "expired")

    # ---- decode side --------------------------------------------------------------------

    def _new_fetch(self, tag: str, md: bytes, remote_req: str, remote: Groups, local: Groups,
                   part: Tuple[int, ...] = WHOLE, readers: int = 0, hold_until: float = 0.0) -> _Fetch:
        """A fetch of fetch()'s arguments: of each group the last ``len(local)`` of the prefill's
        blocks (this decode has the others from its prefix cache), its deadline from now."""
        src = [r[len(r) - len(lg):] if lg else [] for r, lg in zip(remote, local)]
        now = time.monotonic()
        return _Fetch(tag, md, remote_req, src, local, now + self.fetch_timeout, started=now, part=part,
                      readers=readers, hold_until=hold_until, nonce=next(self._nonces))

    @staticmethod
    def _unfit(remote: Groups, local: Groups) -> str:
        """Why ``local`` cannot take the prefill's ``remote`` ("" when it can)."""
        if len(local) != len(remote):
            return f"blocks of {len(local)} KV cache groups to receive, the prefill holds {len(remote)}"
        if any(len(lg) > len(r) for lg, r in zip(local, remote)):
            return f"{[len(g) for g in local]} blocks to receive, the prefill holds {[len(g) for g in remote]}"
        return ""

    def _cmd_fetch(self, tag: str, md: bytes, remote_req: str, remote: Groups, local: Groups,
                   part: Tuple[int, ...] = WHOLE, readers: int = 0, hold_until: float = 0.0) -> None:
        f = self._new_fetch(tag, md, remote_req, remote, local, part, readers, hold_until)
        why = self._unfit(remote, local)
        if why:
            return self._fail(f, why)
        if not any(local):
            self._finish(recving=tag)
            return
        with self._fetch_lock:
            self._waiting.setdefault(tag, []).append(f)
        self._start_waiting()

    def _start_waiting(self) -> None:
        """Starts the fetches whose tag has no fetch out (an answer names only the tag: one fetch
        of a tag at a time is what it answers)."""
        if not self._waiting:
            return
        with self._fetch_lock:
            ready = [t for t in self._waiting if t not in self._fetches]
            for tag in ready:
                self._fetches[tag] = self._waiting[tag].pop(0)
                if not self._waiting[tag]:
                    del self._waiting[tag]
            started = [self._fetches[tag] for tag in ready]
        for f in started:
            try:
                self._ask(f)
            except Exception as e:  # noqa: BLE001 - the others of the batch must still be asked
                self._fail(f, f"the fetch could not start: {type(e).__name__}: {e}")

    def _ask(self, f: _Fetch) -> None:
        """Asks the fetch's prefill for its blocks (a ``W``), or reads them (_pull); its
        ``fetch_timeout`` runs from here."""
        f.deadline = time.monotonic() + self.fetch_timeout
        try:
            conn = self._connect(f.peer_metadata)
            f.conn, f.peer = conn, conn.peer_name
            self._tell_layout(conn)  # a new connection: the prefill forgot the old one's layout
            self._conn_of[f.peer_metadata] = conn
            if self._pulls(f, conn):
                return self._pull(f, conn)
        except MeshError as e:
            return self._fail(f, f"cannot reach the prefill: {e}")
        self._want(f, conn)

    def _want(self, f: _Fetch, conn) -> None:
        """Asks the prefill to push the fetch's blocks (a ``W``); its ``D`` is awaited by the puller
        (_await_done), an ``F`` comes to the transfer thread (_on_answer)."""
        want = dict(req=f.remote_req, tag=f.tag, src=flat(f.src), dst=flat(f.dst), n=f.nonce)
        if len(f.dst) > 1:
            want["groups"] = [len(g) for g in f.dst]
        if f.part != WHOLE:
            want["part"] = list(f.part)
        if f.readers:
            want["readers"] = f.readers
        done = protocol.encode("D", **_answer_to(want))  # (what the prefill answers it with: _answer_to)
        self._await_done(f, conn, done)
        try:  # a prefill whose layout said it takes them gets the binary form, which its core serves
            conn.notify(self._want_message(conn, want, done))
        except MeshError as e:
            self._fail(f, f"cannot reach the prefill: {e}")

    def _want_message(self, conn, want: dict, done: bytes) -> bytes:
        """The want's binary form (``w``) for a prefill whose layout said it takes them, else (and
        for ids longer than the binary form carries) its ``W``."""
        if (conn.peer_name, conn.peer_incarnation) in self._takes_w:
            try:
                return protocol.encode_want(want, done)
            except ValueError:  # (InvalidArgument: a request id or tag of more than 4096 bytes)
                pass
        return protocol.encode("W", **want)

    def _await_done(self, f: _Fetch, conn, done: bytes) -> None:
        """Has the puller await the push's ``D`` (``done``: the bytes the prefill answers the want
        with), send its ``A`` and post the outcome (_take_pulls), before the want goes. Where it
        cannot (closed), the transfer thread takes the ``D`` (_on_answer)."""
        token = next(self._tokens)
        with self._fetch_lock:
            f.token = token
            self._pulling[token] = f
        try:  # (its own deadline a backstop: the fetch's is the transfer thread's, _check_fetches)
            self._puller.await_answer(token, conn._core, done, protocol.encode("A", req=f.remote_req),
                                      self.fetch_timeout + ANSWER_SLACK)
        except Exception:  # noqa: BLE001 - closed meanwhile: the thread's way stays
            with self._fetch_lock:
                self._pulling.pop(token, None)
                f.token = 0

    def _awaited(self, f: _Fetch) -> bool:
        """Whether the core awaits this push's D: then it also says when the connection ended
        before the D came (a D it delivered first is a push that landed, even if the poll that
        reports it comes after the end)."""
        return not f.reading and f.token != 0 and self._pulling.get(f.token) is f

    def _pulls(self, f: _Fetch, conn) -> bool:
        """Whether this fetch reads its blocks itself (see the module): this prefill agent's layout
        came (from this incarnation of it: the regions it names are registered once, at its start),
        its path moves bytes on this host, the hold lasts long enough (a NaN lasts not at all)."""
        key = (conn.peer_name, conn.peer_incarnation)
        layout = self._peer_layouts.get(key)
        return self._may_pull(f, key, layout) and self._path_fits(key, conn, layout)

    def _may_pull(self, f: _Fetch, key: Tuple[str, str], layout) -> bool:
        """_pulls' checks but the path's."""
        if not self.pull or layout is None or not layout[0] or not time.time() + self.pull_margin < f.hold_until:
            return False
        with self._fetch_lock:  # (fetch() may pull on its own thread)
            return (key[0], f.remote_req) not in self._pulled  # read once already: a second ask is the prefill's to judge

    def _path_fits(self, key: Tuple[str, str], conn, layout) -> bool:
        """Whether the paths between this worker's regions and the prefill's (``layout``) all move
        the bytes on this host (found once per prefill layout)."""
        ok = self._pull_path.get(key)
        if ok is None:
            try:  # every pair of regions (a read that waits on a network would hold up every other fetch)
                ok = all(conn.path_to(r, mine.descriptor) in PULL_PATHS for r in layout[0] for mine in self._regions)
            except MeshError as e:
                log.info("%s: blocks from %s are pushed: %s", self.name, key[0], e)
                ok = False
            self._pull_path[key] = ok
        return ok

    def _fetch_now(self, tag: str, md: bytes, remote_req: str, remote: Groups, local: Groups,
                   part: Tuple[int, ...], readers: int, hold_until: float) -> bool:
        """fetch() on the caller's thread, where all it takes is known already: the connection an
        earlier fetch made (this worker's layout sent on it), and for a pull the prefill's layout,
        its path found fit and the row plans made; no command waits for the thread (none is
        overtaken) and the request id has no fetch out. A pull is then the core's from here (no
        interpreter lock taken off the caller's thread, however busy it keeps it); a push's want
        (``W``) goes from here, its ``D`` awaited by the core (_await_done). False: the thread
        does the fetch, as a command."""
        conn = self._conn_of.get(md)
        if conn is None or self._queued or self._stop.is_set() or conn.gone():
            return False
        if not any(local) or self._unfit(remote, local):
            return False  # (the thread reports it)
        key = (conn.peer_name, conn.peer_incarnation)
        if self._layout_sent.get(key) is not conn:
            return False
        f = self._new_fetch(tag, md, remote_req, remote, local, part, readers, hold_until)
        f.conn, f.peer = conn, conn.peer_name
        try:
            pull = self._pull_known(f, conn, key)
        except Exception:  # noqa: BLE001 - (the thread's maps changed meanwhile): the thread does it
            return False
        if pull is False:
            return False
        with self._fetch_lock:  # (a tag with a fetch out or waiting: the thread's, in its order)
            if tag in self._fetches or tag in self._waiting:
                return False
            f.reading = pull is not None  # (a pull's: the thread's checks leave it to its outcome)
            self._fetches[tag] = f
        try:
            if pull is not None:
                self._start_pull(f, conn, *pull)
            else:
                self._want(f, conn)
        except Exception as e:  # noqa: BLE001 - filed: reported as failed, never raised into the engine's step
            self._fail(f, f"the fetch could not start: {type(e).__name__}: {e}")
        return True

    def _pull_known(self, f: _Fetch, conn, key: Tuple[str, str]):
        """For _fetch_now: (the prefill's layout, the row plans) when the fetch is a pull, None
        when it is a push, False when that is not known yet (the thread finds it). Each of the
        thread's maps read once (the thread may change them meanwhile)."""
        layout = self._peer_layouts.get(key) if self.pull else None
        if layout is None:
            return None
        fits = self._pull_path.get(key)
        if fits is None:
            return False  # (the thread finds whether its path suits a pull)
        if not fits or not self._may_pull(f, key, layout):
            return None
        si, sn, di, dn = f.part
        plans = self._plans.get(key, {}).get(((di, dn, si, sn), len(f.dst)))
        return False if plans is None else (layout, plans)

    def _pull(self, f: _Fetch, conn) -> None:
        """The thread's fetch that reads its blocks itself (see _start_pull)."""
        key = (conn.peer_name, conn.peer_incarnation)
        layout = self._peer_layouts[key]
        si, sn, di, dn = f.part
        try:
            plans = self._row_plans(key, layout, (di, dn, si, sn), len(f.dst))
        except LayoutError as e:
            return self._fail(f, f"the prefill's KV cache does not fit this one: {e}")
        self._start_pull(f, conn, layout, plans)

    def _start_pull(self, f: _Fetch, conn, layout, plans) -> None:
        """Hands the fetch's read to the core's puller (agent/block_pull.h): per KV cache group its
        row plans' tables (a push's from here onto the prefill's layout, its ``part`` swapped: slice
        di of dn of these blocks, slice si of sn of the prefill's) and both sides' block ids. Its
        thread makes the ops, reads, sends the ``A`` once the bytes landed (a ``C`` when the read
        failed) and posts the outcome, which poll() reports (_take_pulls)."""
        readers = f.readers or f.part[1]
        ack = protocol.encode("A", req=f.remote_req, **({"readers": readers} if readers > 1 else {}))
        groups = [(plan.tables(), array.array("q", dst), array.array("q", src))
                  for plan, dst, src in zip(plans, f.dst, f.src) if plan is not None and dst]
        with self._fetch_lock:
            _remember(self._pulled, (f.peer, f.remote_req), None)
            f.reading, f.token = True, next(self._tokens)
            self._pulling[f.token] = f
        try:
            self._puller.submit(f.token, conn._core, self._regions, layout[0], groups, ack,
                                protocol.encode("C", req=f.remote_req))
        except Exception as e:  # noqa: BLE001 - closed meanwhile, or anything else: reported, not lost
            with self._fetch_lock:
                self._pulling.pop(f.token, None)
            self._fail(f, f"reading the blocks from the prefill failed: {e}")

    def _take_pulls(self) -> None:
        """Reports the pulls whose outcome the puller posted: received (their counters with
        them), failed (the puller sent the prefill its ``C``), or cancelled."""
        for token, error, _ops, nbytes, cancelled, at in self._puller.take():
            with self._fetch_lock:
                f = self._pulling.pop(token, None)
            if f is None:
                continue
            try:
                if cancelled or f.cancelled:
                    self._fail(f, "cancelled")
                elif error:
                    doing = "reading the blocks from the prefill" if f.reading else "awaiting the prefill's push"
                    self._fail(f, f"{doing} failed: {error}")
                elif f.reading:
                    self._fetched(f, at, pulls=1, bytes_pulled=nbytes)
                else:
                    self._fetched(f, at)
            except Exception:  # noqa: BLE001 - the next outcomes must still be reported
                self._warn_internal.warn("%s: reporting the read of %s failed:\n%s", self.name, f.tag,
                                         traceback.format_exc())

    def _fetched(self, f: _Fetch, landed: Optional[float] = None, **more: int) -> None:
        """A fetch whose blocks landed (pushed, or pulled: ``more`` counts; ``landed``: when, by
        time.monotonic(), if not now) is reported, its counters with it: a caller that sees the
        request sees them."""
        if not self._forget(f):
            return
        with self._lock:
            took = (time.monotonic() if landed is None else landed) - f.started
            for key, n in dict(more, fetches_done=1, fetch_seconds=took).items():
                self._stats[key] += n
            self._finish(recving=f.tag)

    def _forget(self, f: _Fetch) -> bool:
        """Marks a fetch over and drops it, if it is its tag's fetch out (a later fetch of the tag
        may be, once this one was cancelled and reported: not this one's to drop); a fetch of the
        tag that waited for it starts now. False when it was over already (two threads may both
        find it failed, as fetch()'s want and the thread's check of its connection: it is
        reported once)."""
        with self._fetch_lock:
            if f.over:
                return False
            f.over = True
            awaited = self._awaited(f)
            if awaited:
                del self._pulling[f.token]
            mine = self._fetches.get(f.tag) is f
            if mine:
                del self._fetches[f.tag]
            waited = mine and f.tag in self._waiting
        if awaited:  # a push reported otherwise (its F, an old prefill's D, its deadline): its D no longer awaited
            self._puller.forget(f.token)
        if waited:
            self.agent.wake_notifications()  # the transfer thread starts it (_check_fetches)
        return True

    def _cmd_cancel(self, tag: str) -> None:
        with self._fetch_lock:
            f, waiting = self._fetches.get(tag), self._waiting.pop(tag, [])
        for w in waiting:  # not asked yet: no byte can land, it is reported now
            w.cancelled = True
            self._cmd_release(w.peer_metadata, w.remote_req)
            self._fail(w, "cancelled")
        if f is None:
            return
        f.cancelled = True
        if f.token:
            self._puller.cancel(f.token)  # (its read, or its D awaited) its ack does not go
        self._send_quietly(f.conn, protocol.encode("C", req=f.remote_req))

    def _connect_ahead(self, commands: Sequence[tuple]) -> None:
        """Connects, before the step takes its lock, to the prefills the step will connect to (a
        connect may wait on the network up to connect_timeout: meanwhile poll() may do the step's
        part, _assist): those of its releases, of its fetches that have blocks to receive, and of
        the first fetch waiting for each tag that has none out now (one that waits for a fetch
        out is connected for once it starts, not at every step). The step's _connect takes each
        outcome, a failure too (the fetch fails saying why, with no second wait); a fetch that
        starts later in the step connects there."""
        mds = [c[1] for c in commands if c[0] == "release"]
        with self._fetch_lock:
            mds += [fs[0].peer_metadata for tag, fs in self._waiting.items() if fs and tag not in self._fetches]
            mds += [c[2] for c in commands if c[0] == "fetch" and c[1] not in self._fetches
                    and c[1] not in self._waiting and any(c[5]) and not self._unfit(c[4], c[5])]
        for md in dict.fromkeys(mds):
            try:
                self._ahead[md] = self.agent.connect(md, timeout=self.connect_timeout)
            except MeshError as e:
                self._ahead[md] = e
            except Exception:  # noqa: BLE001 - (metadata that is not an agent's): the step reports it
                pass

    def _connect(self, md: bytes):
        """The thread's connect to a prefill: the one made before the step (_connect_ahead), else
        made now (it may wait on the network up to connect_timeout: meanwhile poll() does not wait
        for the thread's step, _assist)."""
        ahead = self._ahead.get(md)
        if isinstance(ahead, MeshError):
            raise ahead
        if ahead is not None and not ahead.gone():
            return ahead
        self._connecting = True
        try:
            return self.agent.connect(md, timeout=self.connect_timeout)
        finally:
            self._connecting = False

    def _cmd_release(self, md: bytes, remote_req: str) -> None:
        try:
            conn = self._connect(md)
        except MeshError as e:
            log.warning("%s: cannot tell the prefill to release %s: %s", self.name, remote_req, e)
            return
        self._send_quietly(conn, protocol.encode("C", req=remote_req))

    @staticmethod
    def _send_quietly(conn, msg: bytes) -> None:
        if conn is None:
            return
        try:
            conn.notify(msg)
        except MeshError:
            pass

    def _on_answer(self, peer: str, tag: str, ok: bool, why: str, nonce: Optional[int] = None) -> None:
        """A prefill's answer to a want: taken for the fetch of ``tag`` out to that peer whose want
        carried ``nonce`` (None: a prefill of before the nonce, matched by the tag alone)."""
        f = self._fetches.get(tag)
        if f is None or f.peer != peer or f.reading or nonce not in (None, f.nonce):  # (a pull asked for nothing)
            return self._unexpected_answer(peer, tag, nonce)
        if ok:
            self._fetched(f)  # first: the prefill's release is not what the request waits for
            self._send_quietly(f.conn, protocol.encode("A", req=f.remote_req))
        else:
            self._fail(f, f"the prefill refused: {why}")

    def _unexpected_answer(self, peer: str, tag: str, nonce: Optional[int]) -> None:
        """Counts an answer that no fetch out awaits; where it names a fetch by its nonce (one of
        this agent's that is over: timed out, its connection lost, or cancelled and reported) it
        is late and logged at debug, else warned (late from a prefill of before the nonce, or made up)."""
        self._count("unexpected_answers")
        if nonce is not None:
            log.debug("%s: a late answer for %s from %s (fetch %d), dropped", self.name, tag[:200], peer, nonce)
            return
        self._warn_odd.warn("%s: an answer for %s from %s, which is not awaited from it", self.name, tag[:200], peer)

    def _fail(self, f: _Fetch, why: str) -> None:
        if not self._forget(f):
            return
        self._count("fetches_failed")
        if not f.cancelled:
            log.warning("%s: receiving %s failed: %s", self.name, f.tag, why)
        self._finish(recving=f.tag, failed=None if f.cancelled else flat(f.dst))

    def _check_fetches(self, now: float) -> None:
        self._start_waiting()
        with self._fetch_lock:
            fetches = list(self._fetches.values())
        for f in fetches:
            if f.reading:  # its outcome reports it once its read is over, whatever happened meanwhile
                continue
            try:
                gone = f.conn.gone() if f.conn is not None else "not connected"
                if gone and not self._awaited(f):
                    self._fail(f, f"the connection to the prefill is gone: {gone}")
                elif now > f.deadline:
                    self._send_quietly(f.conn, protocol.encode("C", req=f.remote_req))
                    self._fail(f, f"no answer within {self.fetch_timeout:.0f} s")
            except Exception:  # noqa: BLE001
                self._warn_internal.warn("%s: checking fetch %s failed:\n%s", self.name, f.tag,
                                         traceback.format_exc())
