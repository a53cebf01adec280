"""flagcx_mesh: a tagged full mesh of connections for GPU serving stacks.

Quick start (every rank)::

    import flagcx_mesh
    uid = flagcx_mesh.get_unique_id()        # on one rank; send the bytes to all
    with flagcx_mesh.Mesh(nranks, uid, rank) as mesh:
        mesh.send(peer, b"hello")
        data = mesh.recv(peer)
"""

from . import errors
from .errors import (
    InvalidArgument,
    MeshClosed,
    MeshError,
    MeshTimeout,
    PeerLost,
    ProtocolError,
    SystemCallError,
)
from ._paths import get_include, get_library, get_library_dir
from .mesh import UNIQUE_ID_SIZE, Mesh, get_unique_id, release_unique_id
from .window import SignalWindow, Window
from .agent import Agent, AgentConnection, Handle, Notification, NotificationWait, Region
from ._logbridge import log_to_python, log_to_stderr
from . import _ucx

_ucx.tell_core()  # the [ucx] extra's libucp, where installed (docs/rdma.md)

__version__ = "0.4.0"

__all__ = [
    "Mesh",
    "Agent",
    "AgentConnection",
    "Region",
    "Handle",
    "Notification",
    "NotificationWait",
    "Window",
    "SignalWindow",
    "get_unique_id",
    "release_unique_id",
    "UNIQUE_ID_SIZE",
    "errors",
    "MeshError",
    "InvalidArgument",
    "MeshTimeout",
    "PeerLost",
    "ProtocolError",
    "SystemCallError",
    "MeshClosed",
    "log_to_python",
    "log_to_stderr",
    "get_include",
    "get_library",
    "get_library_dir",
    "__version__",
]
