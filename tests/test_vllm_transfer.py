"""The vLLM connector's transfer part without vLLM (flagcx_mesh.vllm.layout, .protocol,
.transfer) on torch CPU tensors: block geometry of vLLM's layouts, the ops a push issues, two
processes moving KV blocks with every byte checked, and what happens when a side fails.

Skipped without torch, unless FXM_REQUIRE_TORCH=1 (scripts/test.sh sets it)."""

import os
import subprocess
import sys
import time

import pytest

if os.environ.get("FXM_REQUIRE_TORCH") != "1":
    pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
import torch  # noqa: E402

from flagcx_mesh.vllm import protocol  # noqa: E402
from flagcx_mesh.vllm.layout import LayoutError, describe_layers, layer_geometry, write_ops  # noqa: E402
from flagcx_mesh.vllm.transfer import KVTransfer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from vllm_kv import block_matches, fill_block, make_kv_caches  # noqa: E402
from forkserver import PIPE, STDOUT, ForkServer  # noqa: E402
from meshutil import PY, finish_prog  # noqa: E402

PROG = os.path.join(HERE, "vllm_transfer_prog.py")
SECRET = "vllm-transfer-test"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def torch_fork():
    """The two processes of a test are forked from one that imported torch (~2 s of CPU each on
    2 cores otherwise; tests/forkserver.py runs each as a fresh interpreter would)."""
    server = ForkServer(["vllm_kv"])
    yield server
    server.close()


def spawn(torch_fork, *args):
    env = dict(os.environ, FLAGCX_MESH_AGENT_SECRET=SECRET)
    return torch_fork.popen([PY, PROG, *args], env=env, stdout=PIPE, stderr=STDOUT, text=True)


def finish(p, rc=0, timeout=120):
    return finish_prog(p, rc, timeout)[0]


# ---- geometry and ops -------------------------------------------------------------------

def test_vllm_layout_is_one_run_per_block():
    kv, bdim = make_kv_caches([0], 10, heads=2, block_size=16, head_size=8, layout="vllm")
    (g,) = describe_layers(kv, 10, bdim)[1]
    block = 2 * 16 * 16 * 2  # heads * block_size * (2 * head_size) * fp16
    assert (g.run_bytes, g.runs, g.block_stride, g.block_bytes) == (block, (0,), block, block)


def test_legacy_layout_is_k_and_v_runs():
    kv, bdim = make_kv_caches([0], 10, heads=2, block_size=16, head_size=8, layout="legacy")
    (g,) = describe_layers(kv, 10, bdim)[1]
    half = 16 * 2 * 8 * 2
    assert g.runs == (0, 10 * half) and g.run_bytes == half and g.block_stride == half


def test_cross_layer_layout_shares_one_region_with_strided_blocks():
    kv, bdim = make_kv_caches([0, 1, 2], 10, heads=2, block_size=16, head_size=8, layout="cross")
    storages, layers = describe_layers(kv, 10, bdim)
    block = 2 * 16 * 16 * 2
    assert len(storages) == 1 and storages[0].numel() == 3 * 10 * block
    assert [g.runs for g in layers] == [(0,), (block,), (2 * block,)]
    assert all(g.block_stride == 3 * block and g.run_bytes == block for g in layers)


def test_kernel_blocks_split_a_manager_block():
    t = torch.zeros(20, 2, 8, 16, dtype=torch.float16)  # 10 manager blocks of 2 kernel blocks
    g = layer_geometry("l", t, 10, 0, 0)
    assert g.run_bytes == 2 * 2 * 8 * 16 * 2 and g.block_stride == g.run_bytes and g.runs == (0,)
    with pytest.raises(LayoutError, match="not a multiple"):
        layer_geometry("l", torch.zeros(15, 4), 10, 0, 0)


def test_write_ops_merge_consecutive_blocks_only_where_dense():
    kv, _ = make_kv_caches([0], 16, layout="vllm")
    (g,) = describe_layers(kv, 16)[1]
    ops = write_ops(g, b"L", g, b"R", [3, 4, 5, 9], [0, 1, 2, 7])
    B = g.block_bytes
    assert ops == [(b"L", 3 * B, b"R", 0, 3 * B), (b"L", 9 * B, b"R", 7 * B, B)]
    kvl, bdim = make_kv_caches([0], 16, layout="legacy")
    (gl,) = describe_layers(kvl, 16, bdim)[1]
    assert len(write_ops(gl, b"L", gl, b"R", [3, 4], [0, 1])) == 4  # K and V of each block


def test_mismatched_layouts_and_bad_block_ids_are_refused():
    a = describe_layers(make_kv_caches([0], 8, heads=2)[0], 8)[1][0]
    b = describe_layers(make_kv_caches([0], 8, heads=4)[0], 8)[1][0]
    with pytest.raises(LayoutError, match="block"):
        write_ops(a, b"L", b, b"R", [0], [0])
    with pytest.raises(LayoutError, match="out of range"):
        write_ops(a, b"L", a, b"R", [8], [0])
    with pytest.raises(LayoutError, match="source blocks"):
        write_ops(a, b"L", a, b"R", [0, 1], [0])


def test_protocol_round_trip_and_refusals():
    kind, f = protocol.decode(protocol.encode("W", req="r", tag="t", dst=[1, 2]))
    assert (kind, f) == ("W", {"req": "r", "tag": "t", "dst": [1, 2]})
    for bad in (b"check user 0 16 0", protocol.MAGIC + b"Z{}", protocol.MAGIC + b"W[1]", protocol.MAGIC + b"W{"):
        with pytest.raises(protocol.ProtocolViolation):
            protocol.decode(bad)


