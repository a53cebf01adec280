"""Which tensor-parallel rank holds which KV heads, and where a decode rank takes its heads from.

vLLM splits a model's ``kv_heads`` KV heads over ``tp`` ranks: ``kv_heads / tp`` each where
``tp`` divides them, and where ``tp`` is larger, one head each, every head replicated on
``tp / kv_heads`` consecutive ranks (rank r holds head ``r // (tp / kv_heads)``). A decode
rank takes each of its heads from one prefill rank that holds it: a slice of that rank's
heads, or all of them into a slice of its own (as NixlConnector maps them); among replicas,
decode rank r takes replica ``r % replicas``. Prefill ranks no decode rank reads from (the
prefill replicates heads the decode does not) are told to release their blocks.

No vLLM import.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

Part = Tuple[int, int, int, int]  # layout.check_part: (source slice, slices, destination slice, slices)


def heads_of_rank(rank: int, tp: int, kv_heads: int) -> Tuple[int, int]:
    """(first head, number of heads) rank ``rank`` of ``tp`` holds; ValueError where neither of
    ``tp`` and ``kv_heads`` divides the other (vLLM refuses such a model too)."""
    if tp <= 0 or kv_heads <= 0 or (kv_heads % tp if tp <= kv_heads else tp % kv_heads):
        raise ValueError(f"{kv_heads} KV heads do not split over tensor parallelism {tp}")
    if tp <= kv_heads:
        n = kv_heads // tp
        return rank * n, n
    return rank // (tp // kv_heads), 1


def ranks_holding(head: int, tp: int, kv_heads: int) -> List[int]:
    """The ranks of ``tp`` that hold KV head ``head`` (several where heads are replicated)."""
    if tp <= kv_heads:
        return [head // (kv_heads // tp)]
    r = tp // kv_heads
    return [head * r + i for i in range(r)]


def prefill_sources(rank: int, tp: int, prefill_tp: int, kv_heads: Optional[int] = None) -> List[Tuple[int, Part]]:
    """[(prefill rank, part)] decode rank ``rank`` of ``tp`` takes its heads from, the prefill
    running ``prefill_tp`` ranks; ``kv_heads``: the model's KV heads (None: as many as the larger
    tensor-parallel size, so nothing is replicated). ValueError where the heads do not divide
    evenly (the block shapes are checked per layer at the push)."""
    if tp == prefill_tp:  # rank to rank, whatever the heads
        return [(rank, (0, 1, 0, 1))]
    heads = kv_heads or max(tp, prefill_tp)
    try:
        first, n = heads_of_rank(rank, tp, heads)
        pn = heads_of_rank(0, prefill_tp, heads)[1]
        if pn % n and n % pn:
            raise ValueError(f"{pn} heads per prefill rank and {n} here")
    except ValueError as e:
        raise ValueError(f"tensor parallelism {prefill_tp} on the prefill and {tp} here "
                         f"({heads} KV heads): {e}") from None
    if n <= pn:  # a slice of one prefill rank's heads
        holders = ranks_holding(first, prefill_tp, heads)
        p = holders[rank % len(holders)]
        return [(p, ((first - heads_of_rank(p, prefill_tp, heads)[0]) // n, pn // n, 0, 1))]
    out = []
    for j in range(n // pn):  # all the heads of each of several prefill ranks, into slice j of ours
        holders = ranks_holding(first + j * pn, prefill_tp, heads)
        out.append((holders[rank % len(holders)], (0, 1, j, n // pn)))
    return out


def readers(prefill_rank: int, tp: int, prefill_tp: int, kv_heads: Optional[int] = None) -> int:
    """How many decode ranks read from ``prefill_rank`` (it keeps its blocks until each acknowledged)."""
    return sum(any(p == prefill_rank for p, _ in prefill_sources(d, tp, prefill_tp, kv_heads)) for d in range(tp))


def ranks_to_release(rank: int, tp: int, prefill_tp: int, kv_heads: Optional[int] = None) -> List[int]:
    """The prefill ranks no decode rank reads from that decode rank ``rank`` tells to release
    (each told by one decode rank: ``prefill rank % tp``)."""
    return [p for p in range(prefill_tp) if p % tp == rank and readers(p, tp, prefill_tp, kv_heads) == 0]
