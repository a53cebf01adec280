"""The PTX the library embeds (csrc/transport/cuda/kernels/*.ptx.inc) is what its CUDA source
compiles to, and assembles as the ISA it declares: scripts/gen-kernels.sh --check regenerates it
with nvcc, assembles it with ptxas for sm_75 and compares. Needs the nvcc release that made it
(recorded in the file); without nvcc, or with another release, the check cannot run and the test
says so."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(shutil.which(os.environ.get("NVCC", "nvcc")) is None, reason="no nvcc: the embedded PTX "
                    "was not compared with its source")
def test_the_embedded_ptx_is_what_its_source_compiles_to():
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gen-kernels.sh"), "--check"], capture_output=True,
                       text=True, timeout=100)
    if p.returncode == 3:
        pytest.skip(p.stderr.strip())
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_ptx_declares_an_isa_old_drivers_load():
    with open(os.path.join(ROOT, "csrc", "transport", "cuda", "kernels", "copy_blocks.ptx.inc")) as f:
        text = f.read()
    assert ".version 7.0\n" in text and ".target sm_75\n" in text and ".entry fxm_copy_blocks(" in text
