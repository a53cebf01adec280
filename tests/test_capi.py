"""The C ABI (flagcx_mesh.h, libflagcx_mesh.so) as a C user meets it: the headers compile as
strict C99, the example builds against the installed package with one compiler line, with
CMake's find_package and with pkg-config, and runs on several ranks; only flagcx_mesh_*
symbols are exported; every call reports failures with a code and a message naming the call,
rank and peer (driven through ctypes, ranks as threads)."""
import ctypes
import os
import re
import shutil
import subprocess
import sys
import threading

import pytest

import flagcx_mesh
from flagcx_mesh import config

import testdoubles

pytestmark = pytest.mark.timeout(180)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "c", "put_signal.c")
CC = os.environ.get("CC", "cc")
CODES = ["OK", "INVALID_ARGUMENT", "TIMED_OUT", "PEER_LOST", "PROTOCOL", "SYSTEM", "CLOSED", "INTERNAL"]


def sh(cmd, timeout=120, **kw):
    r = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def config_flags(*opts):
    return sh([sys.executable, "-m", "flagcx_mesh.config", *opts]).strip()


def launch(binary, n, timeout=90):
    return sh([sys.executable, "-m", "flagcx_mesh.launch", "-n", str(n), "--timeout", str(timeout - 10),
               "--", binary], timeout=timeout)


def assert_example_passed(out, n):
    for r in range(n):
        assert f"rank {r}: PASS 8 rounds" in out, out
        assert re.search(rf"\[rank {r}\] refused as expected: flagcx_mesh_put_signal: rank {r}: .*peer {n}", out), out


# ---------------------------------------------------------------- building against the package

def test_package_reports_its_c_files():
    assert os.path.isfile(os.path.join(flagcx_mesh.get_include(), "flagcx_mesh.h"))
    assert os.path.isfile(os.path.join(flagcx_mesh.get_include(), "flagcx_mesh_net.h"))
    assert os.path.basename(flagcx_mesh.get_library()) == "libflagcx_mesh.so"
    assert os.path.isfile(os.path.join(config.get_cmake_dir(), "flagcx_meshConfig.cmake"))
    assert os.path.isfile(os.path.join(config.get_pkgconfig_dir(), "flagcx_mesh.pc"))


@pytest.mark.parametrize("lang", ["c99", "c++"])
def test_headers_compile_strictly(tmp_path, lang):
    src = tmp_path / ("t.c" if lang == "c99" else "t.cc")
    src.write_text('#include "flagcx_mesh.h"\n'
                   "int main(void) { flagcx_mesh_config_t c = FLAGCX_MESH_CONFIG_INITIALIZER;\n"
                   "  flagcx_mesh_net_build_config_t b = FLAGCX_MESH_NET_BUILD_CONFIG_INITIALIZER;\n"
                   "  return (int)c.size + (int)b.size > 0 ? 0 : 1; }\n")
    std = ["-x", "c", "-std=c99"] if lang == "c99" else ["-x", "c++", "-std=c++11"]
    sh([CC, *std, "-Wall", "-Wextra", "-Werror", "-pedantic", "-c", str(src), "-o", str(tmp_path / "t.o"),
        "-I" + flagcx_mesh.get_include()])


def test_the_old_timeout_result_name_still_builds_as_an_alias(tmp_path):
    """FLAGCX_MESH_TIMEOUT, the environment variable's name, was also result code 2's: the code is
    FLAGCX_MESH_TIMED_OUT now and the old name a deprecated alias of it (same value)."""
    src = tmp_path / "alias.c"
    src.write_text('#include "flagcx_mesh.h"\n'
                   "typedef char same_value[(FLAGCX_MESH_TIMEOUT == FLAGCX_MESH_TIMED_OUT"
                   " && FLAGCX_MESH_TIMED_OUT == 2) ? 1 : -1];\n"
                   "int main(void) { flagcx_mesh_result_t r = FLAGCX_MESH_TIMEOUT; return r == 2 ? 0 : 1; }\n")
    sh([CC, "-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-c", str(src), "-o", str(tmp_path / "a.o"),
        "-I" + flagcx_mesh.get_include()])


def test_example_builds_with_one_compiler_line_and_runs(tmp_path):
    exe = tmp_path / "put_signal"
    sh(f"{CC} -std=c99 -Wall -Wextra -Werror {EXAMPLE} $({sys.executable} -m flagcx_mesh.config --cflags --libs)"
       f" -o {exe}")
    for n in (2, 4):
        assert_example_passed(launch(str(exe), n), n)


