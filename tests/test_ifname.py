"""A wrong FLAGCX_MESH_IFNAME names the variable, what is wrong with it and the interfaces that
are up (docs/launching.md, "Across hosts"); under the launcher it is one line."""

import socket
import subprocess
import sys

import pytest

from meshutil import subprocess_env

pytestmark = pytest.mark.timeout(60)

MAKE_ID = "import flagcx_mesh; flagcx_mesh.get_unique_id()"


def _run(args, ifname):
    return subprocess.run([sys.executable, *args], env=subprocess_env({"FLAGCX_MESH_IFNAME": ifname}),
                          capture_output=True, text=True, timeout=45)


def _foreign_ipv4():
    """An address of the documentation ranges that this host cannot bind."""
    for addr in ("198.51.100.77", "203.0.113.77", "192.0.2.254"):
        with socket.socket() as s:
            try:
                s.bind((addr, 0))
            except OSError:
                return addr
    raise AssertionError("every documentation address is local here")


def test_an_unknown_interface_lists_the_interfaces_up():
    p = _run(["-c", MAKE_ID], "nosuchif0")
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert "FLAGCX_MESH_IFNAME=nosuchif0 matches no interface" in last, p.stderr
    assert "interfaces up: " in last and "lo 127.0.0.1" in last, p.stderr
    assert "unset it" in last, p.stderr


def test_a_foreign_address_literal_names_the_variable():
    addr = _foreign_ipv4()
    p = _run(["-c", MAKE_ID], addr)
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert f"FLAGCX_MESH_IFNAME={addr} is not an address of this host" in last, p.stderr
    assert "lo 127.0.0.1" in last and "errno 99" in last, p.stderr


def test_a_local_address_literal_is_used():
    p = _run(["-c", MAKE_ID + "; print('made')"], "127.0.0.1")
    assert p.returncode == 0 and "made" in p.stdout, p.stderr


def test_the_launcher_says_it_in_one_line():
    p = _run(["-m", "flagcx_mesh.launch", "-n", "2", "--", sys.executable, "-c", "pass"], "nosuchif0")
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flagcx_mesh.launch: "), p.stderr
    assert "FLAGCX_MESH_IFNAME=nosuchif0" in lines[0] and "interfaces up: " in lines[0], p.stderr
