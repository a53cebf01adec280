"""The scheduler side of FlagcxMeshConnector (vLLM 0.33): which requests a prefill holds for a
decode, which a decode fetches, and the metadata that tells the workers.

Prefill (``kv_transfer_params`` with ``do_remote_decode``): ``request_finished`` keeps the
request's blocks (delay free) and answers the parameters a decode needs: this engine's worker
agents (their metadata, one per tensor-parallel rank, learned from the workers' handshake
metadata at start), the request id, its block ids and, where ``pull`` is on, until when (this
host's wall clock) its blocks are held at least (``remote_hold_until``) and a MAC of all of these
keyed by the agents' secret (``remote_pull_mac``): a decode reads the blocks itself (transfer.py)
only on a hold whose MAC it checked, so params made up or altered on the way (other block ids,
another request, a later hold) are pushed, the prefill judging them. Decode (``do_remote_prefill``): the
prompt's tokens beyond the local prefix-cache hit are "matched" and loaded asynchronously;
``update_state_after_alloc`` records the blocks allocated for them, and the next
``build_connector_meta`` tells the workers to fetch.

With several KV cache groups (vLLM's hybrid memory allocator: ``request_finished_all_groups``),
block ids go per group (groups.py): a sliding-window group's only those still in its window.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import time
from typing import Any, Dict, List, Optional, Tuple

from vllm.v1.request import RequestStatus

from . import groups as kv_groups
from . import protocol

log = logging.getLogger("vllm.flagcx_mesh")

TRANSFER_NAME = "flagcx_mesh-push"


class SchedulerSide:
    def __init__(self, vllm_config, engine_id: str, metadata_cls, kv_cache_config=None, hold_timeout: float = 120.0,
                 pull_secret: bytes = b""):
        self.engine_id = engine_id
        self.hold_timeout = float(hold_timeout)  # the workers' (a hold starts after request_finished)
        self._pull_secret = pull_secret  # the agents' secret where pull is on (else b"": every request pushed)
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._metadata_cls = metadata_cls
        self.agents: Dict[int, bytes] = {}  # tp rank -> worker agent metadata
        self._to_hold: Dict[str, List[int]] = {}
        self._to_fetch: Dict[str, dict] = {}
        self._to_cancel: set = set()
        self._to_release: List[Tuple[List[str], str]] = []
        self._fetching: set = set()  # decode requests whose fetch went to the workers
        self._held: set = set()  # prefill requests whose blocks the workers hold
        self._refused: set = set()  # decode requests computed here: another block size or KV cache groups
        self._all_groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        self.windows = window_sizes(kv_cache_config, self.block_size)  # per transfer group (groups.py)
        self._select = kv_cache_config.select_transfer_block_ids if self._all_groups > 1 else tuple

    # ---- set-up -------------------------------------------------------------------------

    def set_agents(self, by_rank: Dict[int, Any]) -> None:
        for rank, hs in by_rank.items():
            self.agents[int(rank)] = bytes(hs.agent_metadata)

    def _agent_list(self) -> Optional[List[str]]:
        if sorted(self.agents) != list(range(self.tp_size)):
            return None
        return [protocol.b64(self.agents[r]) for r in range(self.tp_size)]

    # ---- decode side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and self._same_block_size(request.request_id, params) \
                and self._same_groups(request.request_id, params):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def _same_block_size(self, req_id: str, params: dict) -> bool:
        """Whether the prefill's block size (its kv_transfer_params) is this engine's; when not, the
        request is computed here (its prefill told to release the blocks) and the error says both."""
        theirs = params.get("block_size", self.block_size)
        if theirs == self.block_size:
            return True
        if req_id not in self._refused:
            self._refused.add(req_id)
            log.error("FlagcxMeshConnector: %s was prefilled with block_size %s, this decode runs block_size %d; "
                      "its KV is not fetched (computed here). Start both with the same --block-size.",
                      req_id, theirs, self.block_size)
        return False

    def _same_groups(self, req_id: str, params: dict) -> bool:
        """Whether the prefill's block ids come in as many KV cache groups as this engine's; when
        not, the request is computed here (as for another block size)."""
        try:
            theirs = len(kv_groups.as_groups(params.get("remote_block_ids") or []))
        except (TypeError, ValueError):
            theirs = -1
        if theirs == len(self.windows):
            return True
        if req_id not in self._refused:
            self._refused.add(req_id)
            log.error("FlagcxMeshConnector: %s was prefilled with %s KV cache groups, this decode has %d; "
                      "its KV is not fetched (computed here). Start both with the same model and settings.",
                      req_id, theirs if theirs >= 0 else "malformed", len(self.windows))
        return False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # a second call (after the load) is not a new fetch
        self._refused.discard(request.request_id)
        remote = self._remote(params)
        if remote is None:
            return
        agents, remote_req, remote_blocks = remote
        if num_external_tokens <= 0:  # everything was in the local prefix cache
            self._to_release.append((agents, remote_req))
            return
        if self._all_groups == 1:
            local = list(blocks.get_unhashed_block_ids())
        else:  # per group; a sliding-window group's tail, as many blocks as the prefill sends
            mine = kv_groups.clip_to_windows(list(self._select(blocks.get_unhashed_block_ids_all_groups())),
                                             self.windows)
            local = kv_groups.to_wire(kv_groups.pair_with_remote(mine, kv_groups.as_groups(remote_blocks),
                                                                 self.windows))
        self._to_fetch[request.request_id] = dict(local=local, remote_req=remote_req,
                                                  remote_blocks=remote_blocks, agents=agents,
                                                  hold_until=self._trusted_hold(params))
        self._fetching.add(request.request_id)

    @staticmethod
    def _remote(params: dict) -> Optional[Tuple[List[str], str, list]]:
        try:
            return (list(params["remote_agents"]), str(params["remote_request_id"]),
                    kv_groups.to_wire(kv_groups.as_groups(params["remote_block_ids"])))
        except (KeyError, TypeError, ValueError) as e:
            log.error("kv_transfer_params without a usable prefill (%s): %s", e, params)
            return None

    def _trusted_hold(self, params: dict) -> float:
        """The prefill's hold, where pull is on and its MAC is the one this secret makes (0: pushed)."""
        hold = self._hold_until(params)
        if not self._pull_secret or not hold:
            return 0.0
        mac = params.get("remote_pull_mac")
        if isinstance(mac, str) and hmac.compare_digest(mac, pull_mac(self._pull_secret, params)):
            return hold
        log.warning("kv_transfer_params of %s: remote_hold_until without a valid remote_pull_mac (another "
                    "secret, or params altered on the way): its blocks are pushed", str(params.get("remote_request_id"))[:200])
        return 0.0

    @staticmethod
    def _hold_until(params: dict) -> float:
        """The prefill's ``remote_hold_until`` (0 when absent or not a finite number: its blocks are pushed)."""
        v = params.get("remote_hold_until")
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return float(v) if ok else 0.0

    # ---- both ---------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output):
        meta = self._metadata_cls()
        meta.to_hold, self._to_hold = self._to_hold, {}
        meta.to_fetch, self._to_fetch = self._to_fetch, {}
        meta.to_cancel, self._to_cancel = self._to_cancel, set()
        meta.to_release, self._to_release = self._to_release, []
        return meta

    def request_finished(self, request, block_ids) -> Tuple[bool, Optional[dict]]:
        """``block_ids``: a list (one KV cache group) or one list per group (HMA)."""
        params = request.kv_transfer_params
        if not params:
            return False, None
        req_id = request.request_id
        if params.get("do_remote_prefill"):  # a decode request that ended before its blocks came
            remote = self._remote(params)
            if remote is not None:
                self._to_release.append(remote[:2])
            return False, None
        if req_id in self._fetching:
            self._fetching.discard(req_id)
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._to_cancel.add(req_id)  # vLLM keeps its blocks until the workers report it
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted or failed: nothing for a decode to take
        agents = self._agent_list()
        block_ids = self._offered_blocks(block_ids)
        if agents is None or not any(block_ids):
            if agents is None:
                log.error("FlagcxMeshConnector: the workers' agents are not known (tp ranks %s of %d);"
                          " %s is not offered to a decode", sorted(self.agents), self.tp_size, req_id)
            return False, None
        self._to_hold[req_id] = kv_groups.to_wire(block_ids)
        self._held.add(req_id)
        out = dict(
            do_remote_prefill=True, do_remote_decode=False, remote_request_id=req_id,
            remote_block_ids=kv_groups.to_wire(block_ids), remote_engine_id=self.engine_id, remote_agents=agents,
            tp_size=self.tp_size, block_size=self.block_size, transfer=TRANSFER_NAME)
        if self._pull_secret:
            out["remote_hold_until"] = time.time() + self.hold_timeout
            out["remote_pull_mac"] = pull_mac(self._pull_secret, out)
        return True, out

    def _offered_blocks(self, block_ids) -> kv_groups.Groups:
        """A finished prefill's blocks per transfer group, each sliding-window group's clipped to
        its window."""
        g = kv_groups.as_groups(block_ids)
        if self._all_groups == 1:
            return g
        return kv_groups.clip_to_windows(list(self._select(g)), self.windows)

    def update_connector_output(self, output) -> None:
        for req_id in output.finished_sending or ():
            self._held.discard(req_id)

    def has_pending_push_work(self) -> bool:
        return bool(self._held or self._to_hold or self._to_fetch or self._to_cancel or self._to_release)


