"""integrations/flagcx/real/onesided_real.cc, the GPU machine's program, without a GPU: built over
a stand-in for libflagcx and the CUDA runtime (FlagCX's own flagcx.h, FLAGCX_SRC), one rank. A
bandwidth is printed only for a flagcxWaitCounter that succeeded; a failed wait confirms no bytes
and says so (the first real run printed "flagcxRemoteError (6) in 1.1 ms: 60.78 GB/s")."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.path.join(ROOT, "integrations", "flagcx", "real", "onesided_real.cc")
FLAGCX_SRC = os.environ.get("FLAGCX_SRC", "")
FLAGCX_H = os.path.join(FLAGCX_SRC, "flagcx", "include", "flagcx.h")

CUDA_DECL = """#include <stddef.h>
typedef enum { cudaSuccess = 0 } cudaError_t;
cudaError_t cudaGetDeviceCount(int *); cudaError_t cudaSetDevice(int);
cudaError_t cudaMalloc(void **, size_t); cudaError_t cudaMemset(void *, int, size_t);
"""

# Every call succeeds but flagcxWaitCounter, which returns FAKE_WAIT_RESULT (default 0).
STAND_IN = r"""#include <cuda_runtime.h>
#include <cstdlib>
#include <cstring>
#include "flagcx.h"
cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaMalloc(void **p, size_t n) { *p = malloc(n); return cudaSuccess; }
cudaError_t cudaMemset(void *p, int v, size_t n) { memset(p, v, n); return cudaSuccess; }
static int g_comm;
extern "C" {
void flagcxMeshProbeInstall(void) {}
flagcxResult_t flagcxGetUniqueId(flagcxUniqueId_t id) { memset(id, 0, sizeof *id); return flagcxSuccess; }
flagcxResult_t flagcxCommInitRank(flagcxComm_t *c, int, flagcxUniqueId_t, int) {
  *c = (flagcxComm_t)&g_comm; return flagcxSuccess; }
flagcxResult_t flagcxOneSideRegister(flagcxComm_t, void *, size_t) { return flagcxSuccess; }
flagcxResult_t flagcxOneSideSignalRegister(const flagcxComm_t, void *, size_t, int) { return flagcxSuccess; }
flagcxResult_t flagcxReadCounter(flagcxComm_t, uint64_t *n) { *n = 0; return flagcxSuccess; }
flagcxResult_t flagcxPut(flagcxComm_t, int, size_t, size_t, size_t, int, int) { return flagcxSuccess; }
flagcxResult_t flagcxGet(flagcxComm_t, int, size_t, size_t, size_t, int, int) { return flagcxSuccess; }
flagcxResult_t flagcxWaitCounter(flagcxComm_t, uint64_t) {
  const char *r = getenv("FAKE_WAIT_RESULT"); return (flagcxResult_t)(r ? atoi(r) : 0); }
flagcxResult_t flagcxCommDestroy(flagcxComm_t) { return flagcxSuccess; }
}
"""

needs_flagcx = pytest.mark.skipif(not os.path.isfile(FLAGCX_H),
                                  reason="no FlagCX sources: set FLAGCX_SRC to a FlagCX 0c721293 tree")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    d = tmp_path_factory.mktemp("onesided_real")
    (d / "cuda_runtime.h").write_text(CUDA_DECL)
    (d / "stand_in.cc").write_text(STAND_IN)
    exe = d / "onesided_real"
    p = subprocess.run(["g++", "-std=c++17", "-O1", "-w", "-rdynamic", "-I", str(d), "-I", os.path.dirname(FLAGCX_H),
                        PROGRAM, str(d / "stand_in.cc"), "-o", str(exe), "-ldl", "-lpthread"],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    return exe


def run_rank(program, tmp_path, wait_result):
    env = dict(os.environ, FAKE_WAIT_RESULT=str(wait_result), FXM_REAL_BYTES="4096")
    p = subprocess.run([str(program), str(tmp_path / "uid"), "0", "1"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    waits = [line for line in p.stdout.splitlines() if "flagcxWaitCounter" in line]
    assert len(waits) == 2, p.stdout  # the put's and the get's
    return waits, p.stdout


@needs_flagcx
@pytest.mark.timeout(300)
def test_a_failed_wait_prints_no_bandwidth(program, tmp_path):
    waits, out = run_rank(program, tmp_path, 6)  # flagcxRemoteError, as on the GPU machine
    for line in waits:
        assert line.startswith("rank 0: flagcxWaitCounter: flagcxRemoteError (6) in "), out
        assert "GB/s" not in line, out
        assert line.endswith(": the op failed, no bytes confirmed"), out
    assert "rank 0: flagcxCommDestroy: ok (0)" in out


@needs_flagcx
@pytest.mark.timeout(300)
def test_a_successful_wait_prints_its_bandwidth(program, tmp_path):
    waits, out = run_rank(program, tmp_path, 0)
    for line in waits:
        assert line.startswith("rank 0: flagcxWaitCounter: ok (0) in "), out
        assert line.endswith(" GB/s") and "confirmed" not in line, out
