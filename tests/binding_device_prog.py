"""Three agents on the fake CUDA driver, one process each (tests/test_peer_binding_device_fake.py):
a peer hands the victim descriptors of "its own" region that name a THIRD agent's device memory.

    third DIR    registers a cudaMalloc region ("ipc") and a cuMem region ("vmm"), each the first
                 SIZE bytes of a 2*SIZE allocation whose second half (0x33) is in no region;
                 publishes DIR/third.meta, DIR/third.ipc, DIR/third.vmm; at DIR/done checks that
                 no byte of the second halves changed
    peer DIR     registers a device region of its own (#0) and publishes DIR/peer.meta and, as
                 descriptors of its region #0, DIR/peer.<case>:
                   third-ipc   the third agent's window (its pid, cookie, IPC handle) at offset SIZE
                   third-vmm   the third agent's cuMem window (its pid, cookie, fd server, token)
                   own-ipc     the third agent's IPC handle at offset SIZE with the peer's own pid,
                               sealed in the peer's memory (descforge.SealCell)
                   own-vmm     the third agent's fd server and token with the peer's own pid, sealed
                 and, as an agent it names "third" (DIR/impostor.meta), DIR/impostor.own-ipc: the
                 third agent's IPC handle as that impostor's own region, sealed
    victim DIR   reads the third agent's ipc region (its handle is then the third agent's here),
                 then writes 0x77 to and reads from every peer.<case> and impostor.own-ipc: each op must go through
                 (into the peer's own region #0) or be refused naming the peer, on no device path
                 that maps the third agent's memory; what it reads never holds 0x33
    fuzz-target DIR  registers the middle SIZE bytes (0x55) of a 3*SIZE cudaMalloc allocation and of a
                 cuMem one (guards 0xEE around), publishes DIR/ft.meta, DIR/ft.ipc, DIR/ft.vmm; at
                 DIR/done checks that the guards never changed
    fuzz DIR     for both regions, every byte of the descriptor flipped: a write of 0x55 and a read;
                 each goes through (in the region) or is refused naming the peer or the descriptor,
                 and what it reads holds only 0x55
Each role prints "<role> ok" when it passed.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

from descforge import Region, SealCell
from flagcx_mesh import MeshError
from flagcx_mesh.agent import Agent
from agent_device_prog import FakeDevice, check
from meshutil import publish, read_published

SECRET = "binding-device-secret"
SIZE = 64 << 10
CASES = ("third-ipc", "third-vmm", "own-ipc", "own-vmm")


def wait_done(d):
    read_published(d, "done", timeout=60)


def third(d):
    dev = FakeDevice()
    with Agent("third", SECRET, timeout=20) as t:
        bufs = {}
        for kind in ("ipc", "vmm"):
            buf = dev.buffer(kind, 2 * SIZE)
            buf.write(0, b"\x33" * (2 * SIZE))
            bufs[kind] = buf
            region = t.register(type(buf)(buf.cu, buf.ptr, SIZE))
            publish(d, f"third.{kind}", region.descriptor)
        publish(d, "third.meta", t.metadata())
        wait_done(d)
        for kind, buf in bufs.items():
            check(buf.read(SIZE, SIZE) == b"\x33" * SIZE, f"third: bytes of its {kind} allocation outside the region changed")
    print("third ok", flush=True)


def peer(d):
    dev = FakeDevice()
    with Agent("peer", SECRET, timeout=20) as p:
        own = Region.decode(p.register(dev.buffer("ipc", SIZE)).descriptor)
        cells = []
        for case in CASES:
            theirs = Region.decode(read_published(d, "third." + case.split("-")[1], timeout=60))
            w = theirs.win()
            if case.endswith("ipc"):
                w = replace(w, ipc_offset=w.ipc_offset + SIZE)
            if case.startswith("own"):
                mine = own.win()
                w = replace(w, pid=mine.pid, host=mine.host, ns=mine.ns, cookie=mine.cookie)
                cells.append(SealCell())
                w = cells[-1].publish(w, own.index)
            publish(d, "peer." + case, own.with_win(w).encode())
        publish(d, "peer.meta", p.metadata())
        # A holder of the secret connects under the third agent's name (the victim takes it for a
        # restart of it) and presents the third agent's IPC handle as its own region, sealed.
        with Agent("third", SECRET, timeout=20) as impostor:
            mine = Region.decode(impostor.register(dev.buffer("ipc", SIZE)).descriptor)
            w = replace(Region.decode(read_published(d, "third.ipc", timeout=60)).win(), pid=mine.win().pid,
                        host=mine.win().host, ns=mine.win().ns, cookie=mine.win().cookie)
            w = replace(w, ipc_offset=w.ipc_offset + SIZE)
            cells.append(SealCell())
            publish(d, "impostor.own-ipc", mine.with_win(cells[-1].publish(w, mine.index)).encode())
            publish(d, "impostor.meta", impostor.metadata())
            wait_done(d)
    print("peer ok", flush=True)


def victim(d):
    dev = FakeDevice()
    with Agent("victim", SECRET, timeout=20) as v:
        src = dev.buffer("ipc", SIZE)
        src.write(0, b"\x77" * SIZE)
        back = dev.buffer("ipc", SIZE)
        lsrc, lback = v.register(src), v.register(back)
        t = v.connect(read_published(d, "third.meta", timeout=60), timeout=20)
        t.read(lback, read_published(d, "third.ipc"), SIZE).wait(20)  # the third agent's own, in its region
        check(t.path_to(read_published(d, "third.ipc"), lback) == "cuda-ipc", "third: not over cuda-ipc")
        p = v.connect(read_published(d, "peer.meta", timeout=60), timeout=20)
        bad = []  # every case is tried, whatever an earlier one did
        for case in CASES:
            forged = read_published(d, "peer." + case, timeout=60)
            back.write(0, bytes(SIZE))
            for op, local in (("write", lsrc), ("read", lback)):
                try:
                    getattr(p, op)(local, forged, SIZE).wait(20)
                    verdict = "went through"
                except MeshError as e:
                    check("agent peer" in str(e), f"{case} {op}: the error names no peer: {e}")
                    verdict = f"refused: {e}"
                print(f"VERDICT {case} {op} {verdict}", flush=True)
            path = p.path_to(forged, lback) if "went through" in verdict else "-"
            print(f"VERDICT {case} path {path}", flush=True)
            if path in ("cuda-ipc", "cuda-vmm"):
                bad.append(f"{case}: the third agent's memory was mapped ({path})")
            if b"\x33" in back.read(0, SIZE):
                bad.append(f"{case}: the read brought the third agent's bytes")
        # The impostor under the third agent's name. The third agent is alive, so the victim
        # refuses a second agent of that name at connect (docs/agent.md); were it let in, the
        # IPC claim (the third agent's process, not its name) must still keep it from the handle.
        try:
            imp = v.connect(read_published(d, "impostor.meta", timeout=60), timeout=20)
        except MeshError as e:
            check("a second agent named third is refused" in str(e), f"impostor connect: {e}")
            print(f"VERDICT impostor connect refused: {e}", flush=True)
            imp = None
        forged = read_published(d, "impostor.own-ipc", timeout=60)
        back.write(0, bytes(SIZE))
        for op, local in (("write", lsrc), ("read", lback)) if imp is not None else ():
            try:
                getattr(imp, op)(local, forged, SIZE).wait(20)
                verdict = "went through"
            except MeshError as e:
                check("agent third" in str(e), f"impostor {op}: the error names no peer: {e}")
                verdict = f"refused: {e}"
            print(f"VERDICT impostor {op} {verdict}", flush=True)
        path = imp.path_to(forged, lback) if imp is not None and "went through" in verdict else "-"
        print(f"VERDICT impostor path {path}", flush=True)
        if path == "cuda-ipc":
            bad.append("impostor: the third agent's memory was mapped for a peer under its name")
        if b"\x33" in back.read(0, SIZE):
            bad.append("impostor: the read brought the third agent's bytes")
        publish(d, "done", b"")
        check(not bad, "; ".join(bad))
    print("victim ok", flush=True)


def fuzz_target(d):
    dev = FakeDevice()
    with Agent("ftarget", SECRET, timeout=20) as t:
        bufs = {}
        for kind in ("ipc", "vmm"):
            buf = dev.buffer(kind, 3 * SIZE)
            buf.write(0, b"\xee" * SIZE + b"\x55" * SIZE + b"\xee" * SIZE)
            bufs[kind] = buf
            publish(d, f"ft.{kind}", t.register(type(buf)(buf.cu, buf.ptr + SIZE, SIZE)).descriptor)
        publish(d, "ft.meta", t.metadata())
        wait_done(d)
        for kind, buf in bufs.items():
            check(buf.read(0, SIZE) == b"\xee" * SIZE and buf.read(2 * SIZE, SIZE) == b"\xee" * SIZE,
                  f"fuzz-target: a guard byte of the {kind} region changed")
            check(buf.read(SIZE, SIZE) == b"\x55" * SIZE, f"fuzz-target: the {kind} region holds other bytes")
    print("fuzz-target ok", flush=True)


def fuzz(d):
    dev = FakeDevice()
    started = time.monotonic()
    with Agent("fuzzer", SECRET, timeout=20) as v:
        src, back = dev.buffer("ipc", SIZE), dev.buffer("ipc", SIZE)
        src.write(0, b"\x55" * SIZE)
        lsrc, lback = v.register(src), v.register(back)
        c = v.connect(read_published(d, "ft.meta", timeout=60), timeout=20)
        refused = paths = 0
        for kind in ("ipc", "vmm"):
            desc = read_published(d, "ft." + kind)
            c.write(lsrc, desc, SIZE).wait(20)
            check(c.path_to(desc, lback) == "cuda-" + kind, f"fuzz: {kind} region not over cuda-{kind}")
            for i in range(len(desc)):
                c.close()  # a fresh connection per flip: its path is chosen afresh
                c = v.connect(read_published(d, "ft.meta"), timeout=20)
                bad = bytearray(desc)
                bad[i] ^= 0xFF if i % 2 else 0x01
                back.write(0, bytes(SIZE))
                for op, local in (("write", lsrc), ("read", lback)):
                    try:
                        getattr(c, op)(local, bytes(bad), SIZE).wait(20)
                    except MeshError as e:
                        refused += 1
                        check("agent ftarget" in str(e) or "region descriptor" in str(e), f"byte {i}: {e}")
                got = back.read(0, SIZE)
                check(got.strip(b"\x55") == b"" or got == bytes(SIZE), f"{kind} byte {i}: a read brought other bytes")
        print(f"FUZZ {refused} refused in {time.monotonic() - started:.1f} s", flush=True)
        check(refused > 0, "fuzz: nothing was refused")
        publish(d, "done", b"")
    print("fuzz ok", flush=True)


if __name__ == "__main__":
    role, directory = sys.argv[1], sys.argv[2]
    try:
        {"third": third, "peer": peer, "victim": victim, "fuzz-target": fuzz_target, "fuzz": fuzz}[role](directory)
    finally:
        if role in ("victim", "fuzz") and not os.path.exists(os.path.join(directory, "done")):
            publish(directory, "done", b"")  # the others stop waiting
    time.sleep(0.1)
