"""The one meaning of a timeout argument in every call of the library (docs/python-api.md,
"Timeouts"): ``None`` or ``0`` is the object's timeout (the mesh's, the agent's: the core reads
0.0 so), a number > 0 is seconds, ``math.inf`` no limit; a negative number or NaN raises
InvalidArgument naming the argument, and so does anything that is not a number. A build deadline is the same, except that it is never unlimited."""

from __future__ import annotations

import math
import numbers

from .errors import InvalidArgument


def call_timeout(timeout, what: str) -> float:
    """``timeout`` as the core takes it (0.0: the object's timeout); InvalidArgument naming
    ``what`` (e.g. "recv: timeout") for anything but None, 0, a number > 0 or inf. The core
    checks the value again (its C callers reach it without this)."""
    if timeout is None:
        return 0.0
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidArgument(f"{what} must be a number of seconds or None, got {timeout!r}")
    t = float(timeout)
    if t >= 0:  # NaN is not
        return t
    raise InvalidArgument(f"{what} must be a finite number of seconds > 0 (or inf: no limit), got {timeout!r}")


def build_timeout(timeout, what: str) -> float:
    """A build deadline (0.0: FLAGCX_MESH_TIMEOUT): None, 0 or a finite number of seconds > 0."""
    t = call_timeout(timeout, what)
    if t == 0 or (t > 0 and math.isfinite(t)):
        return t
    raise InvalidArgument(f"{what} must be a finite number of seconds > 0, or None or 0 "
                          f"(FLAGCX_MESH_TIMEOUT), got {timeout!r}")