def test_example_builds_with_cmake_find_package(tmp_path):
    venv_cmake = os.path.join(os.path.dirname(sys.executable), "cmake")
    cmake = shutil.which("cmake") or (venv_cmake if os.path.exists(venv_cmake) else None)
    assert cmake, "cmake is needed to test the CMake package config (scripts/test.sh installs it)"
    build = tmp_path / "build"
    sh([cmake, "-S", os.path.dirname(EXAMPLE), "-B", str(build), "-Dflagcx_mesh_DIR=" + config_flags("--cmake-dir")])
    sh([cmake, "--build", str(build)])
    assert_example_passed(launch(str(build / "put_signal"), 2), 2)


def test_example_builds_with_pkg_config(tmp_path):
    text = open(os.path.join(config.get_pkgconfig_dir(), "flagcx_mesh.pc")).read()
    assert f"Version: {flagcx_mesh.__version__}" in text
    pkg_config = shutil.which("pkg-config")
    if pkg_config is None:  # read the .pc the way pkg-config would: ${pcfiledir} and the variables
        flags = pc_flags(text, config.get_pkgconfig_dir())
    else:
        env = dict(os.environ, PKG_CONFIG_PATH=config.get_pkgconfig_dir())
        flags = sh([pkg_config, "--cflags", "--libs", "flagcx_mesh"], env=env).strip()
    exe = tmp_path / "put_signal"
    sh(f"{CC} -std=c99 {EXAMPLE} {flags} -o {exe}")
    assert_example_passed(launch(str(exe), 2), 2)


def pc_flags(text, pcfiledir):
    values = {"pcfiledir": pcfiledir}
    expand = lambda s: re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], s)  # noqa: E731
    fields = {}
    for line in text.splitlines():
        if re.match(r"^\w+=", line):
            k, v = line.split("=", 1)
            values[k] = expand(v)
        elif re.match(r"^\w+:", line):
            k, v = line.split(":", 1)
            fields[k] = expand(v.strip())
    return fields["Cflags"] + " " + fields["Libs"]


def test_only_the_c_abi_is_exported():
    nm = shutil.which("nm")
    assert nm, "nm (binutils) is needed"
    out = sh([nm, "-D", "--defined-only", flagcx_mesh.get_library()])
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert names and all(n.startswith("flagcx_mesh_") for n in names), names
    header = open(os.path.join(flagcx_mesh.get_include(), "flagcx_mesh.h")).read()
    header += open(os.path.join(flagcx_mesh.get_include(), "flagcx_mesh_net.h")).read()
    declared = set(re.findall(r"\b(flagcx_mesh_\w+)\(", header))
    assert declared <= set(names), f"declared but not exported: {sorted(declared - set(names))}"
    assert not [n for n in names if n.startswith("flagcx_mesh_test_")], "test doubles in the shipped library"


def test_the_testing_library_exports_the_test_adaptor_only():
    out = sh([shutil.which("nm"), "-D", "--defined-only", testdoubles.testing_library()])
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    header = open(os.path.join(testdoubles.include_dir(), "flagcx_mesh_testing.h")).read()
    declared = set(re.findall(r"\b(flagcx_mesh_\w+)\(", header))
    assert declared and names == declared, (sorted(names), sorted(declared))


# ---------------------------------------------------------------- calls through ctypes

class Lib:
    """libflagcx_mesh.so with the signatures this test uses."""

    def __init__(self):
        L = ctypes.CDLL(flagcx_mesh.get_library())
        c, u32, u64, p, d = ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_double
        sigs = {
            "version": ([], c), "result_string": ([c], ctypes.c_char_p), "last_error": ([], ctypes.c_char_p),
            "last_error_peer": ([], c), "last_error_errno": ([], c),
            "get_unique_id": ([p], c), "unique_id_from_hex": ([ctypes.c_char_p, p], c),
            "comm_init": ([p, c, p, c, p], c), "comm_init_from_env": ([p, p], c), "comm_destroy": ([p], c), "comm_rank": ([p, p], c),
            "barrier": ([p, d], c), "window_alloc": ([p, u64, p, p], c), "window_register": ([p, p, u64, p], c),
            "signal_window": ([p, u64, p], c), "window_path": ([p, u32, c, p], c),
            "window_describe": ([p, u32, p, ctypes.c_size_t, p], c),
            "put": ([p, c, u32, u64, u32, u64, u64], c),
            "put_signal": ([p, c, u32, u64, u32, u64, u64, u32, u64, u64], c),
            "signal": ([p, c, u32, u64, u64], c), "get": ([p, c, u32, u64, u32, u64, u64], c),
            "read_signal": ([p, u32, u64, p], c), "wait_signal": ([p, u32, u64, u64, d], c),
            "flush": ([p, c, d], c), "read_counter": ([p, p], c), "wait_counter": ([p, u64, d], c),
            "window_deregister": ([p, u32], c),
        }
        for name, (args, res) in sigs.items():
            fn = getattr(L, "flagcx_mesh_" + name)
            fn.argtypes, fn.restype = args, res
            setattr(self, name, fn)

    def error(self):
        return self.last_error().decode()


