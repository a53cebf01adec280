"""Where one KV request's time goes (`bench kv --steps`): both processes stamp the transfer part's
steps (time.perf_counter, one clock for the processes of one host), the decode hands its stamps
to the prefill at the end, and the prefill prints, per request length, the median of each step
over the requests. The steps are a chain, each from a stamp to one that cannot come before it
(so they add up to the request, median for median nearly):

    to the want         the decode's fetch() called until its want (W) is sent: the connection
                        looked up and the want encoded, on fetch()'s own thread from the second
                        fetch on a connection, else by the transfer thread (its command)
    to the prefill      the W's notify until the prefill's transfer thread handles it (the socket,
                        the prefill's progress thread, its wake-up)
    want read           the W decoded and checked, until the table is made
    table               the request's op table (RowPlan.rows)
    to the push         until write_blocks is called
    push, done back     write_blocks (the copies issued, and their wait on the device paths), the
                        copies, the done (D) notification, matched by the decode's core (its A
                        sent, the outcome posted), until poll() takes it (_fetched)
    to the caller       until poll() returns the request to the caller
    total               the decode's fetch() until poll() returned the request

and beside the chain: fetch() call (the caller's fetch() itself) and push issued (write_blocks
itself, inside "push, done back").

A pushed request whose want the prefill's core served (a binary want, ``w``: transfer.py; no
step of the prefill's transfer thread to stamp) has a chain of its own:

    to the want         as above
    served, done back   the W's notify until poll() takes the request (_fetched): the prefill's
                        core took the want, made the ops, wrote the blocks with the D behind them,
                        the decode's core matched the D (its A sent, the outcome posted)
    to the caller, total   as above

A pushed request whose want came to the prefill's transfer thread (a ``W``: the decode's first
on a connection, before the prefill's layout told it of the binary form), which handed it to
the core (_to_core), has a chain of its own:

    to the want, to the prefill   as above
    want read           the W decoded and checked, the tables of its part made, until the thread
                        hands it to the core
    served, done back   from there until poll() takes the request (_fetched), as above
    to the caller, total   as above

and beside it `to the core`: the thread's hand-off call (the want's binary form made and queued
at the core's puller), which may return after the request was served and taken.

A request the decode read itself (a pull: transfer.py) has a chain of its own:

    to the pull         the decode's fetch() called until the pull is handed over (_start_pull):
                        on fetch()'s own thread from the second pull from a prefill on, else
                        through the transfer thread
    hand-off            the ack encoded, the block ids copied, the read queued at the core's puller
    read, acked, taken  the core's thread: the ops made, the read issued, its copies landed, the ack
                        (A) sent, the outcome posted; until poll() takes it (_fetched)
    to the caller       until poll() returns the request to the caller
    total               the decode's fetch() until poll() returned the request

The stamps wrap methods of KVTransfer and AgentConnection in the bench's processes only (a
perf_counter read and a list append a step); the figures are the request's own, a little slower.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Dict, List, Tuple

Step = Tuple[str, str, str]  # (name, from stamp, to stamp)
TOTAL: Step = ("total", "fetch>", "polled")
FETCH_CALL: Step = ("fetch() call", "fetch>", "fetch<")
CHAIN: Tuple[Step, ...] = (  # the first stamp of each name after the fetch
    ("to the want", "fetch>", "notify>"),
    ("to the prefill", "notify>", "note:W"),
    ("want read", "note:W", "table>"),
    ("table", "table>", "table<"),
    ("to the push", "table<", "wb>"),
    ("push, done back", "wb>", "fetched>"),
    ("to the caller", "fetched>", "polled"),
)
BESIDE = (FETCH_CALL, ("push issued", "wb>", "wb<"))
STEPS = CHAIN + (TOTAL,) + BESIDE
SERVED_CHAIN: Tuple[Step, ...] = (
    ("to the want", "fetch>", "notify>"),
    ("served, done back", "notify>", "fetched>"),
    ("to the caller", "fetched>", "polled"),
)
SERVED_STEPS = SERVED_CHAIN + (TOTAL, FETCH_CALL)
HANDED_CHAIN: Tuple[Step, ...] = CHAIN[:2] + (  # (to the want, to the prefill: a push's)
    ("want read", "note:W", "core>"),
    ("served, done back", "core>", "fetched>"),
) + CHAIN[-1:]
# Beside it, as a push's `push issued`: the core may serve the want, and the decode take it,
# before the thread's hand-off call has returned.
HANDED_STEPS = HANDED_CHAIN + (TOTAL, FETCH_CALL, ("to the core", "core>", "core<"))
PULL_CHAIN: Tuple[Step, ...] = (
    ("to the pull", "fetch>", "pull>"),
    ("hand-off", "pull>", "pull<"),
    ("read, acked, taken", "pull<", "fetched>"),
    ("to the caller", "fetched>", "polled"),
)
PULL_STEPS = PULL_CHAIN + (TOTAL, FETCH_CALL)

_stamps: List[Tuple[float, str]] = []
_installed = [False]


def _stamp(tag: str) -> None:
    _stamps.append((time.perf_counter(), tag))


def _wrap(cls, name: str, tag: str) -> None:
    fn = getattr(cls, name)

    def stamped(*a, **k):
        _stamp(tag + ">")
        try:
            return fn(*a, **k)
        finally:
            _stamp(tag + "<")

    setattr(cls, name, stamped)


def clear() -> None:
    """Forgets this process's stamps so far (a path measured before)."""
    del _stamps[:]


