"""Region checks against the target's cookie table (transport/cma/cookie_table.h): an
initiator in another process maps the table on its first check over cma, later checks are loads,
and a region deregistered there is still refused (nothing written) while the others keep working;
with FLAGCX_MESH_AGENT_COOKIE_TABLE=off checks read through cma and refuse it as well.
The program is tests/agent_cookie_prog.py."""

import os

import pytest

from meshutil import finish_prog, spawn_prog

pytestmark = pytest.mark.timeout(120)
HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "agent_cookie_prog.py")


def run(transport, **extra):
    env = dict(os.environ, FLAGCX_MESH_LOG="info", FLAGCX_MESH_TRANSPORT=transport, **extra)
    p = spawn_prog(PROG, env=env, merge=True, cwd=HERE)
    out, _ = finish_prog(p, timeout=90, what=f"agent_cookie_prog over {transport}", ok="cookie ok")
    return out


def test_cma_checks_load_from_the_mapped_table_and_still_see_a_deregistration():
    out = run("cma")
    assert "path cma" in out, out
    assert "the peer's cookie table is mapped: region checks are loads" in out, out
    assert "region #1 of agent cookie-target was deregistered there" in out, out


def test_tcp_needs_no_table_and_the_target_refuses_a_deregistered_region():
    out = run("tcp")
    assert "path tcp" in out, out
    assert "cookie table" not in out, out  # the target's engine checks tcp ops itself
    assert "deregistered" in out, out


def test_without_a_table_checks_read_through_cma_and_still_see_a_deregistration():
    out = run("cma", FLAGCX_MESH_AGENT_COOKIE_TABLE="off")
    assert "path cma" in out, out
    assert "FLAGCX_MESH_AGENT_COOKIE_TABLE=off: peers read cookies through cma" in out, out
    assert "cookie table is mapped" not in out, out
    assert "is not mapped (" in out and "): region checks read through cma" in out, out
    assert "region #1 of agent cookie-target was deregistered there" in out, out
