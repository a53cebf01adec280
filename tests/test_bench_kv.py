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
                        "--layers", "3", "--heads", "2", "--head-size", "16", "--reps", "2", "--peers", "none",
                        "--json", str(out)],
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
            kernel = {k for k in f if k.startswith("kernel_")}
            assert kernel == ({"kernel_scattered_ms", "kernel_contiguous_ms"} if path == "cma" else set())
            assert all(f[k] > 0 for k in kernel)
    assert "KV/contig" in r.stdout and "batch/contig" in r.stdout
    assert r.stdout.count("the kernel alone (process_vm_writev") == 2  # cma's two request sizes
    assert list(scratch.iterdir()) == []  # each path's exchange folder removed
    assert "peers" not in data and "peers," not in r.stdout


def test_bench_kv_steps_say_where_each_request_length_spends_its_time(tmp_path):
    """--steps: both processes stamp the transfer part's steps; each request length gets each
    step's median (the steps between them add up to no more than the request's total), and a
    request whose stamps are missing is not reported as a figure (_kv_steps.report). Over tcp
    every request is pushed by the prefill's core: the first handed to it by the prefill's thread
    (the decode has no prefill layout yet, its want is a W), the later ones served by it (binary
    wants)."""
    from flagcx_mesh.bench import _kv_steps

    out = tmp_path / "kv.json"
    r = subprocess.run([sys.executable, "-m", "flagcx_mesh.bench", "kv", "--tokens", "64,128", "--paths", "tcp",
                        "--layers", "3", "--heads", "2", "--head-size", "16", "--reps", "3", "--peers", "none",
                        "--steps", "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = json.loads(out.read_text())["paths"]["tcp"]["steps_ms"]
    for key, how, n, all_steps, chain_steps in (
            ("64 handed", " handed to the prefill's core by its thread", 1, _kv_steps.HANDED_STEPS,
             _kv_steps.HANDED_CHAIN),  # (the first request of 64 tokens alone)
            ("64 served", " served by the prefill's core", 2, _kv_steps.SERVED_STEPS, _kv_steps.SERVED_CHAIN),
            ("128 served", " served by the prefill's core", 2, _kv_steps.SERVED_STEPS, _kv_steps.SERVED_CHAIN)):
        fig = steps[key]
        assert list(fig) == [name for name, _, _ in all_steps], fig  # every step of every request was stamped
        assert all(ms >= 0 for ms in fig.values()), fig  # each step of the chain ends after it starts
        chain = sum(fig[name] for name, _, _ in chain_steps)
        assert 0 < fig["total"] and 0.5 * fig["total"] <= chain <= 1.5 * fig["total"], fig  # medians: near the total
        tokens = key.split()[0]
        assert f"steps of a {tokens}-token request{how} (ms, median of {n})" in r.stdout, r.stdout
    assert not {"64", "128", "128 handed"} & set(steps)  # (no push by the thread; no 128-token W)
    # a stamp file that does not match the requests made is said, not reported
    assert _kv_steps.report("[]", [64]) == {}


def test_a_hand_off_that_returns_after_the_decode_took_the_request_still_counts():
    """The prefill's thread hands a W to its core, which serves it, and the decode takes the
    request, before the thread's hand-off call has returned (a loaded machine: seen in CI). The
    request keeps every step: the call's end counts up to the next request's fetch, and the chain
    runs from the hand-off's start. (Before, its `to the core` went missing, the figures too.)"""
    from flagcx_mesh.bench import _kv_steps

    one = [(0.0, "fetch>"), (0.1, "fetch<"), (0.2, "notify>"), (0.3, "note:W"), (0.4, "core>"),
           (0.5, "fetched>"), (0.6, "polled"), (0.7, "core<")]
    two = [(t + 1.0, tag) for t, tag in one]  # (the next request: its fetch> ends the first's window)
    fig = _kv_steps.report(json.dumps(one + two), [64, 64])["64 handed"]
    assert list(fig) == [name for name, _, _ in _kv_steps.HANDED_STEPS], fig
    assert fig["to the core"] == pytest.approx(300.0) and fig["served, done back"] == pytest.approx(100.0), fig
    assert sum(fig[name] for name, _, _ in _kv_steps.HANDED_CHAIN) == pytest.approx(fig["total"]), fig


def test_bench_kv_sets_the_peers_beside_the_request(tmp_path):
    """--peers: bench agent's harness moves the request's blocks (tokens / block size x layers
    blocks of a layer's block bytes) with the agent and each peer; one that is not installed is
    reported NOT RUN with its reason, never as a figure."""
    out = tmp_path / "kv.json"
    r = subprocess.run([sys.executable, "-m", "flagcx_mesh.bench", "kv", "--tokens", "64", "--paths", "cma",
                        "--layers", "2", "--heads", "2", "--head-size", "16", "--reps", "1",
                        "--peers", "nixl,mooncake", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    tools = json.loads(out.read_text())["peers"]["64"]
    assert set(tools) == {"flagcx_mesh agent", "nixl", "mooncake"}
    ours = tools["flagcx_mesh agent"]
    assert ours["ms"] > 0 and abs(ours["GBps"] * ours["ms"] * 1e6 - 4 * 2 * 2048) < 1  # 4 blocks x 2 layers x 2 KiB
    for name in ("nixl", "mooncake"):
        f = tools[name]
        if "error" in f:
            assert f"{name} NOT RUN: {f['error']}" in r.stdout
        else:
            assert f["ms"] > 0 and f"{name} " in r.stdout


def test_the_kernel_reference_writes_every_span_where_it_says():
    """bench/_rawcma.py, the kernel-alone reference over cma: each (local, remote, bytes) span lands
    at its remote address, more spans than one call takes included; a span it cannot write is an
    OSError, not a figure."""
    import ctypes

    from flagcx_mesh.bench import _rawcma

    n, size = _rawcma.IOV_MAX + 5, 64
    src = (ctypes.c_uint8 * (n * size)).from_buffer_copy(bytes(i % 251 for i in range(n * size)))
    dst = (ctypes.c_uint8 * (2 * n * size))()
    s0, d0 = ctypes.addressof(src), ctypes.addressof(dst)
    spans = [(s0 + i * size, d0 + (2 * (n - 1 - i) + 1) * size, size) for i in range(n)]  # reversed, gaps between
    calls = _rawcma.prepare(spans)
    assert len(calls) == 2
    assert _rawcma.write_seconds(os.getpid(), calls) > 0
    for i in range(n):
        at = (2 * (n - 1 - i) + 1) * size
        assert bytes(dst[at:at + size]) == bytes(src[i * size:(i + 1) * size]), i
        assert bytes(dst[at - size:at]) == bytes(size)  # the gap before it untouched
    with pytest.raises(OSError, match="process_vm_writev moved"):
        _rawcma.write_seconds(os.getpid(), _rawcma.prepare([(s0, 4096, size)]))  # nothing mapped at 4096


def test_cuda_vmm_is_measured_in_a_process_with_expandable_segments(monkeypatch, tmp_path):
    """torch gives cuMem memory (cuda-vmm's) only with expandable segments set before CUDA starts:
    bench kv measured cuda-vmm in the process that had measured cuda-ipc, whose plain cudaMalloc
    memory fell back to staged (a 'cuda-vmm' row that was staged's figures)."""
    from flagcx_mesh.bench import kv

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    args = kv._parse(["--device", "cuda"])
    assert args.paths == ["cuda-ipc", "cuda-vmm", "staged"]
    assert [kv._needs_own_process(args, p) for p in args.paths] == [False, True, False]
    assert not kv._needs_own_process(kv._parse(["--device", "cpu"]), "cuda-vmm")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert not kv._needs_own_process(args, "cuda-vmm")

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    seen = {}

    def run(cmd, env, timeout):
        seen.update(cmd=cmd, env=env)
        child = kv._parse(cmd[cmd.index("kv") + 1:])
        with open(child.dir, "w") as f:
            json.dump({"path": "cuda-vmm", "paths_asked": child.paths, "role": child.role}, f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(kv.subprocess, "run", run)
    row = kv._measure_apart(["--device", "cuda", "--tokens", "2048", "--paths", "cuda-ipc,cuda-vmm"], "cuda-vmm")
    assert row == {"path": "cuda-vmm", "paths_asked": ["cuda-vmm"], "role": "path"}
    assert seen["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64,expandable_segments:True"
    assert seen["env"]["PYTORCH_ALLOC_CONF"] == "max_split_size_mb:64,expandable_segments:True"
    assert "--tokens" in seen["cmd"] and "2048" in seen["cmd"]
