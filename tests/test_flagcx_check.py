"""integrations/flagcx/check/check.sh can fail: it names what it cannot run without, and exits
non-zero when a builder that must work miswires or hangs. The cases that build against FlagCX need
its sources (FLAGCX_SRC, a FlagCX 0c721293 tree, patched or not) and skip without them, saying so."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "integrations", "flagcx", "check", "check.sh")
FLAGCX_SRC = os.environ.get("FLAGCX_SRC", "")


def run_check(env_extra, *args, timeout=600):
    env = dict(os.environ, PYTHON=sys.executable, **env_extra)
    p = subprocess.run(["bash", CHECK, *map(str, args)], env=env, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def test_without_sources_it_says_so_and_fails():
    rc, out = run_check({"FLAGCX_SRC": ""})
    assert rc == 2, out
    assert "set FLAGCX_SRC" in out


def test_a_missing_json_header_is_named(tmp_path):
    (tmp_path / "flagcx").mkdir()
    (tmp_path / "flagcx" / "flagcx.cc").write_text("")
    rc, out = run_check({"FLAGCX_SRC": str(tmp_path), "FLAGCX_JSON_INCLUDE": str(tmp_path / "nojson")})
    assert rc == 2, out
    assert "holds no nlohmann/json.hpp" in out


needs_flagcx = pytest.mark.skipif(not os.path.isfile(os.path.join(FLAGCX_SRC, "flagcx", "flagcx.cc")),
                                  reason="no FlagCX sources: set FLAGCX_SRC to a FlagCX 0c721293 tree")


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("flagcx_check_build"))


@needs_flagcx
@pytest.mark.timeout(900)
def test_the_check_passes_for_the_patch(build_dir):
    rc, out = run_check({"CHECK_BUILD_DIR": build_dir, "CHECK_SCENARIOS": "1sock die"}, 4, 5)
    assert rc == 0, out
    assert "ordered: 5 completed, 0 miswired, 0 hung, 0 failed" in out
    assert "compiles; its" in out  # the patched flagcx.cc was compiled and its symbols checked
    assert "check.sh: PASSED" in out


@needs_flagcx
@pytest.mark.timeout(900)
def test_a_miswiring_builder_fails_the_check(build_dir):
    # FlagCX's own loop (legacy) miswires over its socket adaptor: required to be clean, it must fail.
    rc, out = run_check({"CHECK_BUILD_DIR": build_dir, "CHECK_SCENARIOS": "1sock", "CHECK_BUILDERS": "legacy",
                         "CHECK_CLEAN": "legacy"}, 4, 5)
    assert rc == 1, out
    assert "FAIL: 1sock/legacy:" in out and "miswired" in out


@needs_flagcx
@pytest.mark.timeout(900)
def test_a_hanging_builder_fails_the_check(build_dir):
    # rank 1 never returns from its build: the check kills it at the rank timeout and fails.
    rc, out = run_check({"CHECK_BUILD_DIR": build_dir, "CHECK_SCENARIOS": "1sock", "CHECK_BUILDERS": "ordered",
                         "MESH_CHECK_STALL_RANK": "1", "CHECK_RANK_TIMEOUT": "15"}, 3, 2)
    assert rc == 1, out
    assert "FAIL: 1sock/ordered: rank(s)" in out and "(hung), killed" in out


@needs_flagcx
@pytest.mark.timeout(900)
def test_the_real_build_dry_runs(tmp_path):
    """build_real.sh --dry-run over the tree prepare_tree.sh makes: the patch applies, the patched
    flagcx.cc, the glue, the probe and the test program compile without CUDA/NCCL."""
    if os.path.exists(os.path.join(FLAGCX_SRC, "flagcx", "service", "flagcx_mesh_glue.cc")):
        pytest.skip("FLAGCX_SRC is already patched: the real build takes a plain tree")
    real = os.path.join(ROOT, "integrations", "flagcx")
    env = dict(os.environ, PYTHON=sys.executable)
    tree = tmp_path / "FlagCX"
    p = subprocess.run(["bash", os.path.join(real, "real", "prepare_tree.sh"), FLAGCX_SRC, str(tree)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tree / "third-party" / "json" / "single_include" / "nlohmann" / "json.hpp").is_file()
    p = subprocess.run(["bash", os.path.join(real, "build_real.sh"), "--dry-run", str(tree), str(tmp_path / "out")],
                       env=env, capture_output=True, text=True, timeout=800)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "dry run: the patched flagcx.cc and the glue compile" in out
    assert "programs: onesided_real (with real/probe.cc)" in out
    assert "build_real.sh: done (dry run)" in out


def test_a_plain_tree_inside_another_repository_is_prepared(tmp_path):
    """prepare_tree.sh over a plain FlagCX tree that lies in some other repository's work tree (and
    was prepared before: its json headers are in place) copies that tree, keeping its headers; it
    must not take the enclosing repository for FlagCX's and look for 0c721293 in it."""
    repo = tmp_path / "project"
    src = repo / "flagcx-src"
    (src / "flagcx").mkdir(parents=True)
    (src / "flagcx" / "flagcx.cc").write_text("// FlagCX\n")
    json_h = src / "third-party" / "json" / "single_include" / "nlohmann" / "json.hpp"
    json_h.parent.mkdir(parents=True)
    json_h.write_text("// the tree's own json header\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") and k != "FLAGCX_JSON_INCLUDE"}
    subprocess.run(["git", "init", "-q", str(repo)], env=env, check=True, timeout=60)
    dest = tmp_path / "prepared"
    prepare = os.path.join(ROOT, "integrations", "flagcx", "real", "prepare_tree.sh")
    p = subprocess.run(["bash", prepare, str(src), str(dest)], env=dict(env, PYTHON=sys.executable),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (dest / "flagcx" / "flagcx.cc").read_text() == "// FlagCX\n"
    kept = dest / "third-party" / "json" / "single_include" / "nlohmann" / "json.hpp"
    assert kept.read_text() == "// the tree's own json header\n"
