"""Where each KV block of each layer lies in memory, and the agent writes that move blocks.

vLLM hands a connector one tensor per attention layer (``register_kv_caches``), all viewing
one or a few raw buffers. vLLM 0.33 puts the blocks on dim 0 (``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` for FlashAttention; a cross-layer layout interleaves layers
between blocks, so a layer's view is strided); older layouts put them on dim 1 (``[2,
num_blocks, ...]``). Nothing here assumes one of them: a block of a layer is the elements whose
block index is ``b``, and it is cut into the fewest contiguous runs its strides allow (a dense
block is one run; the ``[2, num_blocks, ...]`` layout gives two, K and V). Each raw buffer is
registered with the agent once, as bytes, and runs are addressed by byte offsets into it.

No vLLM import: torch tensors (CPU, or CUDA once the agent registers device memory) only.
"""

from __future__ import annotations

import array
import ctypes
import itertools
from dataclasses import dataclass
from math import prod
from typing import Dict, List, Sequence, Tuple

from .. import _core

MAX_RUNS_PER_BLOCK = 4096  # a layout cut finer than this would make one op per few bytes


class LayoutError(ValueError):
    """A KV cache layout this module cannot address, or two that do not match."""


@dataclass(frozen=True)
class LayerGeometry:
    """One layer's blocks: in region ``region``, block ``b``'s runs start at
    ``runs[j] + b * block_stride`` and are ``run_bytes`` long (byte offsets)."""

    name: str
    region: int
    block_stride: int
    run_bytes: int
    runs: Tuple[int, ...]
    block_shape: Tuple[int, ...]
    element_size: int
    num_blocks: int

    @property
    def block_bytes(self) -> int:
        return self.run_bytes * len(self.runs)

    def to_wire(self) -> list:
        return [self.name, self.region, self.block_stride, self.run_bytes, list(self.runs),
                list(self.block_shape), self.element_size, self.num_blocks]

    @classmethod
    def from_wire(cls, w: Sequence) -> "LayerGeometry":
        """The geometry a peer described (``to_wire``); LayoutError unless every field has its
        type: a name, then integers >= 0 and lists of them."""
        if not isinstance(w, list) or len(w) != 8:
            raise LayoutError("a layer is described by a list of 8 fields")
        name, region, stride, run, runs, shape, esize, nblocks = w
        counts = (region, stride, run, esize, nblocks)
        if not isinstance(name, str) or not all(_is_count(v) for v in counts) or \
                not all(isinstance(v, list) and all(_is_count(x) for x in v) for v in (runs, shape)):
            raise LayoutError(f"layer {str(name)[:64]!r}: a field of the wrong type")
        return cls(name, region, stride, run, tuple(runs), tuple(shape), esize, nblocks)

    def check_matches(self, peer: "LayerGeometry") -> None:
        """Raises LayoutError unless the peer's blocks of this layer hold the same bytes in
        the same order (same block shape, element size and runs)."""
        mine = (self.block_shape, self.element_size, self.run_bytes, len(self.runs))
        theirs = (peer.block_shape, peer.element_size, peer.run_bytes, len(peer.runs))
        if mine != theirs:
            raise LayoutError(f"layer {self.name}: block (shape, element size, run bytes, runs) "
                              f"{mine} here, {theirs} at the peer")


def _is_count(v) -> bool:
    return type(v) is int and v >= 0


