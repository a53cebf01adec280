"""The vLLM connector's transfer part in one process, for tests/test_vllm_transfer.py and
tests/test_vllm_pull.py: two KVTransfer agents over cma (the ``pair`` fixture), waits on their
polls, and the KV caches' blocks and heads filled and checked (tests/vllm_kv.py patterns)."""

import time

import pytest
import torch

from flagcx_mesh.vllm.transfer import KVTransfer
from vllm_kv import as_bytes, block_matches, fill_block, make_kv_caches, pattern

SECRET = "vllm-transfer-test"
NUM_BLOCKS = 16


@pytest.fixture(name="pair")
def transfer_pair(monkeypatch):
    """make(name, heads=2, **KVTransfer keywords) -> (KVTransfer, its KV caches: 2 layers of
    NUM_BLOCKS blocks); every one made is closed after the test."""
    monkeypatch.setenv("FLAGCX_MESH_AGENT_SECRET", SECRET)
    made = []

    def make(name, heads=2, **kw):
        kv, _ = make_kv_caches([0, 1], NUM_BLOCKS, heads=heads)
        x = KVTransfer(name, kv, NUM_BLOCKS, **kw)
        made.append(x)
        return x, kv

    yield make
    for x in made:
        x.close()


def wait_for(x, what, key, timeout=20.0):
    """Polls x until ``key`` appears in ``what`` (sending / recving); its ``failed`` meanwhile."""
    got, end = set(), time.monotonic() + timeout
    failed = {}
    while key not in got:
        assert time.monotonic() < end, f"{key} never appeared in {what}"
        done = x.poll()
        got |= getattr(done, what)
        failed.update(done.failed)
        time.sleep(0.005)
    return failed


def fill_all(kv):
    for li, t in enumerate(kv.values()):
        for b in range(t.shape[0]):
            fill_block(t, b, 0, f"{li}/{b}")


def only_these_blocks(kv, received) -> list:
    """[(layer, block)] that differ: each layer's received blocks hold the source block
    (``received[layer]``: {block: source block}), every other block of it is still zero."""
    bad = []
    for li, t in enumerate(kv.values()):
        for b in range(t.shape[0]):
            src = received[li].get(b)
            ok = block_matches(t, b, 0, f"{li}/{src}") if src is not None else not as_bytes(t[b]).any()
            if not ok:
                bad.append((li, b))
    return bad


def fill_heads(kv, seed_of):
    """Every head of every block: pattern(seed_of(layer, block, head))."""
    for li, t in enumerate(kv.values()):
        for b in range(t.shape[0]):
            for h in range(t.shape[1]):
                view = t[b, h]
                view.copy_(pattern(seed_of(li, b, h), view.numel() * view.element_size()).view(t.dtype).reshape(view.shape))


def heads_match(kv, block, seed_of_head) -> bool:
    for li, t in enumerate(kv.values()):
        for h in range(t.shape[1]):
            view = t[block, h]
            if not torch.equal(as_bytes(view), pattern(seed_of_head(li, h), view.numel() * view.element_size())):
                return False
    return True
