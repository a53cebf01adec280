"""Stream waits on notifications (Agent.stream_wait_notification), one scenario per process:
tests/test_agent_stream_wait_fake.py runs each on the fake CUDA driver, scripts/test-gpu.sh
with --device torch on a real GPU. Each scenario queues a wait on a stream, then a copy
behind it (the "later work"), and checks when that copy landed.

    arrives   the copy lands only after the notification arrived; the wait consumed it
    unread    a notification that arrived and is unread releases the wait at once
    peer      a wait for one peer's notification ignores the same bytes from another peer
    timeout   nothing arrives: the stream is released after the wait's timeout (on stream 0,
              the legacy default stream), wait() raises MeshTimeout
    killed    the peer waited for is killed before notifying: released early, PeerLost names it
    closed    the agent closes with waits pending: released, MeshClosed
    hostwait  (FXM_FAKECUDA_NO_STREAM_MEMOPS=1) the call waits on the host instead
    peerproc  (the killed scenario's peer: connects and sleeps)
Each prints "<scenario> ok" when it passed; any failure exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import flagcx_mesh
from flagcx_mesh.agent import Agent
from agent_device_prog import check, make_device, pattern

SECRET = "agent-stream-wait-secret"
N = 65_536
HELD_S = 0.4  # how long a scenario checks that the later work is held


class Later:
    """A copy queued on the stream after the wait: dst holds zeros until it ran."""

    def __init__(self, dev, s, seed: int):
        self.dev, self.s, self.want = dev, s, pattern(seed, N)
        self.src, self.dst = dev.buffer("ipc", N), dev.buffer("ipc", N)
        self.src.write(0, self.want)

        self.side = None
        if hasattr(self.dst, "t"):  # torch: read dst on a stream of its own (a device-wide sync would wait)
            import torch

            self.side = torch.cuda.Stream()

    def queue(self) -> None:
        self.dev.copy_async(self.dst, 0, self.src, 0, N, self.s)

    def read(self) -> bytes:
        if self.side is None:
            return self.dst.read(0, N)
        import torch

        with torch.cuda.stream(self.side):
            return self.dst.t.cpu().numpy().tobytes()  # waits for the side stream only

    def landed(self) -> bool:
        got = self.read()
        check(got in (bytes(N), self.want), "the later copy landed torn")
        return got == self.want

    def held(self, seconds: float = HELD_S) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            check(not self.landed(), "the stream's later work ran before the wait was released")
            time.sleep(0.02)

    def finish(self, timeout: float) -> float:
        """Waits (bounded) for the copy; the seconds it took. Released, the copy may be running
        while dst is read (the fake driver copies in pieces): only its end is checked here."""
        t0 = time.monotonic()
        while self.read() != self.want:
            check(time.monotonic() - t0 < timeout, f"the stream's later work did not run within {timeout} s")
            time.sleep(0.005)
        return time.monotonic() - t0


def pair(args):
    target = Agent("target", SECRET, timeout=args.timeout)
    sender = Agent("sender", SECRET, timeout=args.timeout)
    conn = sender.connect(target.metadata())
    conn.notify(b"hello")  # the connection is open at the target once this arrived
    got = target.notifications(timeout=args.timeout)
    check([n.data for n in got] == [b"hello"], f"hello expected, got {got}")
    return target, sender, conn


def arrives(args, dev) -> None:
    target, sender, conn = pair(args)
    with target, sender:
        later = Later(dev, dev.stream(), 1)
        w = target.stream_wait_notification(b"kv-ready", later.s)
        later.queue()
        conn.notify(b"other")  # other bytes do not release it and still reach notifications()
        later.held()
        check(not w.done() and w.error == "", f"released early: {w!r}")
        conn.notify(b"kv-ready")
        took = later.finish(args.timeout)
        w.wait()
        check(w.done() and w.error == "" and w.sender == "sender", f"after the notification: {w!r}")
        left = [n.data for n in target.notifications(timeout=0.3)]
        check(left == [b"other"], f"the wait consumes its notification only: notifications() gave {left}")
        print(f"the later copy was seen landed {took * 1e3:.1f} ms after the notify (held {HELD_S} s before it; "
              f"the host polls every 5 ms)", flush=True)
    print("arrives ok", flush=True)


def unread(args, dev) -> None:
    target, sender, conn = pair(args)
    with target, sender:
        conn.notify(b"early")
        time.sleep(1.0)  # it arrived (a local socket), nobody read it
        later = Later(dev, dev.stream(), 2)
        w = target.stream_wait_notification(b"early", later.s)
        check(w.done() and w.error == "" and w.sender == "sender", f"an unread notification must release it: {w!r}")
        later.queue()
        later.finish(args.timeout)
        check(target.notifications(timeout=0.2) == [], "the unread notification was consumed by the wait")
        # one already read does not count: a later wait waits for a new one
        conn.notify(b"read")
        check([n.data for n in target.notifications(timeout=args.timeout)] == [b"read"], "read expected")
        w2 = target.stream_wait_notification(b"read", later.s, timeout=0.3)
        check(not w2.done(), "a notification already read released a later wait")
        try:
            w2.wait()
            raise SystemExit("FAILED: a wait for a notification already read passed")
        except flagcx_mesh.MeshTimeout:
            pass
    print("unread ok", flush=True)


def peer(args, dev) -> None:
    target, sender, conn = pair(args)
    other = Agent("sender-2", SECRET, timeout=args.timeout)
    with target, sender, other:
        conn2 = other.connect(target.metadata())
        later = Later(dev, dev.stream(), 3)
        w = target.stream_wait_notification(b"go", later.s, peer="sender-2")
        later.queue()
        conn.notify(b"go")  # the same bytes from the other peer
        later.held()
        got = [(n.peer, n.data) for n in target.notifications(timeout=0.2)]
        check(got == [("sender", b"go")], f"the other peer's notification must reach notifications(): {got}")
        check(not w.done(), f"released by another peer's notification: {w!r}")
        conn2.notify(b"go")
        later.finish(args.timeout)
        w.wait()
        check(w.sender == "sender-2", f"sender {w.sender!r}")
    print("peer ok", flush=True)


def timeout(args, dev) -> None:
    target, sender, conn = pair(args)
    with target, sender:
        s = 0 if args.device == "fake" else __import__("torch").cuda.default_stream()  # the legacy default stream
        later = Later(dev, s, 4)
        t0 = time.monotonic()
        w = target.stream_wait_notification(b"never", s, peer="sender", timeout=0.8)
        later.queue()
        later.held(0.3)
        took = later.finish(args.timeout)
        try:
            w.wait()
            raise SystemExit("FAILED: a wait whose notification never came passed")
        except flagcx_mesh.MeshTimeout as e:
            check("did not arrive" in str(e) and "never" in str(e) and "sender" in str(e), str(e))
        check("did not arrive" in w.error, w.error)
        total = time.monotonic() - t0
        check(0.7 < total < 0.8 + args.timeout / 2, f"released after {total:.2f} s, the timeout is 0.8 s")
        print(f"released after {total:.2f} s (timeout 0.8 s); error: {w.error}", flush=True)
        dev.sync(s)
    print("timeout ok", flush=True)


def killed(args, dev) -> None:
    with Agent("target", SECRET, timeout=args.timeout) as target:
        path = os.path.join(args.dir, "target.meta")
        with open(path + ".tmp", "wb") as f:
            f.write(target.metadata())
        os.rename(path + ".tmp", path)
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "peerproc", args.dir,
                                  "--timeout", str(args.timeout)], stdout=subprocess.PIPE, text=True)
        try:
            check(child.stdout.readline().strip() == "connected", "the peer did not connect")
            got = target.notifications(timeout=args.timeout)
            check([n.data for n in got] == [b"hello"], f"hello expected, got {got}")
            later = Later(dev, dev.stream(), 5)
            w = target.stream_wait_notification(b"never-sent", later.s, peer="doomed", timeout=args.timeout)
            later.queue()
            later.held(0.2)
            t0 = time.monotonic()
            child.kill()
            took = later.finish(args.timeout)
            try:
                w.wait()
                raise SystemExit("FAILED: a wait on a killed peer passed")
            except flagcx_mesh.PeerLost as e:
                check("doomed" in str(e) and "gone" in str(e), str(e))
            check(time.monotonic() - t0 < args.timeout / 2, "released only at the timeout, not at the peer's death")
            print(f"released {took * 1e3:.0f} ms after the kill; error: {w.error}", flush=True)
        finally:
            child.kill()
            child.wait()
    print("killed ok", flush=True)


def peerproc(args, dev) -> None:
    with Agent("doomed", SECRET, timeout=args.timeout) as a:
        with open(os.path.join(args.dir, "target.meta"), "rb") as f:
            conn = a.connect(f.read())
        conn.notify(b"hello")
        print("connected", flush=True)
        time.sleep(args.timeout * 4)


def closed(args, dev) -> None:
    target, sender, conn = pair(args)
    with sender:
        s = dev.stream()
        later = Later(dev, s, 6)
        waits = [target.stream_wait_notification(b"a", s, timeout=args.timeout),
                 target.stream_wait_notification(b"b", s, peer="sender", timeout=args.timeout)]
        later.queue()
        later.held(0.2)
        t0 = time.monotonic()
        target.close()
        later.finish(args.timeout)
        for w in waits:
            check(w.done(), f"pending after close: {w!r}")
            try:
                w.wait()
                raise SystemExit("FAILED: a wait passed at close")
            except flagcx_mesh.MeshClosed as e:
                check("closed with the wait pending" in str(e), str(e))
        try:
            target.stream_wait_notification(b"c", s)
            raise SystemExit("FAILED: a closed agent queued a wait")
        except flagcx_mesh.MeshClosed:
            pass
        print(f"close released {len(waits)} waits in {(time.monotonic() - t0) * 1e3:.0f} ms", flush=True)
    print("closed ok", flush=True)


def hostwait(args, dev) -> None:
    """FXM_FAKECUDA_NO_STREAM_MEMOPS: the call itself waits on the host for the notification."""
    import threading

    target, sender, conn = pair(args)
    with target, sender:
        later = Later(dev, dev.stream(), 7)
        threading.Timer(HELD_S, lambda: conn.notify(b"late")).start()
        t0 = time.monotonic()
        w = target.stream_wait_notification(b"late", later.s)
        took = time.monotonic() - t0
        check(w.done() and w.error == "" and took >= HELD_S * 0.9, f"returned after {took:.2f} s: {w!r}")
        later.queue()
        later.finish(args.timeout)
        w2 = target.stream_wait_notification(b"never", later.s, timeout=0.3)
        check(w2.done() and "did not arrive" in w2.error, f"a host wait past its timeout: {w2!r}")
        print(f"the call waited {took:.2f} s on the host", flush=True)
    print("hostwait ok", flush=True)


SCENARIOS = {"hostwait": hostwait, "arrives": arrives, "unread": unread, "peer": peer, "timeout": timeout, "killed": killed,
             "closed": closed, "peerproc": peerproc}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=sorted(SCENARIOS) + ["all"])
    p.add_argument("dir", nargs="?", default=".")
    p.add_argument("--device", choices=["fake", "torch"], default="fake")
    p.add_argument("--timeout", type=float, default=20.0)
    args = p.parse_args()
    if args.scenario == "all":  # scripts/test-gpu.sh: each in its own bounded process
        for name in ("arrives", "unread", "peer", "timeout", "killed", "closed"):
            cmd = [sys.executable, os.path.abspath(__file__), name, args.dir, "--device", args.device,
                   "--timeout", str(args.timeout)]
            try:
                rc = subprocess.run(cmd, timeout=args.timeout * 6).returncode
            except subprocess.TimeoutExpired:
                raise SystemExit(f"FAILED: {name} hung")
            check(rc == 0, f"{name} exited {rc}")
        print("all ok", flush=True)
        return
    dev = None if args.scenario == "peerproc" else make_device(args.device)
    SCENARIOS[args.scenario](args, dev)


if __name__ == "__main__":
    main()
