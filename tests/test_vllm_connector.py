"""FlagcxMeshConnector with the real vLLM 0.33 on CPU: a prefill and decodes in processes of
their own (tests/vllm_engine_prog.py), each with vLLM's Scheduler and the connector in both
roles; every block a decode receives is checked byte for byte. The engine processes are forked
from one process that imported vLLM and tests/vllm_engine.py once (tests/forkserver.py: about
17 s of CPU a process on 2 cores otherwise).

Needs vllm (scripts/test.sh's vLLM stage makes its venv); skipped without it, unless
FXM_REQUIRE_VLLM=1, which turns the skip into a failure.
"""

import importlib.util
import os
import re

import pytest

from forkserver import PIPE, STDOUT, ForkServer
from meshutil import PY, finish_prog

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("FXM_REQUIRE_VLLM") == "1":
        raise RuntimeError("FXM_REQUIRE_VLLM=1 but vllm is not importable here")
    pytest.skip("vllm is not installed (scripts/test.sh's vLLM stage runs these)", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "vllm_engine_prog.py")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engines():
    server = ForkServer(["vllm_engine"])
    yield server
    server.close()


def spawn(engines, *args):
    env = dict(os.environ, FLAGCX_MESH_AGENT_SECRET="vllm-connector-test")
    return engines.popen([PY, PROG, *args], env=env, stdout=PIPE, stderr=STDOUT, text=True)


def finish(p, rc=0, timeout=240):
    return finish_prog(p, rc, timeout)[0]


def released_after(out: str) -> dict:
    return {r: float(s) for r, s in re.findall(r"released (\S+) after ([\d.]+) s", out)}


def test_one_prefill_two_decodes_tp2_aborts_and_a_decode_that_never_comes(tmp_path, engines):
    """TP 2 on both sides. req-0..5 go to two decodes (req-2 aborted by decode A while its
    fetch is under way, req-3 before its blocks were allocated); req-6 is taken by nobody and
    released at the hold timeout; req-7 is aborted on the prefill before it ran; req-5 shares
    req-4's first block, which decode B then has in its prefix cache."""
    hold = 8
    pre = spawn(engines, "prefill", "--dir", tmp_path, "--requests", 8, "--abort", 7, "--wait-for", "decA,decB",
                "--hold-timeout", hold, "--tp", 2, "--shared-prefix", "4,5")
    dec_a = spawn(engines, "decode", "--dir", tmp_path, "--name", "decA", "--take", "0,1,2,3", "--abort-mid", 2,
                  "--abort-early", 3, "--tp", 2)
    dec_b = spawn(engines, "decode", "--dir", tmp_path, "--name", "decB", "--take", "4,5", "--tp", 2, "--one-by-one")
    out_a, out_b, out_p = finish(dec_a), finish(dec_b), finish(pre)
    for r, n in (("d-0", 8), ("d-1", 12)):  # 2 ranks x 2 layers x the prompt's blocks
        assert f"loaded {r}: {n} blocks ok" in out_a, out_a
    assert "aborted d-2" in out_a and "aborted d-3" in out_a, out_a
    # req-5 (16 + 35 tokens) starts with req-4's first block: decode B has it in its prefix
    # cache once d-4 ran, fetches only the other 3 of req-5's 4 blocks, and all 4 hold the right bytes
    assert "fetching d-4: 2 of 2 blocks" in out_b and "fetching d-5: 3 of 4 blocks" in out_b, out_b
    assert "loaded d-4: 8 blocks ok" in out_b and "loaded d-5: 16 blocks ok" in out_b, out_b
    for out in (out_a, out_b):
        assert "load errors: 0 blocks" in out and "decode: free blocks 95 of 95" in out, out
    rel = released_after(out_p)
    assert set(rel) == {f"req-{i}" for i in range(7)}, out_p  # req-7 was never offered
    assert "offered req-7" not in out_p
    assert rel["req-6"] >= hold, out_p
    for i in range(6):  # taken (or cancelled) requests are released when the decode answers
        assert rel[f"req-{i}"] < hold, out_p
    assert "prefill: free blocks 95 of 95" in out_p, out_p


