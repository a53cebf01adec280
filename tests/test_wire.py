"""Unit tests of the wire format (the 64-byte connection header) and the unique id.

Single process; no mesh is built. The header is produced by the core's own encoder
(_core._wire_encode) and judged by the same decode + validate path the mesh listener
uses (_core._wire_check), so these tests pin the on-wire layout and every reject reason.
"""

import random
import struct

import pytest

import flagcx_mesh
from flagcx_mesh import _core
from flagcx_mesh.errors import InvalidArgument, MeshError

pytestmark = pytest.mark.timeout(60)

HDR = 64
CONN_MAGIC = 0x484D5846  # "FXMH"
MESH_ID = bytes(range(16))
OTHER_ID = bytes(range(100, 116))


def fnv1a(data: bytes) -> int:
    h = 2166136261
    for b in data:
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


def header(**over):
    """A header dict that the expectation below accepts; override any field."""
    h = dict(role=_core.ROLE_CONNECT, mesh_id=MESH_ID, epoch=7, src=2, dst=1, context=1,
             nranks=4, ncontexts=3)
    h.update(over)
    return h


def expect(**over):
    """What rank 1 of a 4-rank, 3-context mesh (epoch 7) expects of a connecting peer.
    _wire_check reads `dst` as "me"; src/context are ignored."""
    e = dict(role=_core.ROLE_CONNECT, mesh_id=MESH_ID, epoch=7, src=0, dst=1, context=0,
             nranks=4, ncontexts=3)
    e.update(over)
    return e


def verdict(raw, exp=None):
    return _core._wire_check(bytes(raw), exp or expect())[0]


# ----------------------------------------------------------------------------- layout / round trip

def test_constants():
    assert _core.CONN_HEADER_SIZE == HDR
    assert _core.UNIQUE_ID_SIZE == 256 == flagcx_mesh.UNIQUE_ID_SIZE
    assert {_core.ROLE_CONNECT, _core.ROLE_ACCEPT} == {1, 2}


def test_encode_layout_is_fixed_little_endian():
    raw = _core._wire_encode(header(epoch=0x01020304, src=3, dst=1, context=2))
    assert isinstance(raw, bytes) and len(raw) == HDR
    magic, version, role = struct.unpack_from("<IHH", raw, 0)
    assert (magic, version, role) == (CONN_MAGIC, 8, _core.ROLE_CONNECT) and _core.WIRE_VERSION == 8
    assert raw[0:4] == b"FXMH"
    assert raw[8:24] == MESH_ID
    assert struct.unpack_from("<IiiIII", raw, 24) == (0x01020304, 3, 1, 2, 4, 3)
    assert raw[48:60] == bytes(12), "reserved bytes must be zero"
    assert struct.unpack_from("<I", raw, 60)[0] == fnv1a(raw[:60]), "checksum = FNV-1a of bytes 0..59"


@pytest.mark.parametrize("fields", [
    {},
    dict(role=_core.ROLE_ACCEPT),
    dict(src=0, dst=1, context=0, nranks=2, ncontexts=1, epoch=0),
    dict(src=1023, dst=1, context=1023, nranks=1024, ncontexts=1024, epoch=0xFFFFFFFF),
    dict(mesh_id=b"\xff" * 16),
])
def test_round_trip(fields):
    h = header(**fields)
    exp = expect(role=h["role"], mesh_id=h["mesh_id"], epoch=h["epoch"], dst=h["dst"],
                 nranks=h["nranks"], ncontexts=h["ncontexts"])
    v, decoded = _core._wire_check(_core._wire_encode(h), exp)
    assert v == "accepted"
    assert decoded == h


def test_encode_is_deterministic_and_field_sensitive():
    base = _core._wire_encode(header())
    assert _core._wire_encode(header()) == base
    for key, value in [("epoch", 8), ("src", 3), ("dst", 2), ("context", 2), ("nranks", 5),
                       ("ncontexts", 2), ("role", _core.ROLE_ACCEPT), ("mesh_id", OTHER_ID)]:
        assert _core._wire_encode(header(**{key: value})) != base, key


