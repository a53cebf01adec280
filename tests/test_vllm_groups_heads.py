"""The vLLM connector's maps without vLLM or torch: a request's block ids per KV cache group
(flagcx_mesh.vllm.groups: hybrid models, sliding windows) and which prefill rank a decode rank
takes each KV head from (flagcx_mesh.vllm.heads: another tensor-parallel size, replicated heads)."""

import itertools

import pytest

from flagcx_mesh.vllm import groups, heads

WHOLE = (0, 1, 0, 1)


def test_block_ids_of_one_group_stay_a_flat_list_on_the_wire():
    assert groups.as_groups([3, 4]) == [[3, 4]] and groups.to_wire([[3, 4]]) == [3, 4]
    assert groups.as_groups(([3, 4], [5])) == [[3, 4], [5]] and groups.to_wire([[3, 4], [5]]) == [[3, 4], [5]]
    assert groups.as_groups([]) == [[]] and groups.flat([[1], [], [2, 3]]) == [1, 2, 3]
    with pytest.raises(ValueError, match="list of lists"):
        groups.as_groups([1, [2]])


def test_a_sliding_window_group_keeps_its_window_less_the_null_blocks():
    assert groups.window_blocks(0, 16) == 0
    assert groups.window_blocks(32, 16) == 3 and groups.window_blocks(33, 16) == 4  # cdiv + 1, as NIXL
    held = [[1, 2, 3, 4, 5], [0, 0, 7, 8, 9]]
    assert groups.clip_to_windows(held, [0, 3]) == [[1, 2, 3, 4, 5], [7, 8, 9]]
    assert groups.clip_to_windows(held, [0, 4]) == [[1, 2, 3, 4, 5], [7, 8, 9]]  # the null block (0) is not sent
    assert groups.clip_to_windows([[0, 6]], [0]) == [[0, 6]]  # a full-attention group: untouched
    with pytest.raises(ValueError, match="groups"):
        groups.clip_to_windows(held, [0])


def test_a_decode_receives_a_sliding_window_group_into_its_tail_blocks():
    local = [[11, 12, 13], [21, 22, 23]]
    remote = [[1, 2, 3, 4], [8, 9]]
    assert groups.pair_with_remote(local, remote, [0, 3]) == [[11, 12, 13], [22, 23]]
    assert groups.pair_with_remote([[11], [21]], remote, [0, 3]) == [[11], [21]]
    assert groups.split([1, 2, 3], [2, 0, 1]) == [[1, 2], [], [3]]
    with pytest.raises(ValueError, match="do not split"):
        groups.split([1, 2, 3], [2, 2])


def holds(rank, tp, kv_heads):
    """The model's KV heads rank ``rank`` of ``tp`` holds, as vLLM splits them (written out here,
    not taken from the module under test)."""
    if tp <= kv_heads:
        n = kv_heads // tp
        return list(range(rank * n, rank * n + n))
    return [rank * kv_heads // tp]


def assemble(rank, tp, prefill_tp, kv_heads):
    """The heads decode rank ``rank`` ends with, taking each part of what its sources hold."""
    got = [None] * len(holds(rank, tp, kv_heads))
    for p, (si, sn, di, dn) in heads.prefill_sources(rank, tp, prefill_tp, kv_heads):
        src = holds(p, prefill_tp, kv_heads)
        piece = src[si * len(src) // sn:(si + 1) * len(src) // sn]
        n = len(got) // dn
        assert len(piece) == n, (rank, p, si, sn, di, dn)
        got[di * n:(di + 1) * n] = piece
    return got


SIZES = (1, 2, 4, 8)


@pytest.mark.parametrize("kv_heads", SIZES)
def test_every_decode_rank_gets_exactly_its_heads_and_every_prefill_rank_is_read_or_released(kv_heads):
    for prefill_tp, tp in itertools.product(SIZES, SIZES):
        for rank in range(tp):
            assert assemble(rank, tp, prefill_tp, kv_heads) == holds(rank, tp, kv_heads), (prefill_tp, tp, rank)
        told = [p for rank in range(tp) for p in heads.ranks_to_release(rank, tp, prefill_tp, kv_heads)]
        read = {p for rank in range(tp) for p, _ in heads.prefill_sources(rank, tp, prefill_tp, kv_heads)}
        assert sorted(told) == sorted(set(range(prefill_tp)) - read), (prefill_tp, tp)  # each once
        for p in range(prefill_tp):
            readers = sum(p in {q for q, _ in heads.prefill_sources(r, tp, prefill_tp, kv_heads)} for r in range(tp))
            assert heads.readers(p, tp, prefill_tp, kv_heads) == readers


def test_replicated_heads_are_taken_whole_from_one_replica():
    # 1 KV head, decode at TP 2: both ranks take prefill rank 0's block whole; it has 2 readers
    assert [heads.prefill_sources(r, 2, 1, 1) for r in range(2)] == [[(0, WHOLE)], [(0, WHOLE)]]
    assert heads.readers(0, 2, 1, 1) == 2
    # 1 KV head, prefill at TP 2: the decode reads rank 0 and tells rank 1 to release
    assert heads.prefill_sources(0, 1, 2, 1) == [(0, WHOLE)] and heads.ranks_to_release(0, 1, 2, 1) == [1]
    # 4 heads at TP 8 on both sides: each rank its own replica
    assert [heads.prefill_sources(r, 8, 8, 4)[0][0] for r in range(8)] == list(range(8))
    # 2 heads: prefill TP 1 (both heads) into decode TP 4 (heads 0, 0, 1, 1)
    assert [heads.prefill_sources(r, 4, 1, 2) for r in range(4)] == [[(0, (h, 2, 0, 1))] for h in (0, 0, 1, 1)]


def test_without_the_head_count_the_map_is_the_tensor_parallel_ratio():
    assert heads.prefill_sources(3, 4, 2, None) == [(1, (1, 2, 0, 1))]
    assert heads.prefill_sources(1, 2, 4, None) == [(2, (0, 1, 0, 2)), (3, (0, 1, 1, 2))]
    assert heads.prefill_sources(1, 2, 2, None) == [(1, WHOLE)]


def test_sizes_whose_heads_do_not_divide_are_refused_naming_both():
    with pytest.raises(ValueError, match="tensor parallelism 2 on the prefill and 3 here"):
        heads.prefill_sources(0, 3, 2, None)
    with pytest.raises(ValueError, match="3 KV heads"):
        heads.prefill_sources(0, 2, 1, 3)
