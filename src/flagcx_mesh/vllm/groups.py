"""A request's block ids per KV cache group (vLLM's hybrid memory allocator).

A model whose layers all attend alike has one KV cache group: its block ids are one list, on
the wire as before. A hybrid model (full attention and sliding window, say) has several, each
with block ids of its own into the same KV cache tensors; a group's layers take that group's
blocks. A sliding-window group moves only the blocks still in its window: the last
``cdiv(sliding_window, block_size) + 1`` (as NixlConnector clips them), less the null blocks vLLM
points the positions that left the window at, on either side.

No vLLM import.
"""

from __future__ import annotations

from typing import List, Sequence

NULL_BLOCK = 0  # vLLM's block pool keeps block 0 as its null block (out-of-window positions point at it)

Groups = List[List[int]]


def as_groups(block_ids) -> Groups:
    """[[block ids of group 0], ...]: a flat list is one group, a list of lists one per group.
    ValueError for anything else."""
    ids = list(block_ids)
    nested = [isinstance(g, (list, tuple)) for g in ids]
    if ids and all(nested):
        return [[int(b) for b in g] for g in ids]
    if any(nested):
        raise ValueError("block ids: a list of ints (one KV cache group) or a list of lists (one per group)")
    return [[int(b) for b in ids]]


def to_wire(groups: Groups):
    """One group as a flat list (as a model of one group always sent it), several as a list of lists."""
    return list(groups[0]) if len(groups) == 1 else [list(g) for g in groups]


def flat(groups: Groups) -> List[int]:
    return [b for g in groups for b in g]


def window_blocks(sliding_window: int, block_size: int) -> int:
    """Blocks a sliding-window group moves (0: a group that keeps every block)."""
    return -(-sliding_window // block_size) + 1 if sliding_window else 0


def clip_to_windows(groups: Groups, windows: Sequence[int]) -> Groups:
    """Each sliding-window group's blocks still in its window (``windows[g]`` blocks at most,
    leading null blocks dropped); the others whole."""
    if len(windows) != len(groups):
        raise ValueError(f"{len(groups)} KV cache groups of block ids, {len(windows)} groups here")
    out = []
    for g, n in zip(groups, windows):
        if n:
            g = g[-n:]
            while g and g[0] == NULL_BLOCK:
                g = g[1:]
        out.append(list(g))
    return out


def pair_with_remote(local: Groups, remote: Groups, windows: Sequence[int]) -> Groups:
    """The local blocks each group receives: in a sliding-window group the last as many as the
    prefill sends (the window's tail on both sides); in the others all of them (a prefill that
    holds fewer is a load error at the fetch)."""
    return [lg[len(lg) - min(len(lg), len(rg)):] if n else lg for lg, rg, n in zip(local, remote, windows)]


def split(ids: Sequence[int], counts: Sequence[int]) -> Groups:
    """``ids`` cut into consecutive groups of ``counts`` blocks; ValueError unless they add up."""
    if sum(counts) != len(ids) or any(c < 0 for c in counts):
        raise ValueError(f"{len(ids)} block ids do not split into groups of {list(counts)[:8]}")
    out, at = [], 0
    for c in counts:
        out.append(list(ids[at:at + c]))
        at += c
    return out
