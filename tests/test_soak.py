"""A short soak (python -m flagcx_mesh.bench soak): 100 builds of 2..8 ranks as threads with
jitter, foreign traffic at the root, ranks that abandon the build and ranks that never
come. Asserts no hang, no miswiring, and that every failure names a peer. The long run
and its figures are in docs/testing.md."""

import json
import os
import subprocess
import sys

import pytest

from meshutil import subprocess_env

pytestmark = pytest.mark.timeout(400)


def test_short_soak_has_no_hang_no_miswiring_and_names_every_failure(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "flagcx_mesh.bench", "soak", "--builds", "100", "--max-ranks", "8",
           "--kill", "0.25", "--absent", "0.02", "--foreign", "0.5", "--timeout", "5", "--seed", "7",
           "--progress", "0", "--json", str(out)]
    p = subprocess.run(cmd, env=subprocess_env({}), capture_output=True, text=True, timeout=360)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(out.read_text())
    report = p.stdout[-3000:]
    assert s["builds"] == 100, report
    assert s["hangs"] == 0, report
    assert s["miswirings"] == 0, report
    assert s["unnamed_failures"] == 0, report
    assert s["with_killed_rank"] > 0 and s["failures"] > 0, report  # faults were injected
    assert s["built"] >= s["builds"] - s["with_killed_rank"] - s["with_absent_rank"] - s["clean_builds_that_failed"]
    assert p.returncode == 0, report