def test_prefill_killed_mid_transfer_is_a_load_error_then_recomputed(tmp_path, engines):
    pre = spawn(engines, "prefill", "--dir", tmp_path, "--requests", 2, "--wait-for", "dec", "--die-on-push")
    dec = spawn(engines, "decode", "--dir", tmp_path, "--name", "dec", "--take", "0,1", "--expect", "recomputed")
    out_p = finish(pre, rc=9)
    assert "dying mid-push" in out_p
    out = finish(dec)
    assert "recomputed d-0 (20 tokens)" in out and "recomputed d-1 (33 tokens)" in out, out
    assert "load errors: 5 blocks" in out, out  # 2 + 3 blocks of the two prompts
    assert "decode: free blocks 95 of 95" in out, out


def test_a_decode_that_restarts_gets_its_kv_again(tmp_path, engines):
    pre = spawn(engines, "prefill", "--dir", tmp_path, "--requests", 2, "--wait-for", "dec", "--hold-timeout", 120)
    first = spawn(engines, "decode", "--dir", tmp_path, "--name", "dec", "--take", "0,1", "--die-after-want")
    assert "dying after asking" in finish(first, rc=9)
    again = spawn(engines, "decode", "--dir", tmp_path, "--name", "dec", "--take", "0,1")
    out = finish(again)
    assert "loaded d-0: 4 blocks ok" in out and "loaded d-1: 6 blocks ok" in out, out
    assert "load errors: 0 blocks" in out and "decode: free blocks 95 of 95" in out, out
    out_p = finish(pre)
    rel = released_after(out_p)
    assert set(rel) == {"req-0", "req-1"} and max(rel.values()) < 120, out_p
    assert "prefill: free blocks 95 of 95" in out_p, out_p


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1), (2, 4)])
def test_another_tensor_parallel_size_on_each_side(tmp_path, engines, prefill_tp, decode_tp):
    """4 KV heads: each decode rank gets its heads, byte for byte, from the prefill rank(s) that
    hold them (a slice of one prefill rank's, or all of several ranks'); every prefill rank
    releases its blocks on the acknowledgements (of every decode rank that took a slice of them),
    long before the hold timeout."""
    pre = spawn(engines, "prefill", "--dir", tmp_path, "--requests", 3, "--wait-for", "dec", "--tp", prefill_tp,
                "--hold-timeout", 60)
    dec = spawn(engines, "decode", "--dir", tmp_path, "--name", "dec", "--take", "0,1,2", "--tp", decode_tp)
    out_d, out_p = finish(dec), finish(pre)
    for i in range(3):
        assert re.search(rf"loaded d-{i}: \d+ blocks ok", out_d), out_d
    assert "load errors: 0 blocks" in out_d and "decode: free blocks 95 of 95" in out_d, out_d
    rel = released_after(out_p)
    assert set(rel) == {"req-0", "req-1", "req-2"} and max(rel.values()) < 60, out_p
    assert "prefill: free blocks 95 of 95" in out_p, out_p



