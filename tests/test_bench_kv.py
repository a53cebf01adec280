"""bench kv: one request's KV through the vLLM connector's transfer part beside a contiguous
agent write of the same bytes, on a small shape (the figures themselves are not checked)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def test_bench_kv_moves_each_request_and_reports_both_figures(tmp_path):
    out = tmp_path / "kv.json"
    scratch = tmp_path / "tmp"  # where the bench makes its exchange folders
    scratch.mkdir()
    r = subprocess.run([sys.executable, "-m", "flagcx_mesh.bench", "kv", "--tokens", "64,128", "--paths", "cma,tcp",
                        "--layers", "3", "--heads", "2", "--head-size", "16", "--reps", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=240, env=dict(os.environ, TMPDIR=str(scratch)))
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert set(data["paths"]) == {"cma", "tcp"}
    for path, row in data["paths"].items():
        assert row["path"] == path  # the forced path was the one taken
        assert row["register_256MiB_ms"] > 0 and row["connect_ms"] > 0
        for tokens in ("64", "128"):
            f = row["tokens"][tokens]
            assert f["bytes"] == int(tokens) * 3 * 2 * 2 * 16 * 2  # tokens x layers x heads x (K, V) x head x bf16
            assert f["kv_ms"] > 0 and f["contiguous_ms"] > 0 and f["batch_ms"] > 0
    assert "KV/contig" in r.stdout and "batch/contig" in r.stdout
    assert list(scratch.iterdir()) == []  # each path's exchange folder removed
