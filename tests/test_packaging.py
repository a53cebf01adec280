"""The installed package is what a user gets: the C library, its headers and the Python modules,
and no test double (libflagcx_mesh_testing.so, libflagcx_mesh_fakecuda.so and the test adaptor's
header are built by the test build into build/test-doubles, see tests/testdoubles.py)."""

import importlib.metadata
import os

import flagcx_mesh

import testdoubles

TEST_DOUBLES = {testdoubles.TESTING_LIBRARY, testdoubles.FAKECUDA_LIBRARY, "flagcx_mesh_testing.h"}
PKG_DIR = os.path.dirname(os.path.abspath(flagcx_mesh.__file__))


def _wheel_files():
    """Every file the installed wheel's RECORD lists."""
    files = importlib.metadata.files("flagcx_mesh")
    assert files, "flagcx_mesh is installed without a RECORD"
    return [str(f) for f in files]


def test_the_wheel_holds_no_test_double():
    files = _wheel_files()
    assert any(f.endswith("lib/libflagcx_mesh.so") for f in files), files
    shipped = sorted(f for f in files if os.path.basename(f) in TEST_DOUBLES)
    assert not shipped, f"the wheel ships test doubles: {shipped}"


def test_the_installed_package_holds_no_test_double():
    found = sorted(os.path.join(d, f) for d, _, names in os.walk(PKG_DIR) for f in names
                   if f in TEST_DOUBLES)
    assert not found, f"test doubles in the installed package: {found}"


def test_the_test_doubles_are_found_outside_the_package():
    for path in (testdoubles.testing_library(), testdoubles.fakecuda_library(),
                 os.path.join(testdoubles.include_dir(), "flagcx_mesh_testing.h")):
        assert os.path.isfile(path), path
        assert not os.path.abspath(path).startswith(PKG_DIR + os.sep), path
