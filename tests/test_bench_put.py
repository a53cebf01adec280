"""bench put's own parts: --bytes sets what each figure moves, and the raw TCP references'
receiver takes exactly the bytes of its transfers (a miscount would hang the bench or leave
bytes for the next figure)."""

import socket
import threading

import pytest

from flagcx_mesh.bench.onesided import put


def test_bytes_sets_the_repetitions_of_every_figure():
    args = put._parse(["--bytes", "64M"], "put")
    assert args.bytes == 64 << 20
    try:
        put.set_bytes_per_figure(args.bytes)
        assert put._reps(1 << 20) == 64
        assert put._reps(64 << 20) == 3      # at least 3 ops a figure
        assert put._reps(4096) == 2000       # at most 2000
    finally:
        put.set_bytes_per_figure(put.TARGET_BYTES)
    assert put._reps(1 << 20) == 256


def test_bytes_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        put._parse(["--bytes", "0"], "put")
    assert "--bytes must be at least 1" in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [1, 4095, put.RECV_CALL_BYTES + 3])
def test_the_references_receiver_takes_exactly_its_transfers(size):
    a, b = socket.socketpair()
    try:
        reps = 3
        payload = bytes(range(256)) * (size // 256 + 1)
        sender = threading.Thread(target=lambda: [a.sendall(payload[:size]) for _ in range(reps)] + [a.sendall(b"!")])
        sender.start()
        put._land(b, reps, size)
        sender.join(10)
        assert b.recv(16) == b"!"  # nothing of the transfers was left behind
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_the_streams_ucx_opened_are_counted_from_this_process_tcp_connections():
    """bench put counts UCX's streams as this process's new established TCP connections: a
    loopback connection opened here adds two (its two ends), a closed one leaves."""
    before = put.tcp_connections()
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        assert len(put.tcp_connections() - before) == 2
    finally:
        for s in (client, accepted, server):
            s.close()
    assert len(put.tcp_connections() - before) == 0