@pytest.mark.parametrize("kv_heads,prefill_tp,decode_tp", [(1, 1, 2), (1, 2, 1), (2, 1, 4), (2, 4, 2)])
def test_replicated_kv_heads(tmp_path, engines, kv_heads, prefill_tp, decode_tp):
    """More ranks than KV heads on one side or both (vLLM replicates each head over several
    ranks): each decode rank gets its heads, byte for byte, from a prefill rank holding them;
    every prefill rank releases its blocks long before the hold timeout, those no decode rank
    reads from (a replica the decode does not need) on the decode's word."""
    pre = spawn(engines, "prefill", "--dir", tmp_path, "--requests", 3, "--wait-for", "dec", "--tp", prefill_tp,
                "--hold-timeout", 60, "--kv-heads", kv_heads)
    dec = spawn(engines, "decode", "--dir", tmp_path, "--name", "dec", "--take", "0,1,2", "--tp", decode_tp,
                "--kv-heads", kv_heads)
    out_d, out_p = finish(dec), finish(pre)
    for i, blocks in enumerate((2, 3, 3)):  # 20, 33 and 46 tokens
        assert f"loaded d-{i}: {decode_tp * 2 * blocks} blocks ok" in out_d, out_d  # ranks x layers x blocks
    assert "load errors: 0 blocks" in out_d and "decode: free blocks 95 of 95" in out_d, out_d
    rel = released_after(out_p)
    assert set(rel) == {"req-0", "req-1", "req-2"} and max(rel.values()) < 60, out_p
    assert "prefill: free blocks 95 of 95" in out_p, out_p


@pytest.mark.parametrize("prefill_tp", [2, 1])
def test_a_hybrid_model_full_attention_and_sliding_window_groups(tmp_path, engines, prefill_tp):
    """Two KV cache groups (vLLM's hybrid memory allocator on: the connector declares
    SupportsHMA): layers 0 and 2 attend fully, layers 1 and 3 over a window of 32 tokens, each
    pair sharing one KV cache tensor. A full-attention layer receives every block of the prompt,
    a sliding-window layer the blocks of its window (at most cdiv(32, 16) + 1 = 3), each by its
    own group's block ids, every byte checked; req-4 starts with req-3's first block, which the
    decode then has in its prefix cache. The decode runs TP 2; the prefill TP 2, or TP 1 (each
    decode rank then takes half the heads of every block of each group)."""
    pre = spawn(engines, "prefill", "--dir", tmp_path, "--requests", 5, "--wait-for", "dec", "--window", 32,
                "--tp", prefill_tp, "--shared-prefix", "3,4", "--pull")
    dec = spawn(engines, "decode", "--dir", tmp_path, "--name", "dec", "--take", "0,1,2,3,4", "--window", 32,
                "--tp", 2, "--one-by-one", "--pull")
    out_d, out_p = finish(dec), finish(pre)
    assert "kv cache groups: 2, connector supports HMA: True" in out_d, out_d
    assert "kv cache groups: 2, connector supports HMA: True" in out_p, out_p
    # 20, 33, 46, 59 and 16 + 22 tokens: every block of group 0, the window's of group 1
    for i, (full, window) in enumerate(((2, 2), (3, 3), (3, 3), (4, 3))):
        assert f"fetching d-{i}: [{full}, {window}] of [{full}, {window}] blocks" in out_d, out_d
    # req-4 (16 + 22 tokens) shares req-3's first block: a prefix-cache hit only where vLLM finds
    # it for both groups (the window's blocks of d-3 may be gone): 2 or 3 blocks of group 0
    assert re.search(r"fetching d-4: \[[23], 3\] of \[3, 3\] blocks", out_d), out_d
    # checked: 2 ranks x (2 full-attention layers x the prompt's blocks + 2 sliding-window layers
    # x the blocks of the last token's window: from position (tokens - 32) // 16 on)
    for i, n in enumerate((2 * (4 + 4), 2 * (6 + 6), 2 * (6 + 6), 2 * (8 + 6), 2 * (6 + 6))):
        assert f"loaded d-{i}: {n} blocks ok" in out_d, out_d
    # pull on (both engines): d-0 pushed (the first request on each connection: the prefill's layout
    # comes back meanwhile), d-1..d-4 read by each decode rank itself (cma, remote_hold_until 60 s
    # ahead, its MAC checked): the checks above hold for the reads (with TP 1 on the prefill, two
    # readers of its one rank each)
    assert "decode read itself: 8 fetches" in out_d, out_d
    assert "load errors: 0 blocks" in out_d and "decode: free blocks 95 of 95" in out_d, out_d
    rel = released_after(out_p)
    assert set(rel) == {f"req-{i}" for i in range(5)} and max(rel.values()) < 60, out_p
    assert "prefill: free blocks 95 of 95" in out_p, out_p