def test_the_transfer_part_imports_without_vllm():
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import flagcx_mesh.vllm, flagcx_mesh.vllm.transfer, flagcx_mesh.vllm.layout\n"
            "try:\n    flagcx_mesh.vllm.FlagcxMeshConnector\nexcept ImportError:\n    print('connector needs vllm')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "connector needs vllm" in out.stdout, out.stderr


# ---- two processes ----------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["vllm", "legacy", "cross"])
def test_blocks_move_prefill_to_decode_byte_for_byte(tmp_path, layout, torch_fork):
    pre = spawn(torch_fork, "--role", "prefill", "--dir", tmp_path, "--layout", layout)
    dec = spawn(torch_fork, "--role", "decode", "--dir", tmp_path, "--layout", layout)
    out = finish(dec)
    assert "checked 40 blocks of 6 requests" in out, out  # 4 layers x 10 blocks (request_blocks)
    assert "released 6" in finish(pre)


def test_prefill_killed_mid_push_fails_the_decode_with_its_blocks(tmp_path, torch_fork):
    pre = spawn(torch_fork, "--role", "prefill", "--dir", tmp_path, "--die-on-push")
    dec = spawn(torch_fork, "--role", "decode", "--dir", tmp_path, "--fetch-timeout", 60)
    finish(pre, rc=9)
    out = finish(dec, rc=3)
    assert "FAILED" in out and "missing []" in out, out  # every request answered, as failed
    assert "received []" in out, out


def test_a_decode_that_dies_before_taking_its_blocks_leaves_them_held_for_the_next(tmp_path, torch_fork):
    pre = spawn(torch_fork, "--role", "prefill", "--dir", tmp_path)
    finish(spawn(torch_fork, "--role", "decode", "--dir", tmp_path, "--name", "dec", "--die-after-want"), rc=9)
    out = finish(spawn(torch_fork, "--role", "decode", "--dir", tmp_path, "--name", "dec"))
    assert "checked 40 blocks of 6 requests" in out, out
    assert "released 6" in finish(pre)


def test_layout_mismatch_is_refused_by_the_prefill(tmp_path, torch_fork):
    pre = spawn(torch_fork, "--role", "prefill", "--dir", tmp_path, "--hold-timeout", 3)
    out = finish(spawn(torch_fork, "--role", "decode", "--dir", tmp_path, "--heads", 4), rc=3)
    assert "FAILED" in out and "received []" in out, out
    assert "released 6" in finish(pre)  # at the hold timeout: nobody took them


# ---- one process, two agents ------------------------------------------------------------

@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setenv("FLAGCX_MESH_AGENT_SECRET", SECRET)
    made = []

    def make(name, **kw):
        kv, _ = make_kv_caches([0, 1], 16)
        x = KVTransfer(name, kv, 16, **kw)
        made.append(x)
        return x, kv

    yield make
    for x in made:
        x.close()


def wait_for(x, what, key, timeout=20.0):
    got, end = set(), time.monotonic() + timeout
    failed = {}
    while key not in got:
        assert time.monotonic() < end, f"{key} never appeared in {what}"
        done = x.poll()
        got |= getattr(done, what)
        failed.update(done.failed)
        time.sleep(0.005)
    return failed


def test_held_blocks_are_released_at_the_hold_timeout(pair):
    pre, _ = pair("p", hold_timeout=0.5)
    t0 = time.monotonic()
    pre.hold("r", [1, 2])
    assert pre.busy()
    wait_for(pre, "sending", "r")
    assert time.monotonic() - t0 >= 0.5
    assert not pre.busy()


def test_release_frees_the_prefill_at_once(pair):
    pre, _ = pair("p", hold_timeout=60)
    dec, _ = pair("d")
    pre.hold("r", [1])
    t0 = time.monotonic()
    dec.release(pre.metadata, "r")
    wait_for(pre, "sending", "r")
    assert time.monotonic() - t0 < 30


def test_unknown_request_is_answered_as_failed(pair):
    pre, _ = pair("p", hold_timeout=0.5)
    dec, _ = pair("d")
    failed = wait_for_fetch(dec, pre, "nope", [0, 1], [4, 5])
    assert failed == {"t": [4, 5]}


def wait_for_fetch(dec, pre, remote_req, remote, local):
    dec.fetch("t", pre.metadata, remote_req, remote, local)
    return wait_for(dec, "recving", "t")


def test_fetch_after_hold_and_garbage_notifications_are_ignored(pair):
    pre, pkv = pair("p")
    dec, dkv = pair("d")
    for li, t in enumerate(pkv.values()):
        for b in range(16):
            fill_block(t, b, 0, f"{li}/{b}")
    # a third agent sends what is not a KV message; the prefill must keep serving
    stranger, _ = pair("x")
    stranger.agent.connect(pre.metadata).notify(b"not a kv message")
    stranger.agent.connect(pre.metadata).notify(protocol.MAGIC + b"W{\"req\": 1}")
    pre.hold("r", [7, 8, 9])
    assert wait_for_fetch(dec, pre, "r", [7, 8, 9], [2, 3]) == {}  # the tail: 8, 9
    for li, t in enumerate(dkv.values()):
        assert block_matches(t, 2, 0, f"{li}/8") and block_matches(t, 3, 0, f"{li}/9")
        assert not block_matches(t, 4, 0, f"{li}/9")
    wait_for(pre, "sending", "r")  # released on the decode's acknowledgement
