"""A prefill or a decode engine (tests/vllm_engine.py: vLLM's real Scheduler, the connector in
both roles, CPU KV caches) in its own process, for tests/test_vllm_connector.py. They meet in a
directory: a decode publishes DIR/<name>.ready, the prefill publishes each finished request's
prompt and kv_transfer_params as DIR/req-<i>.json.

    prefill --dir D --requests N [--abort 7] [--wait-for a,b] [--hold-timeout S] [--tp T] [--die-on-push]
            [--shared-prefix A,B]   (request B's prompt starts with request A's first block)
        adds N requests (do_remote_decode) once the decodes named are ready, aborts those in
        --abort before they run, publishes the others when they finish, steps until every block
        is released; prints "offered req-i", "released req-i after S s" and
        "prefill: free blocks F of F" (exit 0) or what is wrong (exit 1)
    decode --dir D --name X --take 0,1 [--abort-mid 2] [--abort-early 3] [--expect loaded|recomputed]
           [--die-after-want] [--tp T] [--one-by-one]
        adds the requests taken with their kv_transfer_params (--one-by-one: each once the one
        before ran, so a later one can hit an earlier one's blocks in the prefix cache); --abort-early ones are aborted
        before their blocks are allocated, --abort-mid ones right after the fetch was scheduled;
        checks every byte of every block of the others when they first run; prints
        "fetching d-i: F of R blocks", "loaded d-i: B blocks ok", "recomputed d-i", "aborted d-i", "load errors: N blocks" and
        "decode: free blocks F of F"
    --die-on-push     prefill: exits (status 9) right after issuing the first layer of a push
    --die-after-want  decode: takes no answer and exits (status 9) once it asked for its blocks
    --kv-heads H      the model's KV heads (4; fewer than --tp: replicated on several ranks)
    --window W        a hybrid model: every other layer attends over a sliding window of W tokens
                      (two KV cache groups; "fetching" then prints each group's blocks)
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from vllm_engine import Engine, prompt_of  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("role")
    p.add_argument("--dir", required=True)
    p.add_argument("--name", default="decode")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--abort", default="")
    p.add_argument("--wait-for", default="")
    p.add_argument("--hold-timeout", type=float, default=60.0)
    p.add_argument("--fetch-timeout", type=float, default=30.0)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--take", default="")
    p.add_argument("--shared-prefix", default="")
    p.add_argument("--one-by-one", action="store_true")
    p.add_argument("--abort-mid", default="")
    p.add_argument("--abort-early", default="")
    p.add_argument("--expect", default="loaded")
    p.add_argument("--die-on-push", action="store_true")
    p.add_argument("--die-after-want", action="store_true")
    p.add_argument("--timeout", type=float, default=90.0)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--window", type=int, default=0)
    p.add_argument("--pull", action="store_true", help="the connector's pull setting on (decode reads blocks itself)")
    return p.parse_args()


def model_args(a) -> dict:
    return dict(kv_heads=a.kv_heads, window=a.window, layers=4 if a.window else 2)


def count(ids):
    """A block list's length, or each group's (a list of lists)."""
    return [len(g) for g in ids] if ids and isinstance(ids[0], list) else len(ids)


def ints(text):
    return [int(x) for x in text.split(",") if x]


def publish(d, name, data: dict):
    tmp = os.path.join(d, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(d, name))


def wait_file(path, deadline):
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} never appeared")
        time.sleep(0.02)
    with open(path) as f:
        return json.load(f)


def prompt_for(i, a):
    """Request i's prompt; with --shared-prefix A,B request B starts with A's first block."""
    own = prompt_of(i, 20 + (i * 13) % 50)
    pairs = ints(a.shared_prefix)
    if len(pairs) == 2 and i == pairs[1]:
        return prompt_of(pairs[0], 16) + own
    return own


def die_on_first_push(engine):
    for w in engine.workers:
        x = w._transfer

        def start_then_die(req, peer, f, incarnation=None, raw=None, x=x):
            layout = x._peer_layouts[(peer, incarnation or f.get("_inc", ""))]
            table = x._push_table(x._held[req].blocks, [int(b) for b in f["dst"]], layout)
            x.agent.connection(peer).write_blocks(x._regions, layout[0], table[:len(table) // 2])  # part of it
            print("prefill: dying mid-push", flush=True)
            os._exit(9)

        x._start_push = start_then_die


def say_groups(e) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    hma = KVConnectorFactory.supports_hma_config(e.config.kv_transfer_config)  # else vLLM turns HMA off
    print(f"kv cache groups: {len(e.kv_cache_config.kv_cache_groups)}, connector supports HMA: {hma}", flush=True)


def shut_down(e, role, problems) -> int:
    """Checks every block is free again, prints the count and each problem, shuts the engine
    down; the exit status (1 with any problem)."""
    if e.free_blocks() != e.initial_free:
        problems.append(f"free blocks {e.free_blocks()} of {e.initial_free}")
    print(f"{role}: free blocks {e.free_blocks()} of {e.initial_free}", flush=True)
    e.shutdown()
    for p in problems:
        print("PROBLEM:", p, flush=True)
    return 1 if problems else 0


def prefill(a) -> int:
    deadline = time.monotonic() + a.timeout
    e = Engine(a.dir, "kv_producer", "prefill", tp=a.tp, extra={"hold_timeout": a.hold_timeout, "pull": a.pull}, **model_args(a))
    say_groups(e)
    if a.die_on_push:
        die_on_first_push(e)
    for name in filter(None, a.wait_for.split(",")):
        wait_file(os.path.join(a.dir, f"{name}.ready"), deadline)
    aborted = {f"req-{i}" for i in ints(a.abort)}
    for i in range(a.requests):
        e.add(f"req-{i}", prompt_for(i, a), params={"do_remote_decode": True})
    for r in aborted:
        e.abort(r)
    offered, problems = {}, []
    while (len(offered) < a.requests - len(aborted) or not e.idle()) and time.monotonic() < deadline:
        for r, params in e.step().items():
            if r in aborted:
                continue
            if not params or not params.get("do_remote_prefill"):
                problems.append(f"{r} finished without kv_transfer_params for a decode: {params}")
                continue
            offered[r] = time.monotonic()
            publish(a.dir, f"{r}.json", {"prompt": e.prompts[r], "params": params})
            print(f"offered {r}", flush=True)
        for r in sorted(e.released):
            print(f"released {r} after {time.monotonic() - offered.get(r, 0):.2f} s", flush=True)
        e.released.clear()
        time.sleep(0.005)
    for r in aborted:
        if e.status(r) is not None:
            problems.append(f"aborted {r} is still held")
    if not e.idle():
        problems.append("blocks are still held at the deadline")
    return shut_down(e, "prefill", problems)


def layouts_taken(workers, deadline) -> None:
    """Until each worker's thread took a prefill's layout: it came before the first push's D, which
    the core reports without that thread, so a request added at once could be pushed for want of
    it (a race of this harness, which adds the next request as soon as the last one ran)."""
    def readied(x):  # (_ready_pulls: the plans made, or the path found not to suit a pull)
        return bool(x._plans) or False in x._pull_path.values()

    while time.monotonic() < deadline and not all(readied(w._transfer) for w in workers):
        time.sleep(0.005)


def decode(a) -> int:
    deadline = time.monotonic() + a.timeout
    e = Engine(a.dir, "kv_consumer", a.name, tp=a.tp, extra={"fetch_timeout": a.fetch_timeout, "pull": a.pull}, **model_args(a))
    say_groups(e)
    publish(a.dir, f"{a.name}.ready", {})
    mid = {f"d-{i}" for i in ints(a.abort_mid)}
    early = {f"d-{i}" for i in ints(a.abort_early)}
    todo = [f"d-{i}" for i in ints(a.take)]

    def add_next():
        r = todo.pop(0)
        got = wait_file(os.path.join(a.dir, f"req-{r[2:]}.json"), deadline)
        e.add(r, got["prompt"], max_tokens=2, params=got["params"])

    while todo and not a.one_by_one:
        add_next()
    if todo:
        add_next()
    for r in early:
        e.abort(r)
        print(f"aborted {r}", flush=True)
    results, problems = {}, []
    asked = []

    def on_scheduled(engine, out):
        meta = out.kv_connector_metadata
        asked.extend(meta.to_fetch)
        for r, f in meta.to_fetch.items():
            print(f"fetching {r}: {count(f['local'])} of {count(f['remote_blocks'])} blocks", flush=True)
        for r in mid & set(meta.to_fetch):
            engine.abort(r)
            print(f"aborted {r}", flush=True)
        for r, n in out.num_scheduled_tokens.items():
            if r in results:
                continue
            if n == 1:  # the prompt came from the prefill: only its last token is recomputed
                checked, bad = engine.check(r)
                results[r] = "loaded" if not bad else "mismatch"
                print(f"loaded {r}: {checked} blocks ok" if not bad else f"MISMATCH {r}: {bad[:6]}", flush=True)
            else:
                results[r] = "recomputed"
                print(f"recomputed {r} ({n} tokens)", flush=True)

    if a.die_after_want:
        for w in e.workers:
            w._transfer._on_answer = w._transfer._await_done = lambda *args: None  # it dies before it takes any answer
    expected = {f"d-{i}" for i in ints(a.take)} - mid - early
    finished = set()
    while (not expected <= finished or not e.idle()) and time.monotonic() < deadline:
        finished |= set(e.step(on_scheduled))
        if todo and len(results) == len(ints(a.take)) - len(todo):  # the previous one ran
            if a.pull:
                layouts_taken(e.workers, deadline)
            add_next()
        if a.die_after_want and asked:
            time.sleep(0.5)
            print("decode: dying after asking", flush=True)
            os._exit(9)
        time.sleep(0.005)
    for r in sorted(expected):
        if results.get(r) != a.expect:
            problems.append(f"{r}: {results.get(r, 'never ran')}, expected {a.expect}")
    print(f"load errors: {len(e.invalid_blocks)} blocks", flush=True)
    print(f"decode read itself: {sum(w._transfer.stats()['pulls'] for w in e.workers)} fetches", flush=True)
    if not e.idle():
        problems.append("requests or transfers are still pending at the deadline")
    return shut_down(e, "decode", problems)


if __name__ == "__main__":
    args = parse()
    sys.exit(prefill(args) if args.role == "prefill" else decode(args))
