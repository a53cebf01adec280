"""Ops as a table (AgentConnection.write_blocks / read_blocks): one request's KV blocks read from
an (n, 5) or (n, 3) array of 64-bit integers in C++, no Python object per op. Every byte of
batches of 1 to 100,000 ops of mixed sizes lands where its row says, over several regions on each
side, from numpy arrays (int64, uint64, strided views) and CPU torch tensors; reads too; a bad
table (type, shape, dtype, a negative cell, an index naming no region, a block crossing its
region's end) is refused with InvalidArgument naming the row as `op N`, before any byte moves."""

import numpy as np
import pytest

from flagcx_mesh import Agent, InvalidArgument

pytestmark = pytest.mark.timeout(120)

SIZE = 1 << 20


@pytest.fixture
def pair():
    with Agent("blocks-a", "s", timeout=30) as a, Agent("blocks-b", "s", timeout=30) as b:
        src = [bytearray(np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8).tobytes()) for i in range(3)]
        dst = [bytearray(SIZE) for _ in range(2)]
        mine = [a.register(x) for x in src]
        theirs = [b.register(x) for x in dst]
        yield a.connect(b.metadata()), src, dst, mine, theirs


def random_table(rng, n, nlocal, nremote, max_size):
    """n rows of random sizes, each into a slot of its own (max_size bytes) of a remote region, in
    shuffled order, from random local places: the result does not depend on the rows' order."""
    assert n * max_size <= nremote * SIZE
    sizes = rng.integers(1, max_size + 1, n)
    slot = rng.permutation(n)
    t = np.zeros((n, 5), dtype=np.int64)
    t[:, 0] = rng.integers(0, nlocal, n)
    t[:, 1] = rng.integers(0, SIZE - sizes + 1)
    t[:, 2] = slot % nremote
    t[:, 3] = slot // nremote * max_size
    t[:, 4] = sizes
    return t


def expected(src, dst_sizes, t):
    out = [bytearray(n) for n in dst_sizes]
    for li, lo, ri, ro, n in t.tolist():
        out[ri][ro:ro + n] = src[li][lo:lo + n]
    return out


@pytest.mark.parametrize("n,max_size", [(1, 4096), (7, 65536), (4096, 256), (100_000, 16)])
def test_every_byte_of_a_table_lands(pair, n, max_size):
    conn, src, dst, mine, theirs = pair
    t = random_table(np.random.default_rng(n), n, 3, 2, max_size)
    conn.write_blocks(mine, theirs, t).wait(60)
    want = expected(src, [SIZE, SIZE], t)
    assert [bytes(d) for d in dst] == [bytes(w) for w in want]


def test_reads_a_table_and_takes_uint64_strided_and_torch_tables(pair):
    conn, src, dst, mine, theirs = pair
    rng = np.random.default_rng(5)
    for i, d in enumerate(dst):
        d[:] = src[i]
    t = np.zeros((300, 3), dtype=np.uint64)
    t[:, 0] = np.arange(300) * 1000  # local bytes, read from remote region 0 at shuffled places
    t[:, 1] = rng.permutation(300) * 1000
    t[:, 2] = 1000
    conn.read_blocks(mine[2], theirs[0], t).wait(30)
    got = bytes(src[2])
    for lo, ro, n in t.tolist():
        assert got[lo:lo + n] == bytes(src[0][ro:ro + n])
    wide = np.zeros((50, 8), dtype=np.int64)  # a strided view: columns 1..5 of a wider array
    wide[:, 2] = np.arange(50) * 64
    wide[:, 4] = np.arange(50)[::-1] * 64
    wide[:, 5] = 64
    view = wide[:, 1:6]
    assert not view.flags["C_CONTIGUOUS"]
    conn.write_blocks(mine, theirs, view).wait(30)
    for i in range(50):
        assert dst[0][(49 - i) * 64:(50 - i) * 64] == src[0][i * 64:(i + 1) * 64]
    torch = pytest.importorskip("torch")
    tt = torch.tensor([[0, 0, 1, 4096, 128]], dtype=torch.int64)
    conn.write_blocks(mine, theirs, tt).wait(30)
    assert dst[1][4096:4096 + 128] == src[0][:128]


@pytest.mark.parametrize("table,match", [
    ([[0, 0, 0, 0, 16]], r"^table must be an array .*not list"),
    (np.zeros((4, 5), dtype=np.float64), r"^table must be an \(n, 5\) or \(n, 3\) array of 64-bit integers"),
    (np.zeros((4, 5), dtype=np.int32), r"^table must be an \(n, 5\) or \(n, 3\) array of 64-bit integers"),
    (np.zeros((4, 4), dtype=np.int64), r"4 columns"),
    (np.zeros(5, dtype=np.int64), r"1 dimension"),
    (np.array([[0, 0, 0, 0, 16], [0, 0, 0, -16, 16]]), r"^op 1: remote offset is negative \(-16\)"),
    (np.array([[0, 0, 0, 0, 16], [0, 0, 0, 0, 16], [3, 0, 0, 0, 16]]), r"^op 2: local index 3 names no region \(3 given\)"),
    (np.array([[0, 0, 2, 0, 16]]), r"^op 0: remote index 2 names no region \(2 given\)"),
    (np.array([[0, 0, 0, 0, 16], [1, 0, 1, SIZE - 8, 16]]), r"write op 1 of 16 bytes at remote .*out of range"),
    (np.array([[0, SIZE - 8, 0, 0, 16], [1, 0, 1, 0, 16]]), r"write op 0 of 16 bytes at local .*out of range"),
], ids=["list", "float", "int32", "4-columns", "1-d", "negative", "local-index", "remote-index", "remote-end",
        "local-end"])
def test_a_bad_table_is_refused_naming_the_row_and_nothing_moves(pair, table, match):
    conn, src, dst, mine, theirs = pair
    with pytest.raises(InvalidArgument, match=match):
        conn.write_blocks(mine, theirs, table)
    assert dst[0] == bytearray(SIZE) and dst[1] == bytearray(SIZE)
    conn.write_blocks(mine, theirs, np.array([[0, 0, 0, 0, 16]])).wait(10)  # the connection still works
    assert dst[0][:16] == src[0][:16]


def test_three_columns_need_one_region_each(pair):
    conn, src, dst, mine, theirs = pair
    with pytest.raises(InvalidArgument, match=r"a table of 3 columns names one local and one remote region"):
        conn.write_blocks(mine, theirs[0], np.array([[0, 0, 16]]))
    with pytest.raises(InvalidArgument, match=r"^local\[1\] must be a Region or descriptor bytes"):
        conn.write_blocks([mine[0], 5], theirs, np.array([[0, 0, 0, 0, 16]]))
