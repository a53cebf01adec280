"""Argument checks shared by the mesh, its windows, the agents and compat: integers in range,
bytes-likes, writable byte views; each refusal is InvalidArgument naming the argument."""

from __future__ import annotations

import functools
import inspect
import operator

from .errors import InvalidArgument
from .window import index_of

_U64 = 1 << 64


def _ints(op: str, **values: int) -> None:
    """Refuses negative or out-of-range integers, naming the argument (nothing is issued)."""
    for name, v in values.items():
        limit = 1 << 31 if name in ("peer", "context") else _U64
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < limit:
            raise InvalidArgument(f"{op}: {name} {v!r} is out of range (must be an integer in [0, {limit}))")


def _names_bad_ints(*names: str):
    """One fallback for the integer arguments ``names`` of a method: pybind11 refuses a
    negative, huge or non-integer value with TypeError before the core sees it; that becomes
    InvalidArgument naming the argument. The method's own call costs one frame, no more."""

    def wrap(method):
        signature = inspect.signature(method)

        @functools.wraps(method)
        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except TypeError:
                bound = signature.bind(*args, **kwargs)  # a wrong call raises its own TypeError
                bound.apply_defaults()
                _ints(method.__name__, **{n: index_of(v) if n.endswith(("win", "window")) else v
                                          for n, v in bound.arguments.items() if n in names and v is not None})
                raise

        return call

    return wrap


def _bytes_like(data, what: str) -> memoryview:
    """``data`` as a memoryview (any object with the buffer protocol); anything else (a str, an
    int: bytes(5) would be five zeros) raises InvalidArgument naming ``what``."""
    if not isinstance(data, str):
        try:
            return memoryview(data)
        except TypeError:
            pass
    raise InvalidArgument(f"{what} must be bytes-like (bytes, bytearray, memoryview, a contiguous array), "
                          f"not {type(data).__name__}")


def _as_int(v):
    """v as an int when it is an integer scalar (numpy, torch, anything with __index__);
    otherwise v itself (bools included), for the range checks to refuse by its own repr."""
    if isinstance(v, bool):
        return v
    try:
        return operator.index(v)
    except TypeError:
        return v


def _byte_view(buffer, what: str) -> memoryview:
    """A writable, C-contiguous byte view of a buffer-protocol object or a torch CPU tensor."""
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "is_contiguous"):  # torch.Tensor
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise InvalidArgument(f"{what}: a torch tensor must be on the CPU and contiguous "
                                  f"(device={buffer.device}, contiguous={buffer.is_contiguous()})")
        import torch

        buffer = buffer.detach().reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(buffer)
    except TypeError as e:
        raise InvalidArgument(f"{what}: {e}") from None
    if view.readonly or not view.c_contiguous:
        raise InvalidArgument(f"{what}: the buffer must be writable and C-contiguous "
                              f"(readonly={view.readonly}, contiguous={view.c_contiguous})")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view
