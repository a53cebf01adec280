"""What the two halves of the vLLM connector's transfer part (transfer.py: KVTransfer, its prefill
side in _prefill_side.py, its decode side in _decode_side.py) share: the records of held requests,
pushes and fetches, the results of a poll, the helpers and limits they use."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from .. import _core
from ..errors import MeshError
from .groups import Groups
from .layout import WHOLE

log = logging.getLogger("vllm.flagcx_mesh")  # under vLLM's logger: its lines show in `vllm serve`

FORGET_AFTER = 4096  # how many served / expired request ids a prefill remembers
MAX_EARLY = 4096     # wants awaiting their hold at once (more are refused)
LOG_EVERY = 10.0     # seconds between two log lines of one kind of peer trouble
ANSWER_SLACK = 30.0  # seconds the core awaits a push's D past fetch_timeout (the thread fails it at that)
EARLY = " before its hold"  # a request released before this worker's hold of it came (_on_release)
SERVED_STARTED, SERVED_ENDED, SERVED_LATE = (  # the kinds of the core's served-push events (_on_served)
    _core._BlockPuller.SERVED_STARTED, _core._BlockPuller.SERVED_ENDED, _core._BlockPuller.SERVED_LATE)
PULL_PATHS = frozenset(("cuda-ipc", "cuda-vmm", "cuda-self", "cma", "shm", "self"))  # a read of them waits on no network


class _Throttled:
    """A warning at most once per ``every`` seconds; the lines it held back are counted in
    the next one."""

    def __init__(self, every: float = LOG_EVERY):
        self.every, self.next_at, self.held_back = every, 0.0, 0

    def warn(self, fmt: str, *args) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.held_back += 1
            return
        if self.held_back:
            fmt += " (and %d more like it in the last %.0f s)"
            args = args + (self.held_back, self.every)
        self.next_at, self.held_back = now + self.every, 0
        log.warning(fmt, *args)


@dataclass
class Finished:
    """What completed since the last poll: requests whose blocks a prefill released
    (``sending``), requests a decode finished receiving, successfully or not (``recving``),
    and of those the ones that failed, with their local block ids (``failed``)."""

    sending: Set[str] = field(default_factory=set)
    recving: Set[str] = field(default_factory=set)
    failed: Dict[str, List[int]] = field(default_factory=dict)


@dataclass
class _Closing:
    """A connection being closed on a thread of its own (a stalled peer makes the close wait
    for its engine, up to about 2 s); ``done`` once it returned: its engine is stopped."""

    peer: str
    done: threading.Event
    thread: Optional[threading.Thread] = None


@dataclass
class _Push:
    peer: str
    tag: str
    handles: list
    started: float
    conn: object = None
    deadline: float = float("inf")
    closing: Optional[_Closing] = None  # abandoned: its connection is being closed
    failed: bool = False  # counted in pushes_failed already


class _Served:
    """A push the core serves (its want taken by the core, csrc/agent/block_pull.h), as a push's
    handle: over once the core posted its end (_on_served)."""

    def __init__(self, push: int):
        self.push, self.over, self.error = push, False, ""

    def done(self) -> bool:
        return self.over

    def wait(self, timeout: float = 0.0) -> None:
        if self.error:
            raise MeshError(self.error)


@dataclass
class _Held:
    blocks: Groups  # per KV cache group (groups.py)
    deadline: float
    ids: object = None  # the blocks as an int64 tensor per group, made at hold time (the source half of each push)
    pushes: List[_Push] = field(default_factory=list)
    release_when_idle: str = ""  # why, once the pushes in flight are over
    abandoned_peer: str = ""
    parts: int = 1  # decode ranks that read these blocks (another TP size there, or replicated heads)
    acked: Set[str] = field(default_factory=set)  # the decode agents that acknowledged theirs
    offers: List[int] = field(default_factory=list)  # its tokens at the puller, which serves its wants (the
    # last one offered now; earlier ones of the same request id held again, whose pushes may still run)


@dataclass
class _Fetch:
    tag: str
    peer_metadata: bytes
    remote_req: str
    src: Groups  # per KV cache group (groups.py)
    dst: Groups
    deadline: float
    conn: object = None
    peer: str = ""
    cancelled: bool = False
    started: float = 0.0
    part: Tuple[int, ...] = WHOLE
    readers: int = 0
    hold_until: float = 0.0  # the prefill's wall clock: its hold lasts until then (0: not known)
    reading: bool = False  # a pull's read is in flight: only its outcome reports the fetch (_take_pulls)
    token: int = 0  # at the puller: the pull's read, or the push's D awaited (0: none)
    nonce: int = 0  # its want's ``n``, which the prefill's answer echoes (_on_answer)
    over: bool = False  # reported (_forget): a second report of it is dropped


def _incarnation(conn) -> str:
    try:
        return conn.peer_incarnation
    except Exception:  # noqa: BLE001
        return ""


def _same_connection(a, b) -> bool:
    if a is b:
        return True
    try:
        return a is not None and b is not None and a.peer_incarnation == b.peer_incarnation
    except Exception:  # noqa: BLE001
        return False


def _answer_to(want: dict) -> dict:
    """The fields that name a want in its answer (D / F): its tag, and its nonce where it carried
    one (a decode of before the nonce sends none)."""
    named = {"tag": str(want.get("tag", ""))}
    if "n" in want:
        named["n"] = want["n"]
    return named


def _remember(seen: "OrderedDict", key, value) -> None:
    """Keeps key -> value in ``seen``, the oldest forgotten past FORGET_AFTER entries."""
    seen[key] = value
    while len(seen) > FORGET_AFTER:
        seen.popitem(last=False)
