"""Reads of the core's puller (agent/block_pull.h) held in flight by the fake CUDA driver: two
agents of this process on fake device memory (cuda-self), every copy from device memory taking
FXM_FAKECUDA_COPY_FROM_DEVICE_DELAY_MS (tests/test_agent_block_pull.py sets it). One scenario a
process; prints "<scenario> ok" when every check passed.

    lands    no outcome while the read copies, then the bytes, its outcome, and only then the ack
    cancel   cancelled while it copies: it lands, its outcome says cancelled, no ack goes
    close    closed while it copies: its outcome says so at once, the release goes
"""

import array
import sys
import time

import fakecuda

cuda = fakecuda.use_in_this_process()

from flagcx_mesh import Agent, _core  # noqa: E402

BLOCK, BLOCKS = 4096, 16


def notes(owner, seconds):
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        got += [bytes(n.data) for n in owner.notifications(timeout=0.05)]
    return got


def outcome(puller, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seen = puller.seq()
        got = puller.take()
        if got:
            return got
        puller.wait(seen, end - time.monotonic())
    return []


def main(scenario: str) -> None:
    with Agent("prog-reader", "s", timeout=20) as reader, Agent("prog-owner", "s", timeout=20) as owner:
        mine, theirs = fakecuda.DeviceBuffer(BLOCK * BLOCKS), fakecuda.DeviceBuffer(BLOCK * BLOCKS)
        theirs.write(bytes(i % 251 for i in range(BLOCK * BLOCKS)))
        local, remote = reader.register(mine), owner.register(theirs)
        conn = reader.connect(owner.metadata())
        owner.connect(reader.metadata())
        path = conn.path_to(remote.descriptor, local.descriptor)
        assert path == "cuda-self", path
        rows = _core._BlockRows([(0, BLOCK, 0, BLOCK)], [0], [0], BLOCK, True, BLOCKS, BLOCKS)  # one op: one held copy
        ids = array.array("q", range(BLOCKS))
        puller = _core._BlockPuller(reader._core)
        puller.submit(1, conn._core, [local], [remote], [([rows], ids, ids)], b"landed", b"failed")
        early = outcome(puller, 0.3)
        assert early == [], f"an outcome while the copies are held: {early}"
        if scenario == "lands":
            assert notes(owner, 0.2) == [], "an ack before the read landed"
            got = outcome(puller, 20)
            assert [g[:5] for g in got] == [(1, "", 1, BLOCK * BLOCKS, False)], got
            assert mine.read() == theirs.read(), "the bytes"
            assert notes(owner, 1.0) == [b"landed"]
        elif scenario == "cancel":
            puller.cancel(1)
            got = outcome(puller, 20)
            assert [g[:5] for g in got] == [(1, "", 1, BLOCK * BLOCKS, True)], got
            assert mine.read() == theirs.read(), "the bytes"
            assert notes(owner, 1.0) == [], "an ack of a cancelled read"
        elif scenario == "close":
            t0 = time.monotonic()
            puller.close()
            got = puller.take()
            assert len(got) == 1 and "closed with this read in flight" in got[0][1], got
            assert time.monotonic() - t0 < 1.0, "close() waited for the read"
            assert notes(owner, 1.0) == [b"failed"]
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        time.sleep(2)  # (the held copies end before the buffers go)
        puller.close()
    print(f"{scenario} ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
