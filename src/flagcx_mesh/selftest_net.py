"""The self-test's --builder mode: build the full mesh over the test adaptor
(loopback TCP shaped like FlagCX's IB adaptor, in its IB-strict mode: a
connect completes once the peer accepted it, NULL requests until the peer
posts, registration required) with the chosen builder, on every rank of the
launcher, and check the wiring.

legacy is FlagCX's loop as shipped. To reproduce its hang deterministically,
every rank but 0 delays the connect to its own listener (round 0), so rank
0's round-1 connection reaches rank 1's accept queue first, exactly the
interleaving that hangs in the field; the build deadline then reports it.
legacy is expected to FAIL; ordered and tagged are expected to PASS.
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any, Dict, List

from .netbuild import DEFAULT_TAG_BASE, NetBootstrap, aggregate, build_trial, earliest_round_error

#: Delay of the self-connect on ranks > 0 in legacy mode (forces the interleaving).
LEGACY_SELF_DELAY_US = 200_000
#: The test adaptor's mode (see flagcx_mesh.netbuild): IB's contract, as the one-sided path uses IB.
ADAPTOR_MODE = "ib-strict"


def _trials(boot: Any, args: Any) -> List[Dict[str, Any]]:
    out = []
    rank, n = boot.rank, boot.nranks
    delay = LEGACY_SELF_DELAY_US if args.builder == "legacy" and rank != 0 else 0
    for it in range(args.iterations):
        boot.barrier(timeout=60)
        r = build_trial(boot, args.builder, jitter_us=args.jitter_us, seed=it * 7919 + rank + 1,
                        timeout=args.timeout, self_connect_delay_us=delay,
                        tag_base=DEFAULT_TAG_BASE + it * (n + 1), mode=ADAPTOR_MODE)
        out.append(r)
    return out


def run_rank(rank: int, nranks: int, uid: bytes, args: Any) -> int:
    """One rank of the builder self-test; every rank returns the same status."""
    try:
        boot = NetBootstrap(nranks, uid, rank, timeout=60.0)
    except Exception as e:  # noqa: BLE001 - reported, then exits non-zero
        print(f"flagcx_mesh selftest FAILED: rank {rank}: bootstrap: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        return 1
    try:
        mine = _trials(boot, args)
        parts = [json.loads(p) for p in boot.allgather(json.dumps(mine).encode(), timeout=60)]
    except Exception as e:  # noqa: BLE001
        print(f"flagcx_mesh selftest FAILED: rank {rank}, builder {args.builder}: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        boot.close()
    outcomes = [aggregate(p[it]["outcome"] for p in parts) for it in range(args.iterations)]
    if rank == 0:
        _report(parts, outcomes, args)
    return 0 if all(o == "completed" for o in outcomes) else 1


def _first_error(parts: List[List[Dict[str, Any]]], it: int, kind: str) -> str:
    """The error of the rank that failed in the earliest round: where the hang began."""
    return earliest_round_error([p[it]["error"] for p in parts if p[it]["outcome"] == kind])


def _report(parts: List[List[Dict[str, Any]]], outcomes: List[str], args: Any) -> None:
    n, k, b = len(parts), args.iterations, args.builder
    print(f"flagcx_mesh selftest: builder {b} over the test adaptor (loopback TCP, {ADAPTOR_MODE}), "
          f"{n} ranks, {k} build(s), jitter {args.jitter_us} us, deadline {args.timeout} s")
    for it, o in enumerate(outcomes):
        slowest = max(p[it]["seconds"] for p in parts) * 1e3
        ranks = [r for r, p in enumerate(parts) if p[it]["outcome"] != "completed"]
        print(f"  build {it}: {o}; slowest rank {slowest:.1f} ms" + (f"; ranks not completed: {ranks}" if ranks else ""))
        if o != "completed":
            print(f"    {_first_error(parts, it, o)}")
    if all(o == "completed" for o in outcomes):
        verified = all(p[it]["verified"] for p in parts for it in range(k))
        med = statistics.median(max(p[it]["seconds"] for p in parts) for it in range(k)) * 1e3
        print(f"PASS: {k} mesh(es) built with the {b} builder; every slot proved to hold its peer's "
              f"connection{'' if verified else ' (build-time check only)'}; median build {med:.1f} ms", flush=True)
    elif b == "legacy" and "hung" in outcomes:
        print(f"FAIL (expected): the legacy builder (FlagCX's loop) reproduced the known full-mesh hang "
              f"in {outcomes.count('hung')} of {k} build(s); the deadline detected it and named the round "
              f"and peers above (without the deadline it spins forever). Use --builder ordered or tagged.",
              flush=True)
    else:
        print(f"FAIL: builder {b}: outcomes {outcomes}", flush=True)


if __name__ == "__main__":
    from ._cli import library_module_main

    sys.exit(library_module_main("flagcx_mesh.selftest_net", __doc__,
                                 "It runs through: python -m flagcx_mesh selftest --builder legacy|ordered|tagged."))
