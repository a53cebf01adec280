"""KV caches in vLLM 0.33's layout and deterministic block contents, for the connector's tests
(tests/test_vllm_*.py) and programs (tests/vllm_transfer_prog.py, tests/vllm_engine_prog.py).

vLLM 0.33's attention backends (FlashAttention, FlashInfer, Triton, the CPU one) view each
layer as ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (K and V side by side in
the last dim); ``legacy`` is the older ``[2, num_blocks, block_size, num_kv_heads, head_size]``
(blocks on dim 1, K and V apart), and ``cross`` views every layer of one buffer with blocks
outermost (``[num_blocks, num_layers, ...]``: a layer's view is strided).
"""

import hashlib

import torch

LAYOUTS = ("vllm", "legacy", "cross")


def make_kv_caches(layers, num_blocks, heads=2, block_size=16, head_size=16, dtype=torch.float16,
                   device="cpu", layout="vllm"):
    """``{layer name: tensor}`` and the dim that indexes blocks."""
    names = [f"model.layers.{i}.self_attn.attn" if isinstance(i, int) else i for i in layers]
    if layout == "vllm":
        return {n: torch.zeros(num_blocks, heads, block_size, 2 * head_size, dtype=dtype, device=device)
                for n in names}, 0
    if layout == "legacy":
        return {n: torch.zeros(2, num_blocks, block_size, heads, head_size, dtype=dtype, device=device)
                for n in names}, 1
    if layout == "cross":
        raw = torch.zeros(num_blocks, len(names), heads, block_size, 2 * head_size, dtype=dtype, device=device)
        return {n: raw[:, i] for i, n in enumerate(names)}, 0
    raise ValueError(layout)


def block_of(t, block, block_dim):
    return t.select(block_dim, block)


def pattern(seed: str, nbytes: int, device="cpu") -> torch.Tensor:
    """nbytes deterministic bytes for a seed (a request, a layer, a block position)."""
    h = int.from_bytes(hashlib.blake2b(seed.encode(), digest_size=8).digest(), "little")
    idx = torch.arange(nbytes, dtype=torch.int64, device=device)
    return ((idx * 2654435761 + (h % 1000003)) % 251).to(torch.uint8)


def as_bytes(view: torch.Tensor) -> torch.Tensor:
    return view.contiguous().reshape(-1).view(torch.uint8)


def fill_block(t, block, block_dim, seed: str) -> None:
    """Writes pattern(seed) into every byte of one block of one layer."""
    view = block_of(t, block, block_dim)
    data = pattern(seed, view.numel() * view.element_size(), t.device)
    view.copy_(data.view(t.dtype).reshape(view.shape))


def block_matches(t, block, block_dim, seed: str) -> bool:
    view = block_of(t, block, block_dim)
    return torch.equal(as_bytes(view), pattern(seed, view.numel() * view.element_size(), t.device))


def fill_head(t, block, head, seed: str) -> None:
    """pattern(seed) into one KV head of one block (vLLM 0.33's layout: heads on dim 1)."""
    view = t[block, head]
    view.copy_(pattern(seed, view.numel() * view.element_size(), t.device).view(t.dtype).reshape(view.shape))


def head_matches(t, block, head, seed: str) -> bool:
    view = t[block, head]
    return torch.equal(as_bytes(view), pattern(seed, view.numel() * view.element_size(), t.device))
