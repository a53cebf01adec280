"""The agents' C ABI as a C user meets it: the whole agent example (examples/c/agent_pair.c: two
processes, a batch of blocks with a notification, every byte checked) builds with one compiler
line and runs over tcp and cma; stats, peers, alloc and path_to answer what the Python agent
answers (stats: the same keys), and a short buffer fails saying the size needed."""

import ctypes
import json
import os
import re
import subprocess
import sys

import pytest

import flagcx_mesh
from flagcx_mesh import Agent

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "c", "agent_pair.c")
CC = os.environ.get("CC", "cc")


@pytest.fixture(scope="module")
def agent_pair(tmp_path_factory):
    exe = tmp_path_factory.mktemp("capi_agent") / "agent_pair"
    cmd = (f"{CC} -std=c99 -Wall -Wextra -Werror {EXAMPLE} "
           f"$({sys.executable} -m flagcx_mesh.config --cflags --libs) -o {exe}")
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return str(exe)


@pytest.mark.parametrize("transport,path", [("tcp", "tcp"), ("auto", "cma")])
def test_the_agent_example_runs_and_reports(agent_pair, transport, path):
    env = dict(os.environ, FLAGCX_MESH_AGENT_SECRET="c-example", FLAGCX_MESH_TRANSPORT=transport)
    r = subprocess.run([agent_pair], env=env, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0 and "agent_pair: OK" in r.stdout, r.stdout + r.stderr
    assert f"prefill: wrote 64 blocks of 65536 bytes over {path}" in r.stdout, r.stdout
    assert 'decode: notification "kv ready" from prefill-0; 0 wrong bytes in 64 blocks' in r.stdout, r.stdout
    stats = json.loads(re.search(r"decode: stats (.*)", r.stdout).group(1))
    with Agent("keys", "s", timeout=5) as a:
        assert set(stats) == set(a.stats())
    assert stats["accepted"] >= 1 and stats["rejected"] == {}
    assert re.search(r"decode: peers prefill-0 [0-9a-f]+ \S+:\d+", r.stdout), r.stdout


class Lib:
    def __init__(self):
        lib = ctypes.CDLL(flagcx_mesh.get_library())
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.flagcx_mesh_agent_create.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_double]
        lib.flagcx_mesh_agent_stats.argtypes = [vp, ctypes.c_char_p, ctypes.POINTER(sz)]
        lib.flagcx_mesh_agent_peers.argtypes = [vp, ctypes.c_char_p, ctypes.POINTER(sz)]
        lib.flagcx_mesh_agent_alloc.argtypes = [vp, ctypes.c_uint64, ctypes.POINTER(vp), ctypes.c_char_p,
                                                ctypes.POINTER(sz)]
        lib.flagcx_mesh_agent_destroy.argtypes = [vp]
        lib.flagcx_mesh_last_error.restype = ctypes.c_char_p
        self.lib = lib


def test_short_buffers_say_the_size_needed_and_alloc_gives_zeroed_memory():
    lib = Lib().lib
    agent = ctypes.c_void_p()
    assert lib.flagcx_mesh_agent_create(ctypes.byref(agent), b"c-abi", b"s", 5.0) == 0
    try:
        n = ctypes.c_size_t(4)
        buf = ctypes.create_string_buffer(4)
        assert lib.flagcx_mesh_agent_stats(agent, buf, ctypes.byref(n)) == 1  # INVALID_ARGUMENT
        assert b"are needed" in lib.flagcx_mesh_last_error()
        need = n.value
        big = ctypes.create_string_buffer(need)
        assert lib.flagcx_mesh_agent_stats(agent, big, ctypes.byref(n)) == 0 and n.value == need
        assert json.loads(big.value)["connected"] == 0
        n = ctypes.c_size_t(8)
        assert lib.flagcx_mesh_agent_peers(agent, buf, ctypes.byref(n)) == 0 and n.value == 1 and buf.value == b""
        base, desc, dlen = ctypes.c_void_p(), ctypes.create_string_buffer(4096), ctypes.c_size_t(4096)
        assert lib.flagcx_mesh_agent_alloc(agent, 1 << 16, ctypes.byref(base), desc, ctypes.byref(dlen)) == 0
        assert base.value and ctypes.string_at(base.value, 1 << 16) == bytes(1 << 16)
        info = flagcx_mesh.agent.region_info(desc.raw[:dlen.value])
        assert info["size"] == 1 << 16 and info["kind"] == "shm" and info["agent"] == "c-abi"
        short = ctypes.c_size_t(3)
        assert lib.flagcx_mesh_agent_alloc(agent, 1 << 16, ctypes.byref(base), desc, ctypes.byref(short)) == 1
        assert short.value == dlen.value
    finally:
        lib.flagcx_mesh_agent_destroy(agent)
