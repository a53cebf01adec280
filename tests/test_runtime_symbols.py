"""No private C++ runtime is ever exported (issue 9, item 7).

Where libstdc++ is linked statically into _core (a compiler that finds libstdc++.a first
does it silently), the module carries a second C++ runtime. If its GNU-unique symbols
(std::num_put<char>::id and the other locale facet ids) are exported, the shared
libstdc++ that torch loads later binds its facet ids to that copy, and the two runtimes
number their facets into the same ids: torch's first ``ostream << long`` finds another
facet (integers print as nothing, or SIGSEGV). So the libraries keep every linked
archive's symbols local (``-Wl,--exclude-libs,ALL``) and export only their API, and the
core uses no iostreams. See docs/testing.md, "The C++ runtime".
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

import flagcx_mesh
import testdoubles
from meshutil import REPO_ROOT, subprocess_env

PKG = os.path.dirname(flagcx_mesh.__file__)
IOSTREAM = re.compile(r"std::(basic_(i|o|io|if|of|istring|ostring|string)stream|basic_filebuf|"
                      r"basic_stringbuf|ios_base|basic_ios|locale)\b")


def _nm(path, *flags):
    """(type letter, demangled name) of each symbol `nm -D -C flags` lists."""
    out = subprocess.run(["nm", "-D", "-C", *flags, path], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split(None, 2) if line[:1] != " " else ["", *line.split(None, 1)]
        if len(parts) == 3:
            rows.append((parts[1], parts[2]))
    return rows


def runtime_exports(path):
    """The exported symbols that belong to a C++ runtime: std:: or GNU-unique (nm 'u')."""
    return [f"{t} {name}" for t, name in _nm(path, "--defined-only") if t == "u" or "std::" in name]


def _core_of(pkg_dir):
    found = [f for f in os.listdir(pkg_dir) if f.startswith("_core") and f.endswith(".so")]
    assert len(found) == 1, found
    return os.path.join(pkg_dir, found[0])


def _installed_libraries():
    return [_core_of(PKG), os.path.join(PKG, "lib", "libflagcx_mesh.so"),
            testdoubles.testing_library()]


# ----------------------------------------------------------------------------- (a) installed

@pytest.mark.parametrize("path", _installed_libraries(), ids=os.path.basename)
def test_installed_library_exports_no_cxx_runtime(path):
    leaks = runtime_exports(path)
    assert not leaks, f"{path} exports {len(leaks)} C++ runtime symbols, e.g. {leaks[:5]}"


@pytest.mark.parametrize("path", _installed_libraries()[:2], ids=os.path.basename)
def test_installed_library_uses_no_iostreams(path):
    used = [name for t, name in _nm(path, "--undefined-only") if IOSTREAM.search(name)]
    assert not used, f"{path} uses iostreams / locales: {used[:5]}"


def test_core_module_exports_only_its_init():
    names = [name for _, name in _nm(_core_of(PKG), "--defined-only")]
    assert names == ["PyInit__core"], names


# ----------------------------------------------------------------------------- (b) static build

def _static_libstdcxx():
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        return None
    path = subprocess.run([cxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True,
                          timeout=30).stdout.strip()
    return path if os.path.isabs(path) else None


@pytest.fixture(scope="module")
def static_build():
    """_core and libflagcx_mesh.so linked with -static-libstdc++ from the wheel's own objects,
    with the runtime kept private (as shipped), and _core linked as v0.2 linked it (no
    --exclude-libs, no export map). The test doubles' build links them
    (cmake/static_runtime_variants.cmake); a compiler without libstdc++.a cannot."""
    if _static_libstdcxx() is None:
        pytest.skip("needs a static libstdc++ (c++ -print-file-name=libstdc++.a)")
    root = os.path.join(testdoubles.directory(), "static-runtime")
    private = {"core": _core_of(os.path.join(root, "private")),
               "lib": testdoubles.library(os.path.join("static-runtime", "private", "libflagcx_mesh.so"))}
    return {"private": private, "exported_core": _core_of(os.path.join(root, "exported"))}


@pytest.mark.timeout(120)
def test_static_build_keeps_its_runtime_private(static_build):
    for path in static_build["private"].values():
        leaks = runtime_exports(path)
        assert not leaks, f"{path} (static libstdc++) exports {len(leaks)} runtime symbols: {leaks[:5]}"
        ldd = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=30).stdout
        assert "libstdc++" not in ldd, f"{path} is not linked statically:\n{ldd}"


@pytest.mark.timeout(120)
def test_without_the_guard_the_static_build_exports_its_runtime(static_build):
    """The check catches the defect: the same static _core linked without --exclude-libs
    (and without its export map) exports libstdc++ itself, GNU-unique symbols included
    (std::string's statics here; ~100 locale facet ids such as std::num_put<char>::id
    when the core still used an ifstream)."""
    leaks = runtime_exports(static_build["exported_core"])
    unique = [s for s in leaks if s.startswith("u ")]
    assert unique, leaks[:20]
    assert len(leaks) > 100, leaks


# ----------------------------------------------------------------------------- (c) torch after a mesh

TORCH_AFTER_MESH = """
import flagcx_mesh, sys
assert flagcx_mesh.__file__.startswith(sys.argv[1]), flagcx_mesh.__file__
m = flagcx_mesh.Mesh(1, flagcx_mesh.get_unique_id(), 0)
m.close()
import torch
print(str(torch.arange(3)))
print(str(torch.tensor([12345])))
print(torch.tensor([-7, 40000]).tolist(), f"{torch.tensor(99).item():d}")
"""
TORCH_EXPECTED = ["tensor([0, 1, 2])", "tensor([12345])", "[-7, 40000] 99"]


BINDING_TO_CORE = re.compile(r"binding file \S*libstdc\+\+\.so[.0-9]* .* to \S*/_core[^/ ]*\.so")


def _torch_after_mesh(pkg_parent, extra_env=None, check=True):
    pytest.importorskip("torch")  # scripts/test.sh installs torch==2.13.0 (CPU)
    env = subprocess_env({"PYTHONPATH": pkg_parent + os.pathsep + subprocess_env()["PYTHONPATH"],
                          **(extra_env or {})})
    p = subprocess.run([sys.executable, "-c", TORCH_AFTER_MESH, pkg_parent], env=env, cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=240)
    if check:
        assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr[-3000:]}"
        assert p.stdout.splitlines() == TORCH_EXPECTED, p.stdout
    return p


def _with_core(tmp_path, core):
    """A copy of the installed package with `core` as its _core; returns its parent folder."""
    pkg = tmp_path / "flagcx_mesh"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("__pycache__", "_core*.so"))
    shutil.copy2(core, pkg / os.path.basename(_core_of(PKG)))
    return str(tmp_path)


def _bindings_to_core(pkg_parent, tmp_path, check):
    """Runs the torch check under LD_DEBUG=bindings: the symbols the shared libstdc++ (loaded
    by torch) took from _core, and the run."""
    log = tmp_path / "ld-bindings"
    p = _torch_after_mesh(pkg_parent, {"LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(log)}, check)
    found = []
    for name in os.listdir(tmp_path):
        if name.startswith("ld-bindings"):
            with open(tmp_path / name, errors="replace") as f:
                found += [line.strip() for line in f if BINDING_TO_CORE.search(line)]
    return found, p


@pytest.mark.timeout(300)
def test_torch_prints_integers_after_a_mesh():
    _torch_after_mesh(os.path.dirname(PKG))


@pytest.mark.timeout(300)
def test_torch_after_a_mesh_of_the_static_build(static_build, tmp_path):
    """The static, private-runtime _core in place of the installed one: torch formats
    integers right, and its libstdc++ takes no symbol from _core."""
    found, _ = _bindings_to_core(_with_core(tmp_path, static_build["private"]["core"]), tmp_path, True)
    assert not found, found[:5]


@pytest.mark.timeout(120)
def test_without_the_guard_torch_binds_to_the_modules_runtime(static_build, tmp_path):
    """The mechanism of the defect, seen at run time: with the unguarded static _core, the
    shared libstdc++ that torch loads binds runtime symbols to _core's copy (std::string's
    empty representation now; 82 symbols, the locale facet ids among them, when the core
    still used an ifstream). Whether integers then print wrong depends on how far the two
    libstdc++ versions differ."""
    found, p = _bindings_to_core(_with_core(tmp_path, static_build["exported_core"]), tmp_path, False)
    assert found, (p.stdout, p.stderr[-2000:])
    print(f"{len(found)} libstdc++ symbols bound to the unguarded _core; exit {p.returncode}; "
          f"torch printed {p.stdout.splitlines()}", file=sys.stderr)
