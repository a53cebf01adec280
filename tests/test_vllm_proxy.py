"""examples/vllm/proxy.py between stand-in prefill and decode servers: the prefill gets the
request for one token with do_remote_decode, the decode gets the original request with the
kv_transfer_params the prefill answered, and the decode's answer comes back unchanged.

Needs aiohttp (vLLM installs it: the vLLM stage of scripts/test.sh runs this file); skipped
without it unless FXM_REQUIRE_VLLM=1."""

import asyncio
import importlib.util
import os
import sys

import pytest

if importlib.util.find_spec("aiohttp") is None:
    if os.environ.get("FXM_REQUIRE_VLLM") == "1":
        raise RuntimeError("FXM_REQUIRE_VLLM=1 but aiohttp (a dependency of vllm) is not importable")
    pytest.skip("aiohttp is not installed", allow_module_level=True)

from aiohttp import ClientSession, web  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "vllm"))
import proxy  # noqa: E402

pytestmark = pytest.mark.timeout(60)
PARAMS = {"do_remote_prefill": True, "remote_request_id": "cmpl-1", "remote_block_ids": [3, 4],
          "remote_agents": ["bWQ="], "tp_size": 1}


async def serve(app):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def stub(seen, answer):
    async def handle(request):
        seen.append(await request.json())
        return web.json_response(answer(seen[-1]))

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    return app


async def scenario():
    got_p, got_d = [], []
    rp, pre = await serve(stub(got_p, lambda body: {"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}))
    rd, dec = await serve(stub(got_d, lambda body: {"choices": [{"text": "decoded"}], "echo": body["prompt"]}))
    args = type("A", (), {"prefill": [pre], "decode": [dec], "timeout": 30.0})
    rx, url = await serve(proxy.make_app(args))
    try:
        async with ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 9}) as r:
                status, answer = r.status, await r.json()
    finally:
        for runner in (rx, rp, rd):
            await runner.cleanup()
    return status, answer, got_p, got_d


def test_proxy_routes_through_prefill_then_decode():
    status, answer, got_p, got_d = asyncio.run(scenario())
    assert status == 200 and answer == {"choices": [{"text": "decoded"}], "echo": "hi"}
    assert got_p == [{"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False,
                      "kv_transfer_params": {"do_remote_decode": True}}]
    assert got_d == [{"model": "m", "prompt": "hi", "max_tokens": 9, "kv_transfer_params": PARAMS}]
