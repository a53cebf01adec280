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
counted (``stats()``), logged (at most one line per ``LOG_EVERY`` (_transfer_state.py) seconds for each kind of
trouble) and ignored, and the other notifications of its batch are handled as if it had not come.
"""

from __future__ import annotations

import array
import atexit
import itertools
import queue
import threading
import time
import traceback
import weakref
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Set, Tuple

from .. import _core
from ..agent import Agent
from ..errors import MeshError
from . import protocol
from ._decode_side import DecodeSide
from ._prefill_side import PrefillSide
from ._transfer_state import PULL_PATHS, SERVED_ENDED, SERVED_STARTED  # noqa: F401 (this module's names too)
from ._transfer_state import Finished, _Closing, _Fetch, _Held, _Throttled, log
from .groups import as_groups
from .layout import WHOLE, LayerGeometry, RowPlan, check_part, describe_layers

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
ASSIST_AFTER = 0.01  # seconds since the thread's last step after which poll() does its part (_assist)
ASSIST_WAIT = 0.0005  # seconds poll() waits for a step of the thread under way before it does its part (_assist)


def _close_at_exit(ref) -> None:
    """An engine that exits without shutting its connector down must not leave the thread
    inside the agent while the interpreter finalizes."""
    x = ref()
    if x is not None:
        x.close()


class KVTransfer(PrefillSide, DecodeSide):
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
