"""The core's block reads (agent/block_pull.h, ``_core._BlockPuller``): a request's reads made from
its block ids by the tables a KV connector builds once (``_BlockRows``), run on the puller's own
thread. Every byte lands where its rows say; the peer gets the read's ``on_landed`` notification
once the bytes landed, its ``on_failed`` one (and no other) when the read is refused (block ids out
of range, a region of another agent); a cancel of a token with no read out is not kept; the outcome
says the read's ops and bytes; wait() returns on an outcome or a wake(), not only at its timeout;
after close() a submit is refused and queued reads fail; reads held in flight by the fake CUDA
driver (no outcome, no ack until they landed; cancel and close while they copy). A push's answer
awaited (``await_answer``): taken by the core as it comes (before the await too), acked and
posted, other notifications left to the reader; forgotten (no outcome); cancelled (posted when it
comes, no ack); failed at its timeout, when its peer leaves, and at close (once each)."""

import array
import os
import time

import pytest

import fakecuda
import gpujobs
from flagcx_mesh import Agent, MeshClosed, _core
from meshutil import finish_prog, spawn_prog

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.timeout(60)

BLOCK, BLOCKS = 256, 64  # one layer of 64 blocks of 256 bytes on each side


@pytest.fixture
def pair():
    with Agent("pull-reader", "s", timeout=20) as reader, Agent("pull-owner", "s", timeout=20) as owner:
        mine = bytearray(BLOCK * BLOCKS)
        theirs = bytearray(bytes((i * 7 + i // BLOCK) % 256 for i in range(BLOCK * BLOCKS)))
        local, remote = reader.register(mine), owner.register(theirs)
        conn = reader.connect(owner.metadata())
        owner.connect(reader.metadata())  # (answers its notifications' waits)
        puller = _core._BlockPuller(reader._core)
        yield puller, conn, owner, (mine, local), (theirs, remote)
        puller.close()


def table():  # local region 0 and remote region 0, one run a block: dense, as one KV layer is
    return _core._BlockRows([(0, BLOCK, 0, BLOCK)], [0], [0], BLOCK, True, BLOCKS, BLOCKS)


def ids(v):
    return array.array("q", v)


def outcomes(puller, n, timeout=20.0, take=None):
    """The first ``n`` outcomes the puller posts (no more: what one take() brings beyond them fails);
    ``take``: another of its queues (take_served)."""
    take = take or puller.take
    got, end = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < end:
        seen = puller.seq()
        got += take()
        if len(got) < n:
            puller.wait(seen, end - time.monotonic())
    assert len(got) == n, got
    return got


def outcome(puller, timeout=20.0):
    return outcomes(puller, 1, timeout)[0]


def notes(owner, timeout=5.0):
    """The notifications that reach the owner within ``timeout`` (all of them, then none for 0.2 s)."""
    got, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        more = [bytes(n.data) for n in owner.notifications(timeout=0.2)]
        if not more and got:
            break
        got += more
    return got


def submit(puller, conn, local, remote, mine_ids, their_ids, token=1):
    puller.submit(token, conn._core, [local], [remote], [([table()], ids(mine_ids), ids(their_ids))],
                  b"landed", b"failed")


def test_a_read_lands_its_blocks_and_then_acks(pair):
    puller, conn, owner, (mine, local), (theirs, remote) = pair
    mine_ids, their_ids = [5, 6, 40, 2], [9, 10, 11, 63]  # 5, 6 <- 9, 10 merge into one op
    submit(puller, conn, local, remote, mine_ids, their_ids, token=7)
    assert outcome(puller)[:5] == (7, "", 3, 4 * BLOCK, False)
    for m, t in zip(mine_ids, their_ids):
        assert mine[m * BLOCK:(m + 1) * BLOCK] == theirs[t * BLOCK:(t + 1) * BLOCK]
    untouched = set(range(BLOCKS)) - set(mine_ids)
    assert all(mine[b * BLOCK:(b + 1) * BLOCK] == bytes(BLOCK) for b in untouched)
    assert notes(owner) == [b"landed"]


def test_block_ids_out_of_range_fail_the_read_and_send_the_release_only(pair):
    puller, conn, owner, (mine, local), (_, remote) = pair
    submit(puller, conn, local, remote, [1, 2], [3, BLOCKS])
    token, error, ops, nbytes, cancelled, _ = outcome(puller)
    assert (token, ops, nbytes, cancelled) == (1, 0, 0, False) and "out of its layers' range" in error
    assert mine == bytearray(BLOCK * BLOCKS) and notes(owner) == [b"failed"]


def test_a_read_the_owner_refuses_fails_and_sends_the_release(pair):
    puller, conn, owner, (mine, local), _ = pair
    submit(puller, conn, local, local, [1], [2])  # "the owner's" region is the reader's own
    _, error, _, _, _, _ = outcome(puller)
    assert error and "pull-reader" in error, error  # names the agent whose region it is
    assert mine == bytearray(BLOCK * BLOCKS) and notes(owner) == [b"failed"]


def test_a_cancel_of_a_token_with_no_read_out_is_not_kept(pair):
    """cancel() names reads submitted whose outcome is not posted yet (tests/block_pull_prog.py
    cancels one in flight): one of a token not submitted (or already posted) is dropped, so a
    later read of that token acks as any other, and nothing piles up."""
    puller, conn, owner, (mine, local), (theirs, remote) = pair
    puller.cancel(3)
    submit(puller, conn, local, remote, [0], [1], token=3)
    assert outcome(puller)[:5] == (3, "", 1, BLOCK, False)
    assert mine[:BLOCK] == theirs[BLOCK:2 * BLOCK]
    assert notes(owner) == [b"landed"]


def test_wait_returns_on_a_wake_and_close_refuses_later_reads(pair):
    puller, conn, _, (_, local), (_, remote) = pair
    seen = puller.seq()
    puller.wait(seen, 0.01)  # nothing: returns at its timeout
    puller.wake()
    t0 = time.monotonic()
    puller.wait(seen, 30.0)  # the wake moved seq past `seen`: at once
    assert time.monotonic() - t0 < 10.0 and puller.take() == []
    puller.close()
    with pytest.raises(MeshClosed):
        submit(puller, conn, local, remote, [0], [1])


def test_every_read_submitted_has_one_outcome_when_closed_at_once(pair):
    """Reads queued when close() comes fail ("closed before ... issued"); those issued land: each
    of them has exactly one outcome, none is lost in the hand-over between the caller and the
    puller's thread."""
    puller, conn, _, (_, local), (_, remote) = pair
    for token in range(1, 201):
        submit(puller, conn, local, remote, [token % BLOCKS], [token % BLOCKS], token=token)
    puller.close()
    got = puller.take()
    assert sorted(o[0] for o in got) == list(range(1, 201)), len(got)
    assert all(o[1] == "" or "closed" in o[1] for o in got), {o[1] for o in got}


@pytest.mark.parametrize("scenario", ["lands", "cancel", "close"])
def test_a_read_in_flight(scenario):
    """A device read held in flight (the fake driver's copies from device memory take 1.5 s):
    no outcome and no ack before it landed; a cancel while it copies keeps the ack from going; a
    close while it copies posts its outcome at once and sends the release (tests/block_pull_prog.py)."""
    env = gpujobs.job_env(fakecuda.env(), ("FLAGCX_MESH_CUDA_PATH",), FXM_FAKECUDA_COPY_FROM_DEVICE_DELAY_MS=1500)
    p = spawn_prog(os.path.join(HERE, "block_pull_prog.py"), scenario, env=env, cwd=HERE)
    finish_prog(p, timeout=60, what=scenario, ok=f"{scenario} ok")


# ---- a push's answer awaited (await_answer) ------------------------------------------------


@pytest.fixture
def answers():
    """(puller, the reader's connection, the reader, the owner's connection back to it, the owner)."""
    with Agent("pull-reader", "s", timeout=20) as reader, Agent("pull-owner", "s", timeout=20) as owner:
        conn = reader.connect(owner.metadata())
        back = owner.connect(reader.metadata())
        puller = _core._BlockPuller(reader._core)
        yield puller, conn, reader, back, owner
        puller.close()


def test_an_answer_awaited_is_taken_by_the_core_acked_and_posted(answers):
    """The peer's notification of exactly the answer's bytes is consumed (notifications() never
    sees it), the ack goes to the peer, the outcome is posted with no op; another notification of
    the peer (its bytes not the answer's) still reaches notifications()."""
    puller, conn, reader, back, owner = answers
    puller.await_answer(4, conn._core, b"done-4", b"ack-4", 20.0)
    back.notify(b"done-3")  # not the answer: the reader's own
    back.notify(b"done-4")
    assert outcome(puller)[:5] == (4, "", 0, 0, False)
    assert notes(owner) == [b"ack-4"]
    assert notes(reader) == [b"done-3"]


def test_an_answer_that_came_before_it_was_awaited_is_taken(answers):
    puller, conn, reader, back, owner = answers
    back.notify(b"done-1")
    time.sleep(0.5)  # it lands, unread
    puller.await_answer(1, conn._core, b"done-1", b"ack-1", 20.0)
    assert outcome(puller)[:5] == (1, "", 0, 0, False)
    assert notes(owner) == [b"ack-1"] and notes(reader, 0.5) == []


def test_an_answer_that_came_is_posted_though_its_ack_cannot_go(answers):
    """The answer says the bytes landed: its peer gone before the ack could go (it left right after
    answering), the outcome is still a success (it failed before the mend)."""
    puller, conn, reader, back, owner = answers
    back.notify(b"done-4")
    owner.close()
    time.sleep(0.5)
    puller.await_answer(4, conn._core, b"done-4", b"ack-4", 20.0)
    assert outcome(puller)[:5] == (4, "", 0, 0, False)


def test_a_forgotten_answer_posts_nothing_and_its_notification_is_the_reader_s(answers):
    puller, conn, reader, back, owner = answers
    puller.await_answer(2, conn._core, b"done-2", b"ack-2", 20.0)
    puller.forget(2)
    back.notify(b"done-2")
    assert notes(reader) == [b"done-2"]
    assert puller.take() == [] and notes(owner, 0.5) == []


def test_a_cancelled_answer_is_posted_when_it_comes_without_its_ack(answers):
    """A cancel does not end the wait (a push's bytes may land until its answer): the outcome
    comes with the answer, says cancelled, and no ack goes."""
    puller, conn, reader, back, owner = answers
    puller.await_answer(5, conn._core, b"done-5", b"ack-5", 20.0)
    puller.cancel(5)
    time.sleep(0.2)
    assert puller.take() == []
    back.notify(b"done-5")
    assert outcome(puller)[:5] == (5, "", 0, 0, True)
    assert notes(owner, 0.5) == []


def test_an_answer_fails_at_its_timeout_when_its_peer_leaves_and_at_close(answers):
    puller, conn, reader, back, owner = answers
    t0 = time.monotonic()
    puller.await_answer(6, conn._core, b"done-6", b"ack-6", 0.5)
    token, error, *_ = outcome(puller)
    assert token == 6 and "did not arrive" in error and time.monotonic() - t0 < 10, error
    puller.await_answer(7, conn._core, b"done-7", b"ack-7", 30.0)
    puller.await_answer(8, conn._core, b"done-8", b"ack-8", 30.0)
    t0 = time.monotonic()
    owner.close()  # its connection ends: 7 and 8 fail now, not at their timeout
    got = sorted(outcomes(puller, 2))
    assert [o[0] for o in got] == [7, 8] and all("gone" in o[1] for o in got), got
    assert time.monotonic() - t0 < 20
    puller.close()
    with pytest.raises(MeshClosed):
        puller.await_answer(9, conn._core, b"done-9", b"ack-9", 30.0)


def test_answers_awaited_at_close_fail_once_each(answers):
    puller, conn, reader, back, owner = answers
    for token in range(1, 51):
        puller.await_answer(token, conn._core, b"done-%d" % token, b"ack", 30.0)
    back.notify(b"done-7")
    puller.close()
    got = puller.take()
    assert sorted(o[0] for o in got) == list(range(1, 51)), got
    assert all(o[1] == "" or "closed" in o[1] for o in got), {o[1] for o in got}
