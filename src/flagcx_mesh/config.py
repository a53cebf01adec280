"""Where the C library, its headers and its CMake / pkg-config files are installed.

From a shell::

    cc prog.c $(python -m flagcx_mesh.config --cflags --libs) -o prog
    cmake -Dflagcx_mesh_DIR=$(python -m flagcx_mesh.config --cmake-dir) ...
    PKG_CONFIG_PATH=$(python -m flagcx_mesh.config --pkgconfig-dir) pkg-config --libs flagcx_mesh
"""

import argparse
import shlex
import sys
from typing import List, Optional

from ._paths import cflags, get_cmake_dir, get_include, get_library, get_pkgconfig_dir, libs


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.config", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cflags", action="store_true", help="compiler flags")
    p.add_argument("--libs", action="store_true", help="linker flags")
    p.add_argument("--include", action="store_true", help="the include directory")
    p.add_argument("--library", action="store_true", help="the path of libflagcx_mesh.so")
    p.add_argument("--cmake-dir", action="store_true", help="the CMake package directory")
    p.add_argument("--pkgconfig-dir", action="store_true", help="the pkg-config directory")
    args = p.parse_args(argv)
    flags: List[str] = []
    if args.cflags:
        flags += cflags()
    if args.libs:
        flags += libs()
    dirs = [(args.include, get_include), (args.library, get_library),
            (args.cmake_dir, get_cmake_dir), (args.pkgconfig_dir, get_pkgconfig_dir)]
    lines = [fn() for wanted, fn in dirs if wanted]
    if not flags and not lines:
        p.print_help()
        return 2
    if flags:
        print(" ".join(shlex.quote(f) for f in flags))
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
