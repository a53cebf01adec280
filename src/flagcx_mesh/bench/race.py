"""The full-mesh race: how often each builder completes, hangs or miswires.

    python -m flagcx_mesh.bench race [--trials 200] [-n 4] [--jitter-us 2000]
                                     [--builders legacy,ordered,tagged] [--timeout 1.0] [--json PATH]

Starts N rank processes once (embedded launcher). Each runs T trials per
builder over the test adaptor (loopback TCP shaped like FlagCX's IB adaptor:
no identity on the wire, one FIFO accept queue per listener) with a random
0..J us delay before every connect and accept step, fresh listeners per
trial. After each trial the ranks exchange their outcomes (which also lines
them up for the next one); a trial is hung when any rank's deadline expired,
else miswired when any rank's wiring check saw another rank's connection,
else failed when any rank failed, else completed. A hung trial costs the
deadline, so keep --timeout short.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Dict, List, Optional

from ..netbuild import BUILDERS, DEFAULT_TAG_BASE, OUTCOMES, aggregate, earliest_round_error
from ._ranks import run_ranks, save_json

DEFAULT_JITTER_US = 2000
DEFAULT_TIMEOUT_S = 1.0


def _builders(text: str) -> List[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in names if b not in BUILDERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"builders must be from {','.join(BUILDERS)}; got {text!r}")
    return names


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench race", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=200, help="trials per builder (default 200)")
    p.add_argument("-n", "--nranks", type=int, default=4, help="rank processes (default 4)")
    p.add_argument("--jitter-us", type=int, default=DEFAULT_JITTER_US,
                   help=f"max random delay before each connect/accept step, us (default {DEFAULT_JITTER_US})")
    p.add_argument("--builders", type=_builders, default=list(BUILDERS), help="comma-separated (default all three)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"deadline of one build, seconds; a hung trial costs this (default {DEFAULT_TIMEOUT_S})")
    p.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    a = p.parse_args(argv)
    if a.trials < 1 or a.nranks < 1 or a.jitter_us < 0 or a.timeout <= 0:
        p.error("--trials and -n must be >= 1, --jitter-us >= 0, --timeout > 0")
    return a


def _parse_rank(argv: List[str]) -> argparse.Namespace:
    r = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench race-rank")
    r.add_argument("--trials", type=int, required=True)
    r.add_argument("--jitter-us", type=int, required=True)
    r.add_argument("--builders", type=_builders, required=True)
    r.add_argument("--timeout", type=float, required=True)
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


def _run_builder(boot, builder: str, index: int, args: argparse.Namespace, progress) -> List[dict]:
    from ..netbuild import build_trial

    n, rank, out = boot.nranks, boot.rank, []
    counts = {k: 0 for k in OUTCOMES}
    for t in range(args.trials):
        r = build_trial(boot, builder, jitter_us=args.jitter_us, seed=(t * 1000003 + rank * 7919 + index) + 1,
                        timeout=args.timeout, tag_base=DEFAULT_TAG_BASE + (t % 4096) * (n + 1))
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
    from ..launch import ranks_from_env
    from ..netbuild import NetBootstrap

    found = ranks_from_env()
    if found is None:
        print("bench race-rank: start it through python -m flagcx_mesh.bench race", file=sys.stderr)
        return 2
    rank, nranks, uid = found
    boot = NetBootstrap(nranks, uid, rank, timeout=60.0)
    try:
        boot.barrier(timeout=60)
        progress = _Progress(args.trials * len(args.builders)) if rank == 0 else None
        result = {b: _run_builder(boot, b, i, args, progress) for i, b in enumerate(args.builders)}
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
    finally:
        boot.close()
    return 0


# ---------------------------------------------------------------- driver side

def _table(data: Dict[str, List[dict]], args: argparse.Namespace) -> dict:
    out = {"nranks": args.nranks, "trials": args.trials, "jitter_us": args.jitter_us,
           "timeout_s": args.timeout, "builders": {}}
    print(f"full-mesh race: {args.nranks} ranks, {args.trials} trials per builder, jitter 0..{args.jitter_us} us "
          f"per connect/accept step, deadline {args.timeout} s per build")
    print(f"  {'builder':<9}{'trials':>7}{'completed':>11}{'hung':>7}{'miswired':>10}{'failed':>8}"
          f"{'median ms':>11}")
    for b, trials in data.items():
        counts = {k: sum(1 for t in trials if t["outcome"] == k) for k in OUTCOMES}
        done = [t["seconds"] * 1e3 for t in trials if t["outcome"] == "completed"]
        med = statistics.median(done) if done else float("nan")
        out["builders"][b] = dict(counts, trials=len(trials), median_ms=med if done else None,
                                  first_error={k: next((t["error"] for t in trials if t["outcome"] == k), "")
                                               for k in OUTCOMES[1:] if counts[k]})
        print(f"  {b:<9}{len(trials):>7}{counts['completed']:>11}{counts['hung']:>7}{counts['miswired']:>10}"
              f"{counts['failed']:>8}{med:>11.2f}")
    print("  hung = a rank's build deadline expired (the hang is detected, not waited out); miswired = the "
          "wiring check found a slot holding another rank's connection; median over completed trials, "
          "slowest rank")
    for b, info in out["builders"].items():
        for kind, text in info["first_error"].items():
            print(f"  first {kind} ({b}): {text}")
    return out


def main(argv: List[str]) -> int:
    args = _parse(argv)
    rank_args = ["race-rank", "--trials", str(args.trials), "--jitter-us", str(args.jitter_us),
                 "--builders", ",".join(args.builders), "--timeout", str(args.timeout)]
    budget = 120 + args.trials * len(args.builders) * (args.timeout + 1.0)
    t0 = time.monotonic()
    data = run_ranks("race", rank_args, args.nranks, timeout=budget)
    if data is None:
        return 1
    out = _table(data, args)
    out["wall_s"] = time.monotonic() - t0
    print(f"  wall time {out['wall_s']:.1f} s")
    save_json(out, args.json)
    return 0
