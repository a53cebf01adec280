"""The prefill's half of the vLLM connector's transfer part (a mixin of transfer.KVTransfer, whose
state it uses, made in KVTransfer.__init__; its thread and poll() call these): holds, the decode
layouts, wants pushed by the core or by the thread, acks and releases, the core's events of its
pushes, pushes abandoned past their deadline. See transfer.py's docstring."""

from __future__ import annotations

import threading
import time
import traceback
from typing import List, Optional, Tuple

from ..errors import InvalidArgument, MeshError
from . import protocol
from ._transfer_state import (EARLY, MAX_EARLY, SERVED_ENDED, SERVED_LATE, SERVED_STARTED, _answer_to, _Closing,
                              _Held, _incarnation, _Push, _remember, _Served, _same_connection, log)
from .groups import Groups, split
from .layout import WHOLE, LayerGeometry, LayoutError, RowPlan, block_id_tensor, check_part


class PrefillSide:
    """KVTransfer's prefill side (see the module)."""

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
