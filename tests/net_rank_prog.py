"""One rank of a net-adaptor build in its own process, for the killed-rank tests:

    python net_rank_prog.py UID_HEX RANK NRANKS BUILDER BOOTSTRAP DIE_RANK TIMEOUT

Rank DIE_RANK exits (code 86) inside the build, at its first adaptor connect (ORDERED: round 0,
before any readiness token went out). Every other rank prints its trial result as one JSON line."""

import json
import sys

from flagcx_mesh.netbuild import NetBootstrap, build_trial


def main() -> int:
    uid, rank, n, builder, bootstrap, die_rank, timeout = sys.argv[1:8]
    rank, n, die_rank, timeout = int(rank), int(n), int(die_rank), float(timeout)
    boot = NetBootstrap(n, bytes.fromhex(uid), rank, 30.0)
    try:
        boot.barrier(timeout=30)
        dies = rank == die_rank
        res = build_trial(boot, builder, timeout=timeout, mode="ib-strict", bootstrap=bootstrap,
                          fail_call="connect" if dies else "", fail_after=0, fail_exits=dies)
        # The dying rank exits inside its build: reaching here means the fault never fired.
        assert not dies, f"rank {rank} was to exit at its first connect but its build returned {res}"
        print(json.dumps(res), flush=True)
    finally:
        boot.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