def layer_geometry(name: str, tensor, num_blocks: int, region: int, base: int, block_dim: int = 0) -> LayerGeometry:
    """The geometry of one layer's tensor. ``base``: the byte offset of the tensor's storage
    start within the registered region. ``block_dim``: the dim that indexes blocks; its size
    may be a multiple of ``num_blocks`` (vLLM's kernel blocks split a manager block)."""
    shape, stride = list(tensor.shape), list(tensor.stride())
    if not 0 <= block_dim < len(shape):
        raise LayoutError(f"layer {name}: block dim {block_dim} out of range for shape {tuple(shape)}")
    n = shape[block_dim]
    if num_blocks <= 0 or n % num_blocks:
        raise LayoutError(f"layer {name}: dim {block_dim} has {n} entries, not a multiple of {num_blocks} blocks")
    ratio = n // num_blocks
    block_step = stride[block_dim] * ratio
    inner = [(ratio, stride[block_dim])] + [(s, st) for d, (s, st) in enumerate(zip(shape, stride)) if d != block_dim]
    inner = [(s, st) for s, st in inner if s != 1]
    run, k = 1, len(inner)
    while k > 0 and inner[k - 1][1] == run:  # the contiguous suffix of the block
        run *= inner[k - 1][0]
        k -= 1
    outer = inner[:k]
    count = prod(s for s, _ in outer)
    if count > MAX_RUNS_PER_BLOCK:
        raise LayoutError(f"layer {name}: a block is {count} runs of {run} elements (limit {MAX_RUNS_PER_BLOCK})")
    esize = tensor.element_size()
    start = base + tensor.storage_offset() * esize
    runs = tuple(start + esize * sum(i * st for i, (_, st) in zip(idx, outer))
                 for idx in itertools.product(*(range(s) for s, _ in outer)))
    block_shape = tuple([ratio] + [s for d, s in enumerate(shape) if d != block_dim])
    return LayerGeometry(name, region, block_step * esize, run * esize, runs, block_shape, esize, num_blocks)


def storage_bytes(tensor):
    """A flat uint8 tensor over the whole storage ``tensor`` views (same device), and that
    storage's identity (its data pointer)."""
    import torch

    st = tensor.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    flat.set_(st, 0, (st.nbytes(),), (1,))
    return flat, st.data_ptr()


def describe_layers(kv_caches: Dict[str, object], num_blocks: int, block_dim: int = 0):
    """(flat storages to register, [LayerGeometry]) for ``{layer name: tensor}``: each storage
    once, however many layers view it."""
    storages: List[object] = []
    index_of: Dict[int, int] = {}
    layers: List[LayerGeometry] = []
    for name, t in kv_caches.items():
        flat, key = storage_bytes(t)
        if key not in index_of:
            index_of[key] = len(storages)
            storages.append(flat)
        layers.append(layer_geometry(name, t, num_blocks, index_of[key], 0, block_dim))
    return storages, layers


WHOLE = (0, 1, 0, 1)  # a part: (source slice, source slices, destination slice, destination slices)


def check_part(part: Sequence[int]) -> Tuple[int, int, int, int]:
    """A part as the want names it: 4 integers, each slice index below its count."""
    if len(part) != 4 or not all(type(v) is int for v in part):
        raise LayoutError(f"a part is 4 integers (slice, slices, slice, slices), not {list(part)[:8]}")
    si, sn, di, dn = part
    if not (0 <= si < sn and 0 <= di < dn):
        raise LayoutError(f"part {list(part)}: a slice index out of range")
    return si, sn, di, dn


def check_sliced_match(src: LayerGeometry, dst: LayerGeometry, sn: int, dn: int) -> None:
    """Heterogeneous tensor parallelism: 1/sn of each source block's heads go to 1/dn of each
    destination block's. Needs one run per block with the heads outermost in it (vLLM 0.33's
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, also cross-layer), heads that
    divide evenly, and the rest of the block the same on both sides."""
    for g in (src, dst):
        if len(g.runs) != 1 or len(g.block_shape) < 3 or g.block_shape[0] != 1:
            raise LayoutError(f"layer {g.name}: block shape {g.block_shape} in {len(g.runs)} runs: "
                              "another tensor-parallel size needs one run per block, heads outermost")
    sh, dh = src.block_shape[1], dst.block_shape[1]
    if sh % sn or dh % dn or sh // sn != dh // dn or src.block_shape[2:] != dst.block_shape[2:] \
            or src.element_size != dst.element_size:
        raise LayoutError(f"layer {src.name}: 1/{sn} of blocks {src.block_shape} here does not fit 1/{dn} of "
                          f"blocks {dst.block_shape} at the peer (element sizes {src.element_size}, {dst.element_size})")


