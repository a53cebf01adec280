"""Where the core finds UCX: the ``libucx`` wheel of the ``[ucx]`` extra, told at import.

The core (transport/ucx) loads libucp at run time: ``FLAGCX_MESH_UCX_LIB`` first, then the
wheel's ``libucx/lib/libucp.so.0`` (found here without importing the wheel's package), then the
system's ``libucp.so.0``. See docs/rdma.md.
"""

import importlib.util
import os

from . import _core


def wheel_libucp():
    """The libucx wheel's libucp.so.0, or None when the wheel is not installed."""
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "lib", "libucp.so.0")
        if os.path.exists(path):
            return path
    return None


def tell_core():
    path = wheel_libucp()
    if path:
        _core._ucx_set_wheel_library(path)


def info():
    """Opens UCX in this process (once) and says what was loaded: library, version, transports, error."""
    return _core.ucx_info()