def test_encode_rejects_bad_mesh_id_length():
    with pytest.raises(ValueError, match="16 bytes"):
        _core._wire_encode(header(mesh_id=b"short"))


# ----------------------------------------------------------------------------- every reject reason

@pytest.mark.parametrize("fields, exp, reason", [
    (dict(magic=0xDEADBEEF), {}, "bad magic"),
    (dict(magic=0x464D5846), {}, "bad magic"),  # the frame magic is not a header magic
    (dict(version=1), {}, "unsupported version"),  # before the key proofs
    (dict(version=2), {}, "unsupported version"),  # before lazy acks
    (dict(version=3), {}, "unsupported version"),  # before the agents' tcp lanes
    (dict(version=4), {}, "unsupported version"),  # before the batches of staged writes (kPutBlocks)
    (dict(version=5), {}, "unsupported version"),  # before kPutBlocks into host windows (tcp batches)
    (dict(version=6), {}, "unsupported version"),  # before the acceptor's confirm of a mesh connection
    (dict(version=7), {}, "unsupported version"),  # before batches of tcp writes striped over the lanes
    (dict(version=9), {}, "unsupported version"),
    (dict(version=0), {}, "unsupported version"),
    (dict(role=_core.ROLE_ACCEPT), {}, "bad role"),
    (dict(role=0), {}, "bad role"),
    (dict(role=77), {}, "bad role"),
    (dict(mesh_id=OTHER_ID), {}, "foreign mesh id"),
    (dict(epoch=6), {}, "wrong epoch"),
    (dict(epoch=8), {}, "wrong epoch"),
    (dict(dst=0), {}, "wrong destination rank"),
    (dict(dst=3), {}, "wrong destination rank"),
    (dict(dst=-1), {}, "wrong destination rank"),
    (dict(src=-1), {}, "source rank out of range"),
    (dict(src=4), {}, "source rank out of range"),
    (dict(src=2 ** 31 - 1), {}, "source rank out of range"),
    (dict(context=3), {}, "context out of range"),
    (dict(context=2 ** 32 - 1), {}, "context out of range"),
    (dict(nranks=5), {}, "nranks/contexts mismatch"),
    (dict(nranks=3), {}, "nranks/contexts mismatch"),
    (dict(ncontexts=1), {}, "nranks/contexts mismatch"),
    # the acceptor's answer checked by a connector expecting ROLE_ACCEPT
    ({}, dict(role=_core.ROLE_ACCEPT), "bad role"),
])
def test_reject_reason(fields, exp, reason):
    v, decoded = _core._wire_check(_core._wire_encode(header(**fields)), expect(**exp))
    assert v == reason
    if reason in ("bad magic", "unsupported version"):
        assert decoded is None  # refused before any field is trusted


def test_checksum_catches_every_single_byte_change():
    raw = _core._wire_encode(header())
    seen = set()
    for pos in range(HDR):
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(raw)
            bad[pos] ^= flip
            v = verdict(bad)
            seen.add(v)
            if pos < 4:
                assert v == "bad magic", (pos, flip)
            elif pos < 6:
                assert v == "unsupported version", (pos, flip)
            else:
                assert v == "bad checksum", (pos, flip, v)
    assert seen == {"bad magic", "unsupported version", "bad checksum"}


def test_reserved_bytes_are_covered_by_the_checksum():
    raw = bytearray(_core._wire_encode(header()))
    raw[50] = 1
    assert verdict(raw) == "bad checksum"


@pytest.mark.parametrize("length", [0, 1, 4, 30, 59, 63])
def test_truncated(length):
    raw = _core._wire_encode(header())
    assert _core._wire_check(raw[:length], expect()) == ("truncated header", None)


def test_precedence_magic_then_version_then_checksum():
    raw = bytearray(_core._wire_encode(header(version=9)))
    raw[40] ^= 1  # also breaks the checksum
    assert verdict(raw) == "unsupported version"
    raw[0] ^= 1
    assert verdict(raw) == "bad magic"