def write_rows(src: LayerGeometry, src_index: int, dst: LayerGeometry, dst_index: int,
               src_blocks: Sequence[int], dst_blocks: Sequence[int], part: Sequence[int] = WHOLE):
    """The rows of an agent op table (``AgentConnection.write_blocks``: an (n, 5) int64 torch
    tensor of (local_index, local_offset, remote_index, remote_offset, size)) that copy the
    source blocks of one layer onto the destination blocks, pairwise, from region ``src_index``
    to region ``dst_index``; runs of consecutive block ids on both sides merge into one row where
    blocks are dense on both sides. ``part`` (another tensor-parallel size on each side): slice
    ``si`` of ``sn`` of each source block goes to slice ``di`` of ``dn`` of its destination block."""
    return request_rows([(src, src_index, dst, dst_index)], src_blocks, dst_blocks, part)


def request_rows(layers: Sequence[Tuple[LayerGeometry, int, LayerGeometry, int]], src_blocks: Sequence[int],
                 dst_blocks: Sequence[int], part: Sequence[int] = WHOLE):
    """``write_rows`` of every (source layer, its region index, destination layer, its region
    index) of a request, layer after layer, as one tensor. Layers of one shape (the usual case:
    every layer of a model alike) are computed together with tensor operations: a request's
    table costs a few dozen of them, not a Python object per block or a pass per layer. A
    connector that pushes many requests between the same layouts keeps a :class:`RowPlan`."""
    return RowPlan(layers, part).rows(src_blocks, dst_blocks)


class RowPlan:
    """``request_rows`` between one pairing of layers (``layers``: (source layer, its region
    index, destination layer, its region index)) and one ``part``, with what depends on them
    alone done once: the layers' checks (LayoutError), their grouping by shape and each group's
    per-layer constants, handed to the core (``_BlockRows``, csrc/agent/block_rows.h).
    ``rows(src_blocks, dst_blocks)`` then makes the table in one pass over the block ids."""

    def __init__(self, layers: Sequence[Tuple[LayerGeometry, int, LayerGeometry, int]], part: Sequence[int] = WHOLE):
        self.part = check_part(part)
        self.layers = list(layers)
        groups: Dict[tuple, List[int]] = {}
        for i, (src, _, dst, _) in enumerate(self.layers):
            if self.part[1:4:2] == (1, 1):
                src.check_matches(dst)
            else:
                check_sliced_match(src, dst, self.part[1], self.part[3])
            groups.setdefault(_shape_key(src, dst, self.part), []).append(i)
        self._groups = [(members, _Group([self.layers[i] for i in members], self.part)) for members in groups.values()]

    def tables(self) -> list:
        """The core's table makers (``_BlockRows``), one per shape of layers: what a read handed to
        the core makes its rows with (agent/block_pull.h; the rows of all of them are the
        request's, in another order than ``rows``')."""
        return [group._rows for _, group in self._groups]

    def rows(self, src_blocks, dst_blocks):
        """The (n, 5) int64 tensor of the request: every layer's rows, layer after layer.
        ``src_blocks`` / ``dst_blocks``: sequences of block ids or int64 tensors of them."""
        import torch

        if len(src_blocks) != len(dst_blocks):
            name = self.layers[0][0].name if self.layers else "?"
            raise LayoutError(f"layer {name}: {len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks")
        if not self.layers:
            return torch.empty((0, 5), dtype=torch.int64)
        ids = _RequestIds(src_blocks, dst_blocks)
        if len(self._groups) == 1:  # every layer alike: the group's rows are the table
            return self._groups[0][1].rows(ids).reshape(-1, 5)
        out = [None] * len(self.layers)
        for members, group in self._groups:
            rows = group.rows(ids)
            for j, i in enumerate(members):
                out[i] = rows[j]
        return torch.cat([r.reshape(-1, 5) for r in out])


def _shape_key(src: LayerGeometry, dst: LayerGeometry, part) -> tuple:
    dense = len(src.runs) == 1 and len(dst.runs) == 1 and part[1:4:2] == (1, 1) and \
        src.block_stride == src.run_bytes and dst.block_stride == dst.run_bytes
    return (dense, src.run_bytes, dst.run_bytes, len(src.runs), src.num_blocks, dst.num_blocks)


