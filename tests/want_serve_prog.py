"""Pushes of wants served by the core (agent/want_server.h) held in flight by the fake CUDA driver:
a decode and a prefill agent of this process on fake device memory (cuda-self), every copy from
device memory taking FXM_FAKECUDA_COPY_FROM_DEVICE_DELAY_MS (tests/test_agent_want_serve.py sets
it to 1.5 s). One scenario a process; prints "<scenario> ok" when every check passed.

    late      its offer's timeout (0.3 s) passes while it copies: one late event, then it lands,
              ended without error, the answer after it; a stream wait beside the claim works
    withdraw  withdrawn while it copies: withdraw() counts it, a later want is handed back, it
              still ends (and in_flight drops to 0)
    close     the puller closed while it copies: one ended event saying so, at once; no answer
"""

import array
import sys
import time

import fakecuda

cuda = fakecuda.use_in_this_process()

from flagcx_mesh import Agent, _core  # noqa: E402

BLOCK, BLOCKS = 4096, 16
PART = (0, 1, 0, 1)
STARTED, ENDED, LATE = 1, 2, 3


def events(puller, seconds, until=None):
    """Served events for `seconds`, or until one of kind `until` came."""
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        seen = puller.seq()
        got += puller.take_served()
        if until is not None and any(e[2] == until for e in got):
            break
        puller.wait(seen, min(0.05, end - time.monotonic()))
    return got


def notes(agent, seconds):
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        got += [bytes(n.data) for n in agent.notifications(timeout=0.05)]
    return got


def want(answer=b"D-1"):
    return _core._encode_want("req-1", answer, PART, 0, [BLOCKS], array.array("q", range(BLOCKS)))


def main(scenario: str) -> None:
    with Agent("prog-decode", "s", timeout=20) as decode, Agent("prog-prefill", "s", timeout=20) as prefill:
        mine, theirs = fakecuda.DeviceBuffer(BLOCK * BLOCKS), fakecuda.DeviceBuffer(BLOCK * BLOCKS)
        theirs.write(bytes(i % 251 for i in range(BLOCK * BLOCKS)))
        local, remote = decode.register(mine), prefill.register(theirs)
        conn = decode.connect(prefill.metadata())
        back = prefill.connect(decode.metadata())
        rows = _core._BlockRows([(0, BLOCK, 0, BLOCK)], [0], [0], BLOCK, True, BLOCKS, BLOCKS)  # one op: one held copy
        puller = _core._BlockPuller(prefill._core)
        puller.serve_wants(True)
        puller.serve_layout(back._core, PART, [remote], [local], [[rows]])
        puller.offer(1, "req-1", [array.array("q", range(BLOCKS))], 0.3)
        conn.notify(want())
        got = events(puller, 1.0, until=STARTED)
        assert [e[:3] for e in got] == [(1, 1, STARTED)], got
        assert back.path_to(local.descriptor, remote.descriptor) == "cuda-self"
        if scenario == "late":
            wait = prefill.stream_wait_notification(b"go", 0, peer="prog-decode", timeout=10)
            conn.notify(b"go")
            wait.wait(10)
            got = events(puller, 1.0, until=LATE)
            assert [e[2] for e in got] == [LATE], got
            assert notes(decode, 0.1) == [], "an answer before the push landed"
            got = events(puller, 20, until=ENDED)
            assert [e[:3] + (e[8],) for e in got] == [(1, 1, ENDED, "")], got
            assert mine.read() == theirs.read(), "the bytes"
            assert notes(decode, 1.0) == [b"D-1"]
            assert puller.take_served() == [], "a second late or ended"
        elif scenario == "withdraw":
            assert puller.withdraw(1) == 1 and puller.in_flight(1) == 1
            conn.notify(want(b"D-2"))
            assert [bytes(n.data) for n in prefill.notifications(timeout=5.0)] == [want(b"D-2")]
            got = events(puller, 20, until=ENDED)
            assert [e[2] for e in got if e[2] != LATE] == [ENDED] and got[-1][8] == "", got
            assert puller.in_flight(1) == 0
            assert notes(decode, 1.0) == [b"D-1"]
        elif scenario == "close":
            t0 = time.monotonic()
            puller.close()
            got = puller.take_served()
            assert [e[:3] for e in got] == [(1, 1, ENDED)] and "closed with this push in flight" in got[0][8], got
            assert time.monotonic() - t0 < 1.0, "close() waited for the push"
            assert puller.in_flight(1) == 0
            assert notes(decode, 2.0) == [], "an answer of a push closed in flight"
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        time.sleep(2)  # (the held copies end before the buffers go)
        puller.close()
    print(f"{scenario} ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