def window_sizes(kv_cache_config, block_size: int) -> List[int]:
    """Blocks each transfer group moves (groups.window_blocks: 0 for a group that keeps every
    block); one group (0) without a kv_cache_config or with one group. ValueError for a group of
    several that is neither full attention nor a sliding window (a Mamba state, chunked local
    attention, ...): its blocks do not line up with the prompt's positions as these do."""
    if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) == 1:
        return [0]
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    out = []
    for i, g in enumerate(kv_cache_config.transfer_groups):
        spec = g.kv_cache_spec
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
            raise ValueError(f"FlagcxMeshConnector: KV cache group {i} ({', '.join(g.layer_names[:2])}, ...) is "
                             f"{type(spec).__name__}: with several groups only full-attention and sliding-window "
                             "groups can be moved")
        out.append(kv_groups.window_blocks(spec.sliding_window, spec.block_size)
                   if isinstance(spec, SlidingWindowSpec) else 0)
    return out


def pull_mac(secret: bytes, params: dict) -> str:
    """HMAC-SHA256, keyed by the agents' secret, of what a decode's read of a request's blocks
    rests on: the prefill engine, its request id, block ids, agents and hold (as JSON: the
    params travel as JSON, which gives these values back exactly). Missing fields MAC as null."""
    fields = [params.get(k) for k in ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_agents",
                                      "remote_hold_until")]
    msg = json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()
    return hmac.new(secret, b"flagcx_mesh pull v1\0" + msg, hashlib.sha256).hexdigest()