@pytest.fixture(scope="module")
def lib():
    return Lib()


def uid_of(lib):
    uid = ctypes.create_string_buffer(256)
    assert lib.get_unique_id(uid) == 0, lib.error()
    return uid


def test_version_and_result_strings(lib):
    major, minor, patch = (int(x) for x in flagcx_mesh.__version__.split("."))
    assert lib.version() == major * 10000 + minor * 100 + patch
    header = open(os.path.join(flagcx_mesh.get_include(), "flagcx_mesh.h")).read()
    assert f"#define FLAGCX_MESH_VERSION_MINOR {minor}" in header
    texts = [lib.result_string(i).decode() for i in range(len(CODES))]
    assert texts[0] == "success"
    for code, text in zip(CODES[1:], texts[1:]):
        assert code.replace("_", " ").split()[0].lower() in text.lower() and len(text) > 20, (code, text)
    assert len(set(texts)) == len(texts)
    for bad in (len(CODES), -1, 1000):
        assert "unknown" in lib.result_string(bad).decode()
    for i, code in enumerate(CODES):  # the same numbers as the Python error hierarchy
        assert re.search(rf"FLAGCX_MESH_{code} = {i}\b", header), code


def test_bad_input_gives_a_code_and_says_what_failed(lib):
    comm = ctypes.c_void_p(12345)
    assert lib.comm_init(ctypes.byref(comm), 0, uid_of(lib), 0, None) == 1
    assert "flagcx_mesh_comm_init" in lib.error() and "nranks" in lib.error()
    assert comm.value == 12345, "an output was written on failure"
    assert lib.comm_init(None, 1, uid_of(lib), 0, None) == 1 and "comm is NULL" in lib.error()
    assert lib.put(None, 0, 0, 0, 0, 0, 8) == 1 and "flagcx_mesh_put: comm is NULL" == lib.error()
    assert lib.unique_id_from_hex(b"abc", ctypes.create_string_buffer(256)) == 1 and "512" in lib.error()
    assert lib.unique_id_from_hex(b"00" * 256, ctypes.create_string_buffer(256)) == 1  # not an id
    assert lib.comm_rank(None, None) == 1
    cfg = (ctypes.c_size_t * 4)(4)  # a config struct with a wrong size field
    assert lib.comm_init(ctypes.byref(comm), 1, uid_of(lib), 0, cfg) == 1 and "config->size" in lib.error()
    assert lib.comm_destroy(None) == 0 and lib.error() == ""


def test_init_from_env_names_the_missing_or_bad_variable(lib, monkeypatch):
    comm = ctypes.c_void_p(777)
    for name in ("FLAGCX_MESH_RANK", "FLAGCX_MESH_NRANKS", "FLAGCX_MESH_UNIQUE_ID"):
        monkeypatch.delenv(name, raising=False)
    assert lib.comm_init_from_env(ctypes.byref(comm), None) == 1
    assert "FLAGCX_MESH_RANK is not set" in lib.error() and "flagcx_mesh.launch" in lib.error()
    monkeypatch.setenv("FLAGCX_MESH_RANK", "0")
    monkeypatch.setenv("FLAGCX_MESH_NRANKS", "two")
    assert lib.comm_init_from_env(ctypes.byref(comm), None) == 1 and "FLAGCX_MESH_NRANKS=two" in lib.error()
    monkeypatch.setenv("FLAGCX_MESH_NRANKS", "1")
    monkeypatch.setenv("FLAGCX_MESH_UNIQUE_ID", "zz")
    assert lib.comm_init_from_env(ctypes.byref(comm), None) == 1 and "512" in lib.error()
    monkeypatch.setenv("FLAGCX_MESH_UNIQUE_ID", bytes(uid_of(lib).raw).hex())
    assert lib.comm_init_from_env(ctypes.byref(comm), None) == 0, lib.error()
    assert lib.comm_destroy(comm) == 0


