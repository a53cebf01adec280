"""A small disaggregation proxy: each completion request goes to the prefill first (one token,
``kv_transfer_params: {"do_remote_decode": true}``), then to the decode with the
``kv_transfer_params`` the prefill answered (its worker agents, request id and block ids), so
the decode starts from the KV cache the prefill pushed into it.

    python examples/vllm/proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Serves POST /v1/completions and /v1/chat/completions (streamed or not) and GET /health.
Needs aiohttp (vLLM installs it). See docs/vllm.md.
"""

import argparse
import itertools
import json

from aiohttp import ClientSession, ClientTimeout, web


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="append", required=True, help="a prefill server's base URL (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="a decode server's base URL (repeatable)")
    p.add_argument("--timeout", type=float, default=600.0)
    return p.parse_args()


def make_app(args) -> web.Application:
    prefills, decodes = itertools.cycle(args.prefill), itertools.cycle(args.decode)
    session_box = {}

    async def session() -> ClientSession:
        if "s" not in session_box:
            session_box["s"] = ClientSession(timeout=ClientTimeout(total=args.timeout))
        return session_box["s"]

    async def prefill_once(path: str, body: dict) -> dict:
        """The prompt through the prefill: one token, and its kv_transfer_params back."""
        req = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        req.pop("max_completion_tokens", None)
        req.pop("stream_options", None)
        async with (await session()).post(next(prefills) + path, json=req) as r:
            if r.status != 200:
                raise web.HTTPBadGateway(text=f"prefill answered {r.status}: {await r.text()}")
            answer = await r.json()
        params = answer.get("kv_transfer_params")
        if not params:
            raise web.HTTPBadGateway(text="the prefill answered no kv_transfer_params "
                                          "(is it started with the FlagcxMeshConnector as kv_producer?)")
        return params

    async def relay(request: web.Request) -> web.StreamResponse:
        path = request.path
        body = await request.json()
        params = await prefill_once(path, body)
        decode_body = dict(body, kv_transfer_params=params)
        async with (await session()).post(next(decodes) + path, json=decode_body) as r:
            out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get(
                "Content-Type", "application/json")})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(_request):
        return web.Response(text=json.dumps({"prefill": args.prefill, "decode": args.decode}))

    async def close(_app):
        if "s" in session_box:
            await session_box["s"].close()

    app = web.Application()
    app.router.add_post("/v1/completions", relay)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/health", health)
    app.on_cleanup.append(close)
    return app


if __name__ == "__main__":
    a = parse()
    web.run_app(make_app(a), host=a.host, port=a.port)
