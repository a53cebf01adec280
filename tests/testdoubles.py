"""Where the tests find the test doubles, which the shipped package does not hold.

libflagcx_mesh_testing.so (the test adaptor's C ABI, with flagcx_mesh_testing.h) and
libflagcx_mesh_fakecuda.so (the fake CUDA driver) are built by a build configured with
-DFXM_TEST_DOUBLES=ON into FXM_TEST_DOUBLES_DIR (default: build/test-doubles of this checkout);
scripts/test.sh builds them. See docs/testing.md, "Test doubles".
"""

import os

DIR_ENV = "FXM_TEST_DOUBLES_DIR"
TESTING_LIBRARY = "libflagcx_mesh_testing.so"
FAKECUDA_LIBRARY = "libflagcx_mesh_fakecuda.so"
BUILD_HINT = ("pip install --no-deps --no-build-isolation -C cmake.define.FXM_TEST_DOUBLES=ON . "
              "(scripts/test.sh does), or point FXM_TEST_DOUBLES_DIR at a folder that holds them")


def directory() -> str:
    """FXM_TEST_DOUBLES_DIR, else build/test-doubles beside tests/ (the CMake default)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.abspath(os.environ.get(DIR_ENV) or os.path.join(here, "build", "test-doubles"))


def _existing(path: str, what: str) -> str:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} is missing at {path}; build the test doubles with: {BUILD_HINT}")
    return path


def library(name: str) -> str:
    """Full path of one test double's shared library (TESTING_LIBRARY, FAKECUDA_LIBRARY)."""
    return _existing(os.path.join(directory(), name), name)


def testing_library() -> str:
    return library(TESTING_LIBRARY)


def fakecuda_library() -> str:
    return library(FAKECUDA_LIBRARY)


def include_dir() -> str:
    """The folder of flagcx_mesh_testing.h."""
    return _existing(os.path.join(directory(), "include"), "the test adaptor's header folder")