def test_single_rank_comm_through_the_c_abi(lib):
    comm = ctypes.c_void_p()
    assert lib.comm_init(ctypes.byref(comm), 1, uid_of(lib), 0, None) == 0, lib.error()
    rank, idx, sig, base = ctypes.c_int(-1), ctypes.c_uint32(), ctypes.c_uint32(), ctypes.c_void_p()
    assert lib.comm_rank(comm, ctypes.byref(rank)) == 0 and rank.value == 0
    assert lib.window_alloc(comm, 64, ctypes.byref(idx), ctypes.byref(base)) == 0, lib.error()
    assert lib.signal_window(comm, 4, ctypes.byref(sig)) == 0 and sig.value == idx.value + 1
    ctypes.memmove(base, b"A" * 8, 8)
    assert lib.put_signal(comm, 0, idx, 0, idx, 32, 8, sig, 2, 5) == 0, lib.error()
    assert lib.wait_signal(comm, sig, 2, 5, 5.0) == 0, lib.error()
    assert ctypes.string_at(base.value + 32, 8) == b"A" * 8
    value = ctypes.c_uint64()
    assert lib.read_signal(comm, sig, 2, ctypes.byref(value)) == 0 and value.value == 5
    assert lib.wait_signal(comm, sig, 2, 6, 0.2) == 2 and "flagcx_mesh_wait_signal" in lib.error()
    assert lib.put(comm, 0, idx, 60, idx, 0, 8) == 1 and "flagcx_mesh_put" in lib.error()
    assert lib.read_signal(comm, sig, 4, ctypes.byref(value)) == 1  # slot 4 of 4
    need = ctypes.c_size_t()
    text = ctypes.create_string_buffer(8)
    assert lib.window_describe(comm, idx, text, 8, ctypes.byref(need)) == 0 and need.value > 8
    assert len(text.value) == 7  # truncated, NUL-terminated
    assert lib.comm_destroy(comm) == 0


def run_ranks(n, body):
    """Runs body(lib, comm, rank) on n threads, each with its own comm; returns their errors."""
    lib, uid, errors = Lib(), None, [None] * n
    uid = uid_of(lib)

    def rank_main(r):
        comm = ctypes.c_void_p()
        try:
            assert lib.comm_init(ctypes.byref(comm), n, uid, r, None) == 0, lib.error()
            body(lib, comm, r)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors[r] = e
        finally:
            lib.comm_destroy(comm)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return errors


def test_ranks_put_signal_get_and_errors_name_the_peer(lib):
    n = 3

    def body(lib, comm, r):
        buf = ctypes.create_string_buffer(bytes([r + 1]) * 4096)
        src, dst, sig, base = ctypes.c_uint32(), ctypes.c_uint32(), ctypes.c_uint32(), ctypes.c_void_p()
        assert lib.window_register(comm, buf, 4096, ctypes.byref(src)) == 0, lib.error()
        assert lib.window_alloc(comm, 4096 * n, ctypes.byref(dst), ctypes.byref(base)) == 0, lib.error()
        assert lib.signal_window(comm, 2, ctypes.byref(sig)) == 0, lib.error()
        path = ctypes.c_char_p()
        assert lib.window_path(comm, dst, (r + 1) % n, ctypes.byref(path)) == 0
        assert path.value.decode() in ("self", "shm", "cma", "tcp")
        for peer in range(n):
            assert lib.put_signal(comm, peer, src, 0, dst, 4096 * r, 4096, sig, 0, 1) == 0, lib.error()
        assert lib.wait_signal(comm, sig, 0, n, 30.0) == 0, lib.error()
        got = ctypes.string_at(base.value, 4096 * n)
        assert got == b"".join(bytes([p + 1]) * 4096 for p in range(n))
        assert lib.put(comm, n + 2, src, 0, dst, 0, 8) == 1
        assert lib.last_error_peer() == n + 2 and f"rank {r}" in lib.error(), lib.error()
        assert lib.signal(comm, (r + 1) % n, sig, 1, 7) == 0
        assert lib.flush(comm, -1, 30.0) == 0, lib.error()
        assert lib.wait_signal(comm, sig, 1, 7, 30.0) == 0, lib.error()
        assert lib.get(comm, (r + 1) % n, dst, 0, src, 0, 16) == 0, lib.error()
        assert lib.flush(comm, -1, 30.0) == 0, lib.error()
        assert buf.raw[:16] == bytes([1]) * 16  # every peer's dst starts with rank 0's block
        count = ctypes.c_uint64()
        assert lib.read_counter(comm, ctypes.byref(count)) == 0 and count.value >= n + 2
        assert lib.wait_counter(comm, count.value, 5.0) == 0
        assert lib.barrier(comm, 30.0) == 0, lib.error()
        assert lib.window_deregister(comm, src) == 0, lib.error()
        assert lib.put(comm, 0, src, 0, dst, 0, 8) == 1 and "flagcx_mesh_put" in lib.error()

    errors = run_ranks(n, body)
    assert errors == [None] * n, errors


def test_a_rank_refusing_a_registration_fails_every_rank_naming_it(lib):
    def body(lib, comm, r):
        idx = ctypes.c_uint32(99)
        buf = ctypes.create_string_buffer(64)
        res = lib.window_register(comm, None if r == 1 else buf, 64, ctypes.byref(idx))
        assert res == 1 and idx.value == 99, (res, lib.error())
        assert "base is NULL" in lib.error() and ("rank 1" in lib.error()), lib.error()

    errors = run_ranks(2, body)
    assert errors == [None, None], errors
