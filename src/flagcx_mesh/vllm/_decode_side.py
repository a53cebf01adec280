"""The decode's half of the vLLM connector's transfer part (a mixin of transfer.KVTransfer, whose
state it uses, made in KVTransfer.__init__; fetch() and its thread call these): fetches asked for
(a want, its D awaited by the core) or read by the decode itself (a pull handed to the core), the
prefill's answers, cancels and releases, timeouts, and the thread's connects. See transfer.py's
docstring."""

from __future__ import annotations

import array
import time
import traceback
from typing import Optional, Sequence, Tuple

from ..errors import MeshError
from . import protocol
from ._transfer_state import ANSWER_SLACK, PULL_PATHS, _answer_to, _Fetch, _remember, log
from .groups import Groups, flat
from .layout import WHOLE, LayoutError


class DecodeSide:
    """KVTransfer's decode side (see the module)."""

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
