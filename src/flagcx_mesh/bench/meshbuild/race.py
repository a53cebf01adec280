"""The full-mesh race: how often each builder completes, hangs or miswires.

    python -m flagcx_mesh.bench race [--trials 200] [-n 4] [--jitter-us 2000]
                                     [--builders legacy,ordered,tagged] [--timeout 1.0]
                                     [--modes ib-strict,socket] [--socks-per-conn 1] [--json PATH]

Starts N rank processes once (embedded launcher). Each runs T trials per
builder and adaptor mode over the test adaptor (loopback TCP, no identity on
the wire, one FIFO accept queue per listener) with a random 0..J us delay
before every connect and accept step, fresh listeners per trial. Modes:
ib-strict behaves as FlagCX's IB adaptor (a connect completes once the peer
accepted it; NULL requests until the peer posts; registration required),
socket as its socket adaptor (a connect completes in the kernel backlog,
before the peer accepts; --socks-per-conn sockets per connection, accepted
one at a time), ib as IB without NULL requests or registration. After each
trial the ranks exchange their outcomes (which also lines them up for the
next one); a trial is hung when any rank's deadline expired, else miswired
when any rank's wiring check saw another rank's connection, else failed when
any rank failed, else completed. A hung trial costs the deadline, so keep
--timeout short.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Dict, List, Optional

from ...netbuild import BUILDERS, DEFAULT_TAG_BASE, MODES, OUTCOMES, aggregate, earliest_round_error
from .._ranks import run_ranks, save_json

DEFAULT_JITTER_US = 2000
DEFAULT_TIMEOUT_S = 1.0


def _builders(text: str) -> List[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in names if b not in BUILDERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"builders must be from {','.join(BUILDERS)}; got {text!r}")
    return names


def _modes(text: str) -> List[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"modes must be from {','.join(MODES)}; got {text!r}")
    return names


DEFAULT_MODES = "ib-strict,socket"
MODE_TEXT = {"ib": "IB-like (connect waits for accept)",
             "ib-strict": "IB-strict (connect waits for accept; NULL requests until the peer posts; "
                          "registration required)",
             "socket": "socket-like (connect completes in the backlog before accept; {k} socket(s) per "
                       "connection, accepted one at a time)"}


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench race", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=200, help="trials per builder (default 200)")
    p.add_argument("-n", "--nranks", type=int, default=4, help="rank processes (default 4)")
    p.add_argument("--jitter-us", type=int, default=DEFAULT_JITTER_US,
                   help=f"max random delay before each connect/accept step, us (default {DEFAULT_JITTER_US})")
    p.add_argument("--builders", type=_builders, default=list(BUILDERS), help="comma-separated (default all three)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"deadline of one build, seconds; a hung trial costs this (default {DEFAULT_TIMEOUT_S})")
    p.add_argument("--modes", type=_modes, default=_modes(DEFAULT_MODES),
                   help=f"test adaptor modes, comma-separated, from {','.join(MODES)} (default {DEFAULT_MODES})")
    p.add_argument("--socks-per-conn", type=int, default=1,
                   help="sockets per connection in the socket mode, 1..4 (default 1)")
    p.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    a = p.parse_args(argv)
    if a.trials < 1 or a.nranks < 1 or a.jitter_us < 0 or a.timeout <= 0 or not 1 <= a.socks_per_conn <= 4:
        p.error("--trials and -n must be >= 1, --jitter-us >= 0, --timeout > 0, --socks-per-conn in 1..4")
    return a


def _parse_rank(argv: List[str]) -> argparse.Namespace:
    r = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench race-rank")
    r.add_argument("--trials", type=int, required=True)
    r.add_argument("--jitter-us", type=int, required=True)
    r.add_argument("--builders", type=_builders, required=True)
    r.add_argument("--timeout", type=float, required=True)
    r.add_argument("--modes", type=_modes, required=True)
    r.add_argument("--socks-per-conn", type=int, required=True)
    r.add_argument("--out", required=True)
    return r.parse_args(argv)


# ---------------------------------------------------------------- rank side

class _Progress:
    """Rank 0's progress lines, at most one every few seconds."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.last = total, 0, time.monotonic()

    def step(self, builder: str, counts: Dict[str, int]) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last >= 5.0 or self.done == self.total:
            tally = ", ".join(f"{k} {v}" for k, v in counts.items() if v)
            print(f"  ... {self.done}/{self.total} trials; {builder} so far: {tally}", flush=True)
            self.last = now


