"""Paths of the C library, its headers and its CMake / pkg-config files inside this package."""

import os
from typing import List

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
LIBRARY_NAME = "libflagcx_mesh.so"


def _existing(path: str, what: str) -> str:
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"flagcx_mesh: {what} is missing at {path}; this install has no C library "
            "(install the package with pip, which builds it)")
    return path


def get_include() -> str:
    """Directory holding flagcx_mesh.h (and flagcx_mesh_net.h)."""
    return _existing(os.path.join(_PKG_DIR, "include"), "the C headers")


def get_library_dir() -> str:
    """Directory holding libflagcx_mesh.so."""
    return _existing(os.path.join(_PKG_DIR, "lib"), "the C library directory")


def get_library() -> str:
    """Full path of libflagcx_mesh.so (for dlopen / ctypes.CDLL)."""
    return _existing(os.path.join(_PKG_DIR, "lib", LIBRARY_NAME), "the C library")


def get_cmake_dir() -> str:
    """Directory of flagcx_meshConfig.cmake: pass it as -Dflagcx_mesh_DIR=..."""
    return _existing(os.path.join(_PKG_DIR, "lib", "cmake", "flagcx_mesh"), "the CMake package")


def get_pkgconfig_dir() -> str:
    """Directory of flagcx_mesh.pc: put it on PKG_CONFIG_PATH."""
    return _existing(os.path.join(_PKG_DIR, "lib", "pkgconfig"), "the pkg-config file")


def cflags() -> List[str]:
    """Compiler flags for a program that includes flagcx_mesh.h."""
    return ["-I" + get_include()]


def libs() -> List[str]:
    """Linker flags (with an rpath, so the program runs without LD_LIBRARY_PATH)."""
    libdir = get_library_dir()
    return ["-L" + libdir, "-Wl,-rpath," + libdir, "-lflagcx_mesh"]