def _id_buffer(ids):
    """Block ids as int64 the core reads: an int64 CPU tensor in place (a ctypes view; the caller
    keeps the tensor), else copied into an array; None when they are not integers of 64 bits."""
    if type(ids).__module__.startswith("torch") and hasattr(ids, "data_ptr"):
        if str(ids.dtype) == "torch.int64" and ids.device.type == "cpu" and ids.dim() == 1 and ids.is_contiguous():
            return (ctypes.c_int64 * len(ids)).from_address(ids.data_ptr()) if len(ids) else array.array("q")
        ids = ids.reshape(-1).tolist()
    try:
        return array.array("q", ids)
    except (OverflowError, TypeError):
        return None


class _RequestIds:
    """One request's block ids as buffers of int64, made once for every group of layers."""

    def __init__(self, src_blocks, dst_blocks):
        self.src_blocks, self.dst_blocks = src_blocks, dst_blocks  # (a tensor viewed in place stays alive)
        self.src, self.dst = _id_buffer(src_blocks), _id_buffer(dst_blocks)

    def refuse(self, src: LayerGeometry, dst: LayerGeometry) -> None:
        """LayoutError naming the ids out of range (the core found some, or they are no int64)."""
        for ids, g, side in ((self.src_blocks, src, "source"), (self.dst_blocks, dst, "destination")):
            what = f"layer {g.name} ({side})"
            try:
                block_id_tensor(ids, g.num_blocks, what)
            except LayoutError:
                raise
            except (ValueError, TypeError, RuntimeError, OverflowError) as e:  # not integers of 64 bits
                raise LayoutError(f"{what}: block ids out of range (0..{g.num_blocks - 1}): {e}") from None
        raise LayoutError(f"layer {src.name}: block ids that are not 64-bit integers (or out of range)")


class _Group:
    """Layers of one shape (_shape_key): their per-layer constants, in the core's table maker."""

    def __init__(self, layers, part):
        si, sn, di, dn = part
        src0, _, dst0, _ = layers[0]
        self.src0, self.dst0 = src0, dst0
        self.count = len(layers)
        size = src0.run_bytes // sn  # the slice of each run that moves, at slice si / di of it
        src_runs = [r + si * size for s, _, _, _ in layers for r in s.runs]
        dst_runs = [r + di * (dst0.run_bytes // dn) for _, _, d, _ in layers for r in d.runs]
        self._rows = _core._BlockRows([(i, s.block_stride, j, d.block_stride) for s, i, d, j in layers],
                                      src_runs, dst_runs, size, _shape_key(src0, dst0, part)[0],
                                      src0.num_blocks, dst0.num_blocks)

    def rows(self, ids: _RequestIds):
        """(layers, rows per layer, 5): this group's rows of the request."""
        import torch

        got = None if ids.src is None or ids.dst is None else self._rows.rows(ids.src, ids.dst)
        if got is None:
            ids.refuse(self.src0, self.dst0)
        if not got:
            return torch.empty((self.count, 0, 5), dtype=torch.int64)
        return torch.frombuffer(got, dtype=torch.int64).reshape(self.count, -1, 5)


def block_id_tensor(ids: Sequence[int], num_blocks: int, what: str):
    """Block ids as an int64 tensor, each checked to be in 0..num_blocks-1."""
    import torch

    t = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    if len(t) == 0 or (int(t.min()) >= 0 and int(t.max()) < num_blocks):
        return t
    bad = t[(t < 0) | (t >= num_blocks)]
    if len(bad):
        raise LayoutError(f"{what}: block ids {bad[:4].tolist()} out of range (0..{num_blocks - 1})")
    return t


def write_ops(src: LayerGeometry, src_region, dst: LayerGeometry, dst_region,
              src_blocks: Sequence[int], dst_blocks: Sequence[int], part: Sequence[int] = WHOLE) -> list:
    """``write_rows`` as agent batch ops ``(local, local_off, remote, remote_off, size)``."""
    regions = (src_region, dst_region)
    return [(regions[0], lo, regions[1], ro, n)
            for _, lo, _, ro, n in write_rows(src, 0, dst, 0, src_blocks, dst_blocks, part).tolist()]