def _run_builder(boot, mode: str, builder: str, index: int, args: argparse.Namespace, progress) -> List[dict]:
    from ...netbuild import build_trial

    n, rank, out = boot.nranks, boot.rank, []
    counts = {k: 0 for k in OUTCOMES}
    socks = args.socks_per_conn if mode == "socket" else 1
    for t in range(args.trials):
        r = build_trial(boot, builder, jitter_us=args.jitter_us, seed=(t * 1000003 + rank * 7919 + index) + 1,
                        timeout=args.timeout, tag_base=DEFAULT_TAG_BASE + (t % 4096) * (n + 1), mode=mode,
                        socks_per_conn=socks)
        mine = json.dumps({"o": r["outcome"], "s": r["seconds"], "e": r["error"][:300]}).encode()
        parts = [json.loads(p) for p in boot.allgather(mine, timeout=args.timeout + 60)]
        outcome = aggregate(p["o"] for p in parts)
        counts[outcome] += 1
        first = earliest_round_error([p["e"] for p in parts if p["o"] == outcome])
        out.append({"outcome": outcome, "seconds": max(p["s"] for p in parts), "error": first})
        if progress:
            progress.step(builder, counts)
    return out


def rank_entry(argv: List[str]) -> int:
    args = _parse_rank(argv)
    from ...launch import ranks_from_env
    from ...netbuild import NetBootstrap

    found = ranks_from_env()
    if found is None:
        print("bench race-rank: start it through python -m flagcx_mesh.bench race", file=sys.stderr)
        return 2
    rank, nranks, uid = found
    boot = NetBootstrap(nranks, uid, rank, timeout=60.0)
    try:
        boot.barrier(timeout=60)
        progress = _Progress(args.trials * len(args.builders) * len(args.modes)) if rank == 0 else None
        result = {m: {b: _run_builder(boot, m, b, i, args, progress) for i, b in enumerate(args.builders)}
                  for m in args.modes}
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
    finally:
        boot.close()
    return 0


# ---------------------------------------------------------------- driver side

def _table(data: Dict[str, Dict[str, List[dict]]], args: argparse.Namespace) -> dict:
    out = {"nranks": args.nranks, "trials": args.trials, "jitter_us": args.jitter_us,
           "timeout_s": args.timeout, "socks_per_conn": args.socks_per_conn, "modes": {}}
    print(f"full-mesh race: {args.nranks} ranks, {args.trials} trials per builder and mode, jitter "
          f"0..{args.jitter_us} us per connect/accept step, deadline {args.timeout} s per build")
    for mode, per_builder in data.items():
        print(f"adaptor mode {mode}: {MODE_TEXT[mode].format(k=args.socks_per_conn)}")
        out["modes"][mode] = {"builders": _mode_table(per_builder)}
    print("  hung = a rank's build deadline expired (the hang is detected, not waited out); miswired = the "
          "wiring check found a slot holding another rank's connection; median over completed trials, "
          "slowest rank")
    for mode, info in out["modes"].items():
        for b, row in info["builders"].items():
            for kind, text in row["first_error"].items():
                print(f"  first {kind} ({mode}, {b}): {text}")
    return out


def _mode_table(data: Dict[str, List[dict]]) -> dict:
    builders = {}
    print(f"  {'builder':<9}{'trials':>7}{'completed':>11}{'hung':>7}{'miswired':>10}{'failed':>8}"
          f"{'median ms':>11}")
    for b, trials in data.items():
        counts = {k: sum(1 for t in trials if t["outcome"] == k) for k in OUTCOMES}
        done = [t["seconds"] * 1e3 for t in trials if t["outcome"] == "completed"]
        med = statistics.median(done) if done else float("nan")
        builders[b] = dict(counts, trials=len(trials), median_ms=med if done else None,
                           first_error={k: next((t["error"] for t in trials if t["outcome"] == k), "")
                                        for k in OUTCOMES[1:] if counts[k]})
        print(f"  {b:<9}{len(trials):>7}{counts['completed']:>11}{counts['hung']:>7}{counts['miswired']:>10}"
              f"{counts['failed']:>8}{med:>11.2f}")
    return builders


def main(argv: List[str]) -> int:
    args = _parse(argv)
    rank_args = ["race-rank", "--trials", str(args.trials), "--jitter-us", str(args.jitter_us),
                 "--builders", ",".join(args.builders), "--timeout", str(args.timeout),
                 "--modes", ",".join(args.modes), "--socks-per-conn", str(args.socks_per_conn)]
    budget = 120 + args.trials * len(args.builders) * len(args.modes) * (args.timeout + 1.0)
    t0 = time.monotonic()
    data = run_ranks("race", rank_args, args.nranks, timeout=budget)
    if data is None:
        return 1
    out = _table(data, args)
    out["wall_s"] = time.monotonic() - t0
    print(f"  wall time {out['wall_s']:.1f} s")
    save_json(out, args.json)
    return 0