# ---- in this process: the scheduler side's checks, the settings, the stats ---------------------


def scheduler_side(block_size=16, tp=1):
    from types import SimpleNamespace

    from flagcx_mesh.vllm.connector import FlagcxMeshConnectorMetadata
    from flagcx_mesh.vllm.scheduler import SchedulerSide

    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=block_size),
                          parallel_config=SimpleNamespace(tensor_parallel_size=tp))
    return SchedulerSide(cfg, "engine-d", FlagcxMeshConnectorMetadata)


def decode_request(req_id, prompt_len, **params):
    from types import SimpleNamespace

    p = dict(do_remote_prefill=True, remote_agents=["YQ=="], remote_request_id="p-" + req_id,
             remote_block_ids=[0, 1, 2], **params)
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(range(prompt_len)), kv_transfer_params=p)


def test_a_prefill_of_another_block_size_is_refused_naming_both_and_computed_here(caplog):
    side = scheduler_side(block_size=32)
    same = decode_request("same", 40, block_size=32)
    other = decode_request("other", 40, block_size=16)
    with caplog.at_level("ERROR", logger="vllm.flagcx_mesh"):
        assert side.get_num_new_matched_tokens(same, 0) == (40, True)
        assert side.get_num_new_matched_tokens(other, 0) == (0, False)
        assert side.get_num_new_matched_tokens(other, 0) == (0, False)  # asked again: said once
    said = [r.getMessage() for r in caplog.records if "block_size" in r.getMessage()]
    assert len(said) == 1 and "block_size 16" in said[0] and "block_size 32" in said[0], said
    side.update_state_after_alloc(other, None, 0)  # nothing fetched: the prefill is told to release
    meta = side.build_connector_meta(None)
    assert not meta.to_fetch and meta.to_release == [(["YQ=="], "p-other")]


def test_a_prefill_of_another_number_of_kv_cache_groups_is_computed_here(caplog):
    side = scheduler_side()  # one group
    hybrid = decode_request("hybrid", 40)
    hybrid.kv_transfer_params["remote_block_ids"] = [[0, 1, 2], [1, 2]]
    with caplog.at_level("ERROR", logger="vllm.flagcx_mesh"):
        assert side.get_num_new_matched_tokens(hybrid, 0) == (0, False)
        assert side.get_num_new_matched_tokens(decode_request("plain", 40), 0) == (40, True)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "with 2 KV cache groups, this decode has 1" in said[0], said
    side.update_state_after_alloc(hybrid, None, 0)  # nothing fetched: the prefill is told to release
    assert side.build_connector_meta(None).to_release == [(["YQ=="], "p-hybrid")]


def test_a_group_that_is_neither_full_attention_nor_a_sliding_window_is_refused_at_start():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from flagcx_mesh.vllm.scheduler import window_sizes

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float16,))
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["m"], mamba)])
    with pytest.raises(ValueError, match="group 1 .*MambaSpec"):
        window_sizes(cfg, 16)
    one = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["m"], mamba)])
    assert window_sizes(one, 16) == [0]  # one group: moved as before, whatever it holds


def test_a_kv_transfer_params_hold_that_is_not_a_finite_number_is_none():
    """The scheduler side hands the workers a prefill's remote_hold_until only as a finite
    number (else 0: the blocks are pushed, never read by the decode on a hold it cannot trust):
    NaN, an infinity, a bool, a string are no hold."""
    from flagcx_mesh.vllm.scheduler import SchedulerSide

    for v in (float("nan"), float("inf"), True, "123", None):
        assert SchedulerSide._hold_until({"remote_hold_until": v}) == 0.0, v
    assert SchedulerSide._hold_until({"remote_hold_until": 1.5e9}) == 1.5e9
    assert SchedulerSide._hold_until({}) == 0.0


