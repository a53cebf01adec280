"""`python -m flagcx_mesh.bench latency`: the C latency program ships in the package, compiles as
strict C99 against the installed headers, and a short run prints and saves figures of the right
shape for every path (structure only: no speed is asserted)."""
import json
import math
import os
import re
import subprocess

import pytest

from flagcx_mesh import config
from flagcx_mesh.bench.onesided import latency
from meshutil import PY, REPO_ROOT, subprocess_env

pytestmark = pytest.mark.timeout(240)

TESTS = ("put_signal", "socket", "put_flush", "socket_ack")


def test_the_c_source_ships_in_the_package_and_compiles_strictly(tmp_path):
    assert os.path.isfile(latency.SOURCE), latency.SOURCE
    assert os.path.dirname(latency.SOURCE) == os.path.dirname(os.path.abspath(latency.__file__))
    cc = os.environ.get("CC", "cc")
    r = subprocess.run([cc, "-std=c99", "-O2", "-Wall", "-Wextra", "-Werror", "-pedantic", "-c", latency.SOURCE,
                        "-I" + config.get_include(), "-o", str(tmp_path / "latency.o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_a_short_run_prints_figures_for_every_path(tmp_path):
    out = tmp_path / "latency.json"
    p = subprocess.run([PY, "-m", "flagcx_mesh.bench", "latency", "--iters", "200", "--warmup", "20",
                        "--blocks", "2", "--timeout", "90", "--json", str(out)],
                       env=subprocess_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    assert sorted(data) == ["shm", "tcp"]
    assert (data["shm"]["data_path"], data["shm"]["signal_path"]) == ("shm", "shm")
    assert (data["tcp"]["data_path"], data["tcp"]["signal_path"]) == ("tcp", "tcp")
    for path, run in data.items():
        assert run["iters"] == 200 and run["warmup"] == 20 and run["cpus"] >= 1 and run["load_before"] >= 0
        assert sorted(run["results"]) == sorted(TESTS)
        for test, f in run["results"].items():
            assert all(math.isfinite(f[k]) for k in ("min_us", "median_us", "p99_us")), (path, test, f)
            assert 0 < f["min_us"] <= f["median_us"] <= f["p99_us"], (path, test, f)
    number = r"\s+[0-9.]+ /\s+[0-9.]+"
    for path in ("shm", "tcp"):
        for test in ("put_signal 8 B one way", "put_flush 4 KiB blocking"):
            assert re.search(rf"^\s+{path}\s+{test}{number}{number}\s+[0-9.]+x /\s*[0-9.]+x$", p.stdout, re.M), p.stdout
    assert "paths actually used (data, signal): shm -> shm, shm, tcp -> tcp, tcp" in p.stdout, p.stdout
    assert re.search(r"^host: shm run: \d+ CPUs, load average [0-9.]+ before it, tcp run: ", p.stdout, re.M), p.stdout


def test_the_table_keeps_its_columns_with_a_p99_of_seconds(capsys):
    """A loaded host gave a p99 of 15351.81 us: the figure ran into the slash ("99.89 /15351.81")."""
    import argparse
    from flagcx_mesh.bench.onesided import latency as lat

    f = {"min_us": 5.0, "median_us": 99.89, "p99_us": 15351.81}
    run = {"results": {t: dict(f) for t in ("put_signal", "socket", "put_flush", "socket_ack")},
           "cpus": 2, "load_before": 7.9, "data_path": "tcp", "signal_path": "tcp"}
    lat._report({"tcp": run}, argparse.Namespace(iters=200, warmup=20))
    out = capsys.readouterr().out
    number = r"\s+[0-9.]+ /\s+[0-9.]+"
    for test in ("put_signal 8 B one way", "put_flush 4 KiB blocking"):
        assert re.search(rf"^\s+tcp\s+{test}{number}{number}\s+[0-9.]+x /\s*[0-9.]+x$", out, re.M), out


def test_bad_arguments_are_refused(tmp_path):
    p = subprocess.run([PY, "-m", "flagcx_mesh.bench", "latency", "--transports", "cma"], env=subprocess_env(),
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "unknown transport" in p.stderr, p.stderr
    exe = latency.compile_program(str(tmp_path))
    r = subprocess.run([exe, "--iters", "0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--iters needs a positive integer" in r.stderr, r.stderr
    r = subprocess.run([exe, "--bogus", "1"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage: latency" in r.stderr, r.stderr


def test_the_program_refuses_one_rank(tmp_path):
    exe = latency.compile_program(str(tmp_path))
    p = subprocess.run([PY, "-m", "flagcx_mesh.launch", "-n", "1", "--timeout", "60", "--", exe],
                       env=subprocess_env(), capture_output=True, text=True, timeout=90)
    assert p.returncode == 2 and "needs exactly 2 ranks, got 1" in p.stderr, p.stdout + p.stderr


def test_a_missing_compiler_is_named(tmp_path):
    env = subprocess_env()
    env["CC"] = "no-such-cc-for-flagcx-mesh"
    p = subprocess.run([PY, "-m", "flagcx_mesh.bench", "latency", "--iters", "10"], env=env, cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "needs a C compiler" in p.stderr and "set CC" in p.stderr, p.stderr
