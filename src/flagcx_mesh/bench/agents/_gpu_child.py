"""The bench's side of a target process (_gpu_target.py): started with two pipes, asked
one JSON line at a time, every answer awaited at most --timeout seconds; a target that fails,
dies or goes silent raises TargetFailed with its reason and the tail of its log, and is killed."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from typing import Dict


class TargetFailed(RuntimeError):
    pass


class Target:
    def __init__(self, args, tool: str, kind: str, env: Dict[str, str]):
        self.timeout, self.tool = args.timeout, tool
        to_child_r, self.w = os.pipe()
        self.r, from_child_w = os.pipe()
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-agent-gpu-{tool}-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "flagcx_mesh.bench", "agent-gpu-target", "--tool", tool, "--memory", args.memory,
               "--size", str(args.region_bytes), "--kind", kind, "--mooncake-protocol", args.mooncake_protocol,
               "--rfd", str(to_child_r), "--wfd", str(from_child_w)]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, pass_fds=(to_child_r, from_child_w))
        os.close(to_child_r)
        os.close(from_child_w)
        self.pending = b""

    def _tail(self) -> str:
        try:
            with open(self.log.name, "rb") as f:
                text = f.read().decode(errors="replace").strip()
        except OSError:
            return ""
        lines = text.splitlines()[-8:]
        return (f" (target log {self.log.name}, last lines: " + " | ".join(lines) + ")") if lines else ""

    def _fail(self, why: str):
        self.kill()
        raise TargetFailed(f"{self.tool} target: {why}{self._tail()}")

    def ask(self, req: Dict) -> Dict:
        self.send(req)
        return self.answer(req)

    def send(self, req: Dict) -> None:
        """The request alone (answer() then takes its answer): for what the bench's side must do meanwhile."""
        try:
            os.write(self.w, (json.dumps(req) + "\n").encode())
        except OSError as e:
            self._fail(f"cannot send {req['op']!r}: {e} (exit {self.proc.poll()})")

    def answer(self, req: Dict) -> Dict:
        end = time.monotonic() + self.timeout
        while b"\n" not in self.pending:
            left = end - time.monotonic()
            if left <= 0:
                self._fail(f"no answer to {req['op']!r} within {self.timeout:.0f} s")
            ready, _, _ = select.select([self.r], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.r, 1 << 20)
                if not chunk:
                    self.proc.wait(timeout=10)
                    self._fail(f"exited {self.proc.returncode} before answering {req['op']!r}")
                self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        answer = json.loads(line)
        if not answer.get("ok"):
            self._fail(answer.get("error", "failed"))
        return answer

    def bye(self) -> None:
        self.ask({"op": "bye"})
        try:
            self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self._fail(f"did not exit within {self.timeout:.0f} s of bye")
        if self.proc.returncode == 0:
            os.unlink(self.log.name)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for fd in (self.w, self.r):
            try:
                os.close(fd)
            except OSError:
                pass
        self.w = self.r = -1