# ----------------------------------------------------------------------------- garbage never accepted

def test_random_garbage_is_never_accepted():
    rng = random.Random(20240611)
    exp = expect()
    counts = {}
    for i in range(20000):
        if i % 4 == 0:
            raw = bytes(rng.getrandbits(8) for _ in range(HDR))
        elif i % 4 == 1:  # right magic, random rest
            raw = b"FXMH" + bytes(rng.getrandbits(8) for _ in range(HDR - 4))
        elif i % 4 == 2:  # right magic and version, random rest
            raw = b"FXMH\x02\x00" + bytes(rng.getrandbits(8) for _ in range(HDR - 6))
        else:  # a valid header with 1..4 random bytes changed
            raw = bytearray(_core._wire_encode(header()))
            changed = False
            for _ in range(rng.randint(1, 4)):
                pos, val = rng.randrange(HDR), rng.getrandbits(8)
                changed |= raw[pos] != val
                raw[pos] = val
            if not changed or bytes(raw) == _core._wire_encode(header()):
                continue
        v, _ = _core._wire_check(bytes(raw), exp)
        counts[v] = counts.get(v, 0) + 1
        assert v != "accepted", raw.hex()
    assert {"bad magic", "unsupported version", "bad checksum"} <= set(counts)


def _model(h, e):
    """Reference model of the listener's identity check (same order as the core)."""
    if h["role"] != e["role"]:
        return "bad role"
    if h["mesh_id"] != e["mesh_id"]:
        return "foreign mesh id"
    if h["epoch"] != e["epoch"]:
        return "wrong epoch"
    if h["nranks"] != e["nranks"] or h["ncontexts"] != e["ncontexts"]:
        return "nranks/contexts mismatch"
    if h["dst"] != e["dst"]:
        return "wrong destination rank"
    if not 0 <= h["src"] < e["nranks"]:
        return "source rank out of range"
    if not h["context"] < e["ncontexts"]:
        return "context out of range"
    return "accepted"


def test_well_formed_headers_are_accepted_exactly_when_identity_matches():
    rng = random.Random(7)
    exp = expect()
    verdicts = {}
    for _ in range(5000):
        pick = lambda good, *bad: good if rng.random() < 0.8 else rng.choice(bad)  # noqa: E731
        h = dict(role=pick(_core.ROLE_CONNECT, _core.ROLE_ACCEPT, 0, 3),
                 mesh_id=pick(MESH_ID, OTHER_ID, bytes(16)),
                 epoch=pick(7, 0, 8, 2 ** 32 - 1),
                 src=pick(rng.randrange(4), -1, 4, -(2 ** 31)),
                 dst=pick(1, 0, 2, 3, -5),
                 context=pick(rng.randrange(3), 3, 2 ** 32 - 1),
                 nranks=pick(4, 1, 5),
                 ncontexts=pick(3, 1, 4))
        v, decoded = _core._wire_check(_core._wire_encode(h), exp)
        assert v == _model(h, exp), h
        assert decoded == h
        verdicts[v] = verdicts.get(v, 0) + 1
    assert len(verdicts) == 8, verdicts  # every path of the model was exercised


# ----------------------------------------------------------------------------- unique id

def test_unique_id_shape_and_info():
    a, b = flagcx_mesh.get_unique_id(), flagcx_mesh.get_unique_id()
    assert isinstance(a, bytes) and len(a) == 256 and len(b) == 256
    ia, ib = _core._unique_id_info(a), _core._unique_id_info(b)
    assert set(ia) == {"root", "mesh_id", "epoch"} and ia["epoch"] == 0
    assert len(ia["mesh_id"]) == 32 and int(ia["mesh_id"], 16) >= 0
    assert ia["mesh_id"] != ib["mesh_id"], "two unique ids must carry different mesh ids"
    assert ia["root"] != ib["root"], "each unique id hosts its own root on its own ephemeral port"
    host, _, port = ia["root"].rpartition(":")
    assert host and 0 < int(port) < 65536
    assert a[0:4] == b"FXMU"
    assert struct.unpack_from("<H", a, 4) == (2,), "unique id version 2"
    assert a[48:52] == bytes(4), "epoch 0"
    assert a[52:84] != b[52:84] and a[52:84] != bytes(32), "each id holds its own random secret"
    assert a[84:] == bytes(172), "bytes after the secret are zero"
    assert struct.unpack_from("<I", a, 44)[0] == fnv1a(a[:44] + a[48:])
    assert bytes.fromhex(ia["mesh_id"]) == a[28:44]


