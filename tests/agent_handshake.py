"""The connector's side of the agents' handshake, written from docs/agent.md ("The wire") in
Python alone, so tests can open one socket of a connection (lane 0 without its lanes, a lane
with a token of their choosing) and see what the listener answers.

dial() returns (socket, verdict text, the acceptor's identity); the socket stays open.
accept() is the acceptor's side of one socket, so tests can answer a real connector as an
acceptor that misbehaves would.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

from flagcx_mesh import _core

AGENT_DOMAIN = b"flagcx_mesh agnt"
HEADER, NONCE, MAC = 64, 32, 32  # the header (its incarnation at bytes 8..24, ext_len at 48), nonce, HMAC-SHA256
FRAME_MAGIC = 0x464D5846
FRAME_ADMIT = 9  # wire::FrameType::kAdmit


def agent_key(secret: str) -> bytes:
    root = hashlib.sha256(secret.encode()).digest()
    return hmac.new(root, b"flagcx_mesh epoch key v1\0" + AGENT_DOMAIN + struct.pack("<I", 0), "sha256").digest()


def ident(name: str, expect: bytes = bytes(16), lanes: int = 1, lane: int = 0, token: int = 0) -> bytes:
    n = name.encode()
    return bytes([len(n)]) + n + expect + bytes([lanes, lane]) + struct.pack("<Q", token)


def parse_ident(b: bytes) -> dict:
    n = b[0]
    rest = b[1 + n:]
    return dict(name=b[1:1 + n].decode(), expect=rest[:16], lanes=rest[16], lane=rest[17],
                token=struct.unpack_from("<Q", rest, 18)[0])


def _mac(key: bytes, label: bytes, hello: bytes, answer_head: bytes, bound: bytes) -> bytes:
    return hmac.new(key, label + b"\0" + hello + answer_head + bound, "sha256").digest()


def _read(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += got
    return out


def dial(address: str, secret: str, my_ident: bytes, incarnation: bytes = None, timeout: float = 10.0):
    """One socket's handshake as `my_ident` (incarnation: this side's, random when None)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    head = _core._wire_encode(dict(role=_core.ROLE_AGENT_CONNECT, mesh_id=incarnation or os.urandom(16), epoch=0,
                                   src=-1, dst=-1, context=0, nranks=0, ncontexts=1, ext_len=len(my_ident)))
    hello = head + os.urandom(NONCE)
    sock.sendall(hello + my_ident)
    answer = _read(sock, HEADER + NONCE + MAC)
    ext_len = struct.unpack_from("<I", answer, 48)[0]
    theirs = _read(sock, ext_len)
    key = agent_key(secret)
    bound = my_ident + theirs
    assert hmac.compare_digest(answer[HEADER + NONCE:], _mac(key, b"flagcx_mesh accept proof", hello,
                                                              answer[:HEADER + NONCE], bound)), "no proof"
    sock.sendall(_mac(key, b"flagcx_mesh connect proof", hello, answer[:HEADER + NONCE], bound))
    frame = _read(sock, 16)
    magic, _type, _flags, length = struct.unpack("<IHHQ", frame)
    assert magic == FRAME_MAGIC, frame
    verdict = _read(sock, length).decode()
    info = parse_ident(theirs)
    info["incarnation"] = answer[8:24]
    return sock, verdict, info


def accept(sock: socket.socket, secret: str, name: str, lanes_for, verdict: str = "", incarnation: bytes = None):
    """The acceptor's side on an accepted socket: answers as agent `name` (incarnation random
    when None) with lanes_for(the connector's identity) in its lanes field, checks the proof,
    sends `verdict`. Returns the connector's identity."""
    hello = _read(sock, HEADER + NONCE)
    theirs = _read(sock, struct.unpack_from("<I", hello, 48)[0])
    info = parse_ident(theirs)
    mine = ident(name, hello[8:24], lanes_for(info), info["lane"], info["token"])
    head = _core._wire_encode(dict(role=_core.ROLE_AGENT_ACCEPT, mesh_id=incarnation or os.urandom(16), epoch=0,
                                   src=-1, dst=-1, context=0, nranks=0, ncontexts=1, ext_len=len(mine)))
    answer_head = head + os.urandom(NONCE)
    key, bound = agent_key(secret), theirs + mine
    sock.sendall(answer_head + _mac(key, b"flagcx_mesh accept proof", hello, answer_head, bound) + mine)
    proof = _read(sock, MAC)
    assert hmac.compare_digest(proof, _mac(key, b"flagcx_mesh connect proof", hello, answer_head, bound)), "no proof"
    v = verdict.encode()
    sock.sendall(struct.pack("<IHHQ", FRAME_MAGIC, FRAME_ADMIT, 0, len(v)) + v)
    return info