def signed_params(secret: bytes, **over) -> dict:
    import json
    import time

    from flagcx_mesh.vllm.scheduler import pull_mac

    p = dict(remote_engine_id="pre", remote_request_id="req-1", remote_block_ids=[3, 4, 9],
             remote_agents=["YWdlbnQ="], remote_hold_until=time.time() + 60)
    p["remote_pull_mac"] = pull_mac(secret, p)
    p = json.loads(json.dumps(p))  # as the params travel
    p.update(over)
    return p


def test_a_decode_reads_blocks_itself_only_on_params_whose_mac_it_checked(caplog):
    """Params a client or a proxy made up or altered (other block ids, another request, other
    agents, a later hold, another secret's MAC, none) give the workers no hold: those blocks are
    pushed, the prefill serving only what it holds for that request. Genuine ones give the hold;
    with pull off on the decode (no secret handed to its scheduler) nothing is read."""
    from flagcx_mesh.vllm.scheduler import SchedulerSide

    side = SchedulerSide.__new__(SchedulerSide)
    side._pull_secret = b"s3cret"
    good = signed_params(b"s3cret")
    assert side._trusted_hold(good) == good["remote_hold_until"]
    for over in (dict(remote_block_ids=[3, 4, 10]), dict(remote_request_id="req-2"), dict(remote_agents=["eA=="]),
                 dict(remote_hold_until=good["remote_hold_until"] + 1000), dict(remote_engine_id="other"),
                 dict(remote_pull_mac=signed_params(b"other")["remote_pull_mac"]), dict(remote_pull_mac=None)):
        assert side._trusted_hold(dict(good, **over)) == 0.0, over
    assert side._trusted_hold({k: v for k, v in good.items() if k != "remote_pull_mac"}) == 0.0
    assert "without a valid remote_pull_mac" in caplog.text
    side._pull_secret = b""
    assert side._trusted_hold(good) == 0.0


def test_unknown_extra_config_keys_are_warned_in_one_line_each(caplog):
    from flagcx_mesh.vllm.connector import KNOWN_KEYS, warn_unknown_keys

    with caplog.at_level("WARNING", logger="vllm.flagcx_mesh"):
        warn_unknown_keys({"fetch_timout": 5, "hold_timeout": 3})
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "'fetch_timout'" in said[0] and all(k in said[0] for k in KNOWN_KEYS), said


def test_connector_stats_add_up_over_workers_and_reach_prometheus_counters():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from flagcx_mesh.vllm.connector import FlagcxMeshConnector

    a = FlagcxMeshConnector.build_kv_connector_stats({"pushes": 2, "bytes_pushed": 4 << 20, "push_seconds": 0.5})
    b = FlagcxMeshConnector.build_kv_connector_stats({"pushes": 1, "fetches_failed": 1})
    total = a.aggregate(b)
    assert total.data == {"pushes": 3, "bytes_pushed": 4 << 20, "push_seconds": 0.5, "fetches_failed": 1}
    assert total.reduce()["push MB/s"] == 8.0 and not total.is_empty()
    assert FlagcxMeshConnector.build_kv_connector_stats().is_empty()
    registry = CollectorRegistry()

    def in_registry(cls):
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k: cls.__init__(self, *a, registry=registry, **k)})

    types = {Gauge: in_registry(Gauge), Counter: in_registry(Counter), Histogram: in_registry(Histogram)}
    from types import SimpleNamespace
    prom = FlagcxMeshConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types,
                                                  ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(total.data, 0)
    assert registry.get_sample_value("vllm:flagcx_mesh_pushes_total", {"model_name": "m", "engine": "0"}) == 3
    assert registry.get_sample_value("vllm:flagcx_mesh_fetches_failed_total", {"model_name": "m", "engine": "0"}) == 1