def test_many_unique_ids_have_distinct_mesh_ids():
    ids = {_core._unique_id_info(flagcx_mesh.get_unique_id())["mesh_id"] for _ in range(20)}
    assert len(ids) == 20


@pytest.fixture(scope="module")
def uid():
    return flagcx_mesh.get_unique_id()


@pytest.mark.parametrize("length", [0, 1, 128, 255, 257, 512])
def test_unique_id_wrong_length(uid, length):
    raw = (uid * 2)[:length]
    with pytest.raises(InvalidArgument, match=f"unique id must be 256 bytes, got {length}") as info:
        _core._unique_id_info(raw)
    assert isinstance(info.value, MeshError) and isinstance(info.value, ValueError)
    assert info.value.code == 1 and info.value.peer == -1


def _with(uid, pos, value):
    b = bytearray(uid)
    b[pos] = value
    return bytes(b)


def _resum(b):
    b = bytearray(b)
    struct.pack_into("<I", b, 44, fnv1a(bytes(b[:44] + b[48:])))
    return bytes(b)


@pytest.mark.parametrize("mutate, match", [
    (lambda u: _with(u, 0, u[0] ^ 0xFF), "bad magic"),
    (lambda u: bytes(256), "bad magic"),
    (lambda u: b"GET / HTTP/1.1\r\n".ljust(256, b"\0"), "bad magic"),
    (lambda u: _with(u, 4, 1), "version 1 is not supported"),
    (lambda u: _with(u, 4, 3), "version 3 is not supported"),
    (lambda u: _with(u, 60, u[60] ^ 1), "corrupted"),       # a secret byte
    (lambda u: _with(u, 48, 1), "corrupted"),               # the epoch
    (lambda u: _with(u, 30, u[30] ^ 1), "corrupted"),       # a mesh id byte
    (lambda u: _with(u, 10, u[10] ^ 1), "corrupted"),       # a root port byte
    (lambda u: _with(u, 45, u[45] ^ 1), "corrupted"),       # the checksum itself
    (lambda u: _resum(_with(u, 8, 9)), "unknown address family"),
])
def test_unique_id_rejects_bad_bytes(uid, mutate, match):
    with pytest.raises(InvalidArgument, match=match):
        _core._unique_id_info(mutate(uid))


def test_unique_id_survives_a_round_trip_through_hex(uid):
    assert _core._unique_id_info(bytes.fromhex(uid.hex())) == _core._unique_id_info(uid)


# ----------------------------------------------------------------------------- SHA-256 / HMAC-SHA256

