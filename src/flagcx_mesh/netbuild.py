"""Full-mesh builds over a network adaptor with no identity on the wire.

FlagCX's IB adaptor hands out listen handles with a constant magic and one
FIFO accept queue per listener; its full-mesh loop can file a connection into
the wrong slot and then spin forever. The C++ core offers three builders
(``flagcx_mesh_net_build_full_mesh`` in the C ABI):

* ``legacy``  -- FlagCX's loop as shipped, plus a deadline that reports the hang;
* ``ordered`` -- pairwise rounds gated by a readiness token over the bootstrap;
* ``tagged``  -- every connection carries an identity header (needs isend/irecv).

This module runs them over the built-in test adaptor (loopback TCP with seeded
jitter) in one of its modes, for the self-test, the race bench and the tests:

* ``ib``        -- a connect completes once the peer accepted it (the 0.2 model);
* ``ib-strict`` -- as ``ib``, plus IB's NULL requests ("call again") and required
  memory registration;
* ``socket``    -- as FlagCX's socket adaptor: a connect completes before the peer
  accepts; ``socks_per_conn`` sockets per connection, accepted one at a time.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, List

from . import _core

BUILDERS = ("legacy", "ordered", "tagged")
MODES = ("ib", "ib-strict", "socket")
BOOTSTRAPS = ("own", "flagcx", "flagcx-noabort")
OUTCOMES = ("completed", "hung", "miswired", "failed")
DEFAULT_TAG_BASE = 0x6D780000

#: A rank's handle on flagcx_mesh's rendezvous with a point-to-point relay:
#: ``NetBootstrap(nranks, unique_id, rank, timeout)``, then ``barrier``,
#: ``allgather``, ``send(peer, tag, data)``, ``recv(peer, tag, timeout)``, ``close``.
NetBootstrap = _core.NetBootstrap


def build_trial(boot: Any, builder: str, *, jitter_us: int = 0, seed: int = 1, timeout: float = 10.0,
                carry_bytes: bool = True, self_connect_delay_us: int = 0, wiring_check: bool = True,
                tag_base: int = DEFAULT_TAG_BASE, verify: bool = True, fail_call: str = "",
                fail_after: int = 0, stranger: str = "", mode: str = "ib", socks_per_conn: int = 1,
                bootstrap: str = "own", fail_exits: bool = False) -> Dict[str, Any]:
    """One build over a fresh test adaptor; collective over ``boot`` (every rank calls it).

    Returns ``{"outcome", "code", "peer", "error", "seconds", "outputs_untouched",
    "verified"}`` where outcome is completed | hung (a deadline expired) |
    miswired (the wiring check saw another rank's connection) | failed.
    Raises :class:`flagcx_mesh.InvalidArgument` for bad arguments (e.g. the
    tagged builder without ``carry_bytes``). ``fail_call`` names an adaptor call
    (listen, connect, accept, isend, irecv, test) that fails on its
    ``fail_after + 1``-th use, to see how failures are reported. ``stranger``
    ("garbage" or "silent") makes each rank first open one more connection to its
    first peer that sends garbage or nothing, as a stranger's socket would.
    Results also count ``bad_closes`` (comms closed twice), ``left_open``, ``mr_left``
    (registrations never deregistered) and ``bad_deregs``.

    ``mode`` and ``socks_per_conn`` choose the test adaptor's behaviour (see the module
    docstring). ``bootstrap`` is ``"own"`` (``boot`` as it is), ``"flagcx"`` (``boot``
    wrapped like FlagCX's: recv has no deadline and never learns that a peer died, but
    has an abort hook; ``boot_aborted`` in the result says whether the build used it) or
    ``"flagcx-noabort"`` (the same without the hook: a lost peer blocks recv for ever).
    ``fail_exits`` makes the ``fail_call`` end the process instead (a rank that dies).
    """
    return _core.net_trial(boot, builder, jitter_us=jitter_us, seed=seed, timeout=timeout,
                           carry_bytes=carry_bytes, self_connect_delay_us=self_connect_delay_us,
                           wiring_check=wiring_check, tag_base=tag_base, verify=verify,
                           fail_call=fail_call, fail_after=fail_after, stranger=stranger, mode=mode,
                           socks_per_conn=socks_per_conn, bootstrap=bootstrap, fail_exits=fail_exits)


def aggregate(outcomes: Iterable[str]) -> str:
    """One trial's outcome over all ranks: any hung -> hung, else any miswired ->
    miswired, else any failed -> failed, else completed."""
    seen = set(outcomes)
    for kind in ("hung", "miswired", "failed"):
        if kind in seen:
            return kind
    return "completed"


def earliest_round_error(errors: List[str]) -> str:
    """Of several ranks' errors, the one naming the earliest round: where a hang began
    (the other ranks wait on that rank in later rounds). "" when there are none."""
    errors = [e for e in errors if e]
    if not errors:
        return ""
    rounds = [int(m.group(1)) if m else 1 << 30 for m in (re.search(r"round (\d+)", e) for e in errors)]
    return errors[rounds.index(min(rounds))]


if __name__ == "__main__":
    import sys

    from ._cli import library_module_main

    sys.exit(library_module_main("flagcx_mesh.netbuild", __doc__,
                                 "Its builds run through: python -m flagcx_mesh selftest --builder "
                                 "legacy|ordered|tagged, and python -m flagcx_mesh bench race."))
