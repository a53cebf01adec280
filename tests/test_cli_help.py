"""Every command-line program answers --help with exit status 0 and a help text for every option;
`python -m flagcx_mesh` lists the commands; a missing optional dependency names its extra."""

import argparse
import subprocess
import sys

import pytest

import flagcx_mesh
from flagcx_mesh import __main__ as top
from flagcx_mesh import _cli
from flagcx_mesh.bench import __main__ as bench_main

# the user-facing benchmarks (the others are their child programs, started by them)
BENCHMARKS = ("mesh", "put", "put-mpi", "race", "latency", "soak", "stream-wait", "agent", "p2p", "kv", "notify")
INTERNAL = {"mesh-rank", "put-rank", "put-cuda-rank", "race-rank", "agent-gpu-target"}


def _parsers_of(monkeypatch, call):
    """Runs call(); returns the exit status and every argparse parser that parsed meanwhile."""
    seen = []
    real = argparse.ArgumentParser.parse_known_args

    def spy(self, *a, **k):
        seen.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", spy)
    try:
        status = call()
    except SystemExit as e:
        status = e.code
    return status, seen


def _undocumented(parser):
    return [a.option_strings or [a.dest] for a in parser._actions
            if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS
            and not (a.help or "").strip()]


ENTRIES = [(f"bench {name}", lambda name=name: bench_main.main([name, "--help"])) for name in BENCHMARKS]
ENTRIES += [(name, lambda name=name: top.main([name, "--help"])) for name, _, _ in top.COMMANDS if name != "bench"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,call", ENTRIES, ids=[n for n, _ in ENTRIES])
def test_every_option_has_help_and_help_exits_0(monkeypatch, capsys, name, call):
    status, parsers = _parsers_of(monkeypatch, call)
    out = capsys.readouterr()
    assert status in (0, None), f"{name} --help exited {status}: {out.err[-400:]}"
    assert parsers, f"{name} --help parsed nothing"
    for p in parsers:
        assert not _undocumented(p), f"{name}: options without help: {_undocumented(p)}"
    assert "usage" in out.out.lower()


def test_every_benchmark_is_listed_or_internal():
    assert set(bench_main.COMMANDS) == set(BENCHMARKS) | INTERNAL
    for name in BENCHMARKS:
        assert f"bench {name}" in bench_main.__doc__


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,status,stream,words", [
    (["--help"], 0, "out", "commands:"),
    ([], 2, "err", "commands:"),
    (["nope"], 2, "err", "unknown command 'nope'"),
])
def test_top_level_lists_the_commands(capsys, argv, status, stream, words):
    assert top.main(argv) == status
    text = getattr(capsys.readouterr(), stream)
    assert words in text
    for name, _, _ in top.COMMANDS:
        assert name in text


@pytest.mark.timeout(60)
def test_bench_help_exits_0_and_unknown_names_it(capsys):
    assert bench_main.main(["--help"]) == 0
    assert "python -m flagcx_mesh.bench kv" in capsys.readouterr().out
    assert bench_main.main(["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module", ["flagcx_mesh", "flagcx_mesh.netbuild", "flagcx_mesh.selftest_net",
                                    "flagcx_mesh.bench", "flagcx_mesh.launch", "flagcx_mesh.config"])
def test_python_dash_m_help_answers(module):
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 40


@pytest.mark.parametrize("missing,extra", [("numpy", "bench"), ("mpi4py", "mpi"), ("torch", "torch")])
def test_a_missing_dependency_names_its_extra(capsys, missing, extra):
    def entry(argv):
        raise ModuleNotFoundError(f"No module named '{missing}'", name=missing)

    assert _cli.run_naming_extras("python -m flagcx_mesh.bench agent", entry, []) == 2
    err = capsys.readouterr().err
    assert f"pip install 'flagcx_mesh[{extra}]'" in err and "bench agent needs " + missing in err


def test_a_missing_module_of_the_package_itself_still_raises():
    def entry(argv):
        raise ModuleNotFoundError("No module named 'flagcx_mesh.nothere'", name="flagcx_mesh.nothere")

    with pytest.raises(ModuleNotFoundError):
        _cli.run_naming_extras("x", entry, [])


def test_the_version_is_the_package_metadata():
    import importlib.metadata as md
    assert flagcx_mesh.__version__ == md.version("flagcx_mesh")


ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("program", ["examples/pd_kv_agent.py", "examples/pd_kv_transfer.py",
                                     "-m flagcx_mesh.bench agent"])
def test_without_numpy_the_programs_name_the_extra(tmp_path, program):
    """numpy hidden behind a stand-in that raises as a missing numpy does."""
    import os

    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    argv = program.split() if program.startswith("-m") else [os.path.join(ROOT, program)]
    r = subprocess.run([sys.executable] + argv, capture_output=True, text=True, timeout=50, env=env, cwd=tmp_path)
    assert r.returncode != 0
    assert "pip install 'flagcx_mesh[bench]'" in r.stderr, r.stderr[-600:]
    assert "Traceback" not in r.stderr, r.stderr[-600:]