# FIPS 180-4 examples (NIST CSRC "SHA256.pdf", "SHA2_Additional.pdf").
SHA256_VECTORS = [
    (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    (b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    (b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
     "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"),
    (b"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqr"
     b"lmnopqrsmnopqrstnopqrstu",
     "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"),
    (b"a" * 1000000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"),
    (b"\xbd", "68325720aabd7c82f30f554b313d0570c95accbb7dc4b5aae11204c08ffe732b"),
    (b"\xc9\x8c\x8e\x55", "7abc22c0ae5af26ce93dbb94433a0e0b2e119d014f8e7f65bd56c61ccccd9504"),
    (bytes(55), "02779466cdec163811d078815c633f21901413081449002f24aa3e80f0b88ef7"),
    (bytes(56), "d4817aa5497628e7c77e6b606107042bbba3130888c5f47a375e6179be789fbb"),
    (bytes(57), "65a16cb7861335d5ace3c60718b5052e44660726da4cd13bb745381b235a1785"),
    (bytes(64), "f5a5fd42d16a20302798ef6ed309979b43003d2320d9f0e8ea9831a92759fb4b"),
]


@pytest.mark.parametrize("message, digest", SHA256_VECTORS, ids=range(len(SHA256_VECTORS)))
def test_sha256_nist_examples(message, digest):
    assert _core._sha256(message).hex() == digest


# RFC 4231 section 4: test cases 1-7 for HMAC-SHA-256 (case 5 compares the first 128 bits).
HMAC_VECTORS = [
    (b"\x0b" * 20, b"Hi There",
     "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
    (b"Jefe", b"what do ya want for nothing?",
     "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
    (b"\xaa" * 20, b"\xdd" * 50,
     "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"),
    (bytes(range(1, 26)), b"\xcd" * 50,
     "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"),
    (b"\x0c" * 20, b"Test With Truncation", "a3b6167473100ee06e0c796c2955552b"),
    (b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First",
     "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"),
    (b"\xaa" * 131, b"This is a test using a larger than block-size key and a larger than block-size "
                    b"data. The key needs to be hashed before being used by the HMAC algorithm.",
     "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"),
]


@pytest.mark.parametrize("key, data, mac", HMAC_VECTORS, ids=range(1, 8))
def test_hmac_sha256_rfc4231(key, data, mac):
    assert _core._hmac_sha256(key, data).hex()[:len(mac)] == mac


def test_sha256_and_hmac_agree_with_hashlib_at_every_length():
    """Every padding case (lengths around the 55/56/64-byte boundaries) and keys around the
    block size, against the interpreter's own implementation."""
    import hashlib
    import hmac
    rng = random.Random(4231)
    for n in list(range(0, 200)) + [1000, 4095, 4096, 65537]:
        data = bytes(rng.getrandbits(8) for _ in range(n))
        assert _core._sha256(data) == hashlib.sha256(data).digest(), n
        key = bytes(rng.getrandbits(8) for _ in range(n % 140))
        assert _core._hmac_sha256(key, data) == hmac.new(key, data, "sha256").digest(), n


def test_constant_time_compare():
    a = bytes(range(32))
    assert _core._equal_ct(a, a)
    for i in range(32):
        b = bytearray(a)
        b[i] ^= 0x80
        assert not _core._equal_ct(a, bytes(b))
    assert not _core._equal_ct(a, a[:31])


def test_derived_keys_differ_per_epoch_and_mesh():
    secret = bytes(range(32))
    k0 = _core._derive_key(secret, MESH_ID, 0)
    assert len(k0) == 32 and k0 != secret
    assert k0 == _core._derive_key(secret, MESH_ID, 0)
    assert k0 != _core._derive_key(secret, MESH_ID, 1)
    assert k0 != _core._derive_key(secret, OTHER_ID, 0)
    assert k0 != _core._derive_key(bytes(32), MESH_ID, 0)


def test_handshake_macs_bind_role_and_both_nonces():
    key = bytes(range(32))
    hello = _core._wire_encode(header()) + bytes(32)
    answer = _core._wire_encode(header(role=_core.ROLE_ACCEPT)) + bytes([1]) * 32
    connect = _core._handshake_mac(key, _core.ROLE_CONNECT, hello, answer)
    accept = _core._handshake_mac(key, _core.ROLE_ACCEPT, hello, answer)
    assert connect != accept, "one side's MAC must not serve as the other's"
    for pos in (0, 20, 63, 64, 95):
        h = bytearray(hello)
        h[pos] ^= 1
        assert _core._handshake_mac(key, _core.ROLE_CONNECT, bytes(h), answer) != connect, pos
        a = bytearray(answer)
        a[pos] ^= 1
        assert _core._handshake_mac(key, _core.ROLE_CONNECT, hello, bytes(a)) != connect, pos
    assert _core._handshake_mac(bytes(32), _core.ROLE_CONNECT, hello, answer) != connect
