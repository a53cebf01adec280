"""The core's log lines into Python's ``logging`` (``flagcx_mesh.log_to_python``).

The core never calls into Python: while the bridge is on, its lines go to a bounded queue in the
core, and a daemon thread of this module drains it (GIL released while it waits) into a logger.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Optional

from . import _core

_LEVELS = (logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG)  # the core's order
_lock = threading.Lock()
_state = {"thread": None, "stop": None, "logger": None}


def _drain(stop: threading.Event, logger: logging.Logger) -> None:
    while not stop.is_set():
        lines, dropped = _core.log_take(0.2)
        if dropped:
            logger.warning("%d log line(s) of the core were dropped (its queue holds 10000)", dropped)
        for level, text in lines:
            logger.log(_LEVELS[level], "%s", text)


def log_to_python(logger: Optional[logging.Logger] = None) -> logging.Logger:
    """From now on the core's log lines (FLAGCX_MESH_LOG decides which) go to ``logger`` (default:
    ``logging.getLogger("flagcx_mesh")``) at the matching level, as "[rank r] message" or
    "message", instead of stderr. Idempotent (a second call switches the logger)."""
    logger = logger or logging.getLogger("flagcx_mesh")
    with _lock:
        _state["logger"] = logger
        if _state["thread"] is not None:
            _stop_thread()
        stop = threading.Event()
        t = threading.Thread(target=_drain, args=(stop, logger), name="flagcx_mesh-log", daemon=True)
        _core.log_capture(True)
        t.start()
        _state.update(thread=t, stop=stop)
    return logger


def log_to_stderr() -> None:
    """Back to stderr: lines still queued go to the logger first."""
    with _lock:
        _stop_thread()
        _state["logger"] = None


def _stop_thread() -> None:
    t, stop = _state["thread"], _state["stop"]
    if t is None:
        return
    _core.log_capture(False)
    stop.set()
    t.join(5)
    lines, _ = _core.log_take(0)
    for level, text in lines:
        _state["logger"].log(_LEVELS[level], "%s", text)
    _state.update(thread=None, stop=None)


atexit.register(log_to_stderr)  # the thread stops before the interpreter does