def install() -> None:
    """Stamps the steps of this process's KV transfers from now on (once a process)."""
    if _installed[0]:
        return
    _installed[0] = True
    from ..agent import AgentConnection
    from ..vllm import protocol
    from ..vllm.transfer import KVTransfer

    for name, tag in (("fetch", "fetch"), ("_push_table", "table"), ("_to_core", "core"),
                      ("_start_pull", "pull"), ("_fetched", "fetched")):
        _wrap(KVTransfer, name, tag)
    _wrap(AgentConnection, "write_blocks", "wb")
    _wrap(AgentConnection, "notify", "notify")
    on_notification, poll = KVTransfer._on_notification, KVTransfer.poll
    at = len(protocol.MAGIC)

    def noted(self, peer, incarnation, data):
        kind = chr(data[at]) if len(data) > at else "?"
        _stamp("note:" + ("W" if kind == "w" else kind))  # (a binary want the core handed back: a W)
        return on_notification(self, peer, incarnation, data)

    def polled(self, *a, **k):
        out = poll(self, *a, **k)
        if out.recving:
            _stamp("polled")
        return out

    KVTransfer._on_notification, KVTransfer.poll = noted, polled


def taken() -> str:
    """This process's stamps so far, as JSON (the decode's, for the prefill)."""
    return json.dumps(_stamps)


def _requests(stamps: List[Tuple[float, str]]) -> List[Dict[str, float]]:
    """Each request (a fetch> to the polled after it; the requests are made one after the other):
    the first time of each stamp from its fetch> to the next one, so a call of its own that returns
    after the decode polled it (the thread's hand-off to the core, a push's write_blocks) still
    counts. A fetch> with no polled before the next is no request."""
    out, cur = [], None
    for t, tag in sorted(stamps):
        if tag == "fetch>":
            if cur is not None and "polled" in cur:
                out.append(cur)
            cur = {"fetch>": t}
        elif cur is not None:
            cur.setdefault(tag, t)
    if cur is not None and "polled" in cur:
        out.append(cur)
    return out


def _way(r: Dict[str, float]) -> str:
    """How a stamped request went: pulled, pushed by the prefill's thread (it wrote the blocks),
    handed to the prefill's core by its thread (it took the want), or served by the core."""
    if "pull>" in r:
        return "pulled"
    if "note:W" not in r:
        return "served"
    return "pushed" if "wb>" in r else "handed"


def report(decode_stamps: str, tokens_of_requests: List[int]) -> Dict[str, Dict[str, float]]:
    """Prints the median of each step per request length, pushed by the prefill's thread, handed
    by it to its core, served by its core and pulled apart (the first request of each length,
    which sets up its connection's layout, left out where its way has more) and returns them in
    ms: {tokens: {step: ms}}, a handed request's as {tokens + " handed": ...}, a served one's as
    {tokens + " served": ...}, a pulled one's as {tokens + " pulled": ...}."""
    reqs = _requests([(float(t), str(tag)) for t, tag in json.loads(decode_stamps)] + _stamps)
    if len(reqs) != len(tokens_of_requests):
        print(f"  steps: {len(reqs)} requests stamped, {len(tokens_of_requests)} made: not reported", flush=True)
        return {}
    by_len: Dict[int, List[Dict[str, float]]] = {}
    for tokens, r in zip(tokens_of_requests, reqs):
        by_len.setdefault(tokens, []).append(r)
    out: Dict[str, Dict[str, float]] = {}
    for tokens, all_rs in by_len.items():
        for way, steps, key, how in (("pushed", STEPS, str(tokens), ""),
                                     ("handed", HANDED_STEPS, f"{tokens} handed",
                                      " handed to the prefill's core by its thread"),
                                     ("served", SERVED_STEPS, f"{tokens} served", " served by the prefill's core"),
                                     ("pulled", PULL_STEPS, f"{tokens} pulled", " pulled")):
            rs = [r for r in all_rs if _way(r) == way]
            if len(rs) > 1 and rs[0] is all_rs[0]:
                rs = rs[1:]
            fig = {}
            for name, a, b in steps:
                gaps = [(r[b] - r[a]) * 1e3 for r in rs if a in r and b in r]
                if gaps:
                    fig[name] = statistics.median(gaps)
            if not fig:
                continue
            out[key] = fig
            print(f"  steps of a {tokens}-token request{how} (ms, median of {len(rs)}): " +
                  ", ".join(f"{name} {ms:.3f}" for name, ms in fig.items()), flush=True)
    return out
