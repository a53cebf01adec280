"""FlagcxMeshConnector: a vLLM 0.33 KV connector (``KVConnectorBase_V1``) whose prefill pushes
KV blocks into the decode's KV cache over flagcx_mesh agents (docs/vllm.md).

The scheduler side is scheduler.py; the worker side here drives one
:class:`flagcx_mesh.vllm.transfer.KVTransfer` per worker. Settings, in
``kv_connector_extra_config``:

- ``secret``: what every agent proves (default: ``FLAGCX_MESH_AGENT_SECRET``; one is required),
- ``hold_timeout``: seconds a prefill keeps a finished request's blocks for a decode (120),
- ``fetch_timeout``: seconds a decode waits for its blocks before reporting a load error (120),
- ``push_timeout``: seconds a prefill's push may take before it is abandoned and its blocks
  released (60; never later than ``hold_timeout``),
- ``connect_timeout``: seconds to reach a prefill's agent (10),
- ``pull``: whether a decode reads a request's blocks itself where it can (transfer.py: on this
  host's paths, the prefill's layout known, its hold lasting and MAC-checked; false: the prefill
  pushes every request; on both prefill and decode),
- ``agent_name``: the prefix of the agents' names (``vllm``; a worker's agent is
  ``<prefix>-<engine_id>-tp<rank>``),
- ``listen_ports``: ``"P"`` or ``"P-Q"``, the ports the workers' agents listen on (each takes the
  first free one; default: any free port; ``FLAGCX_MESH_AGENT_PORTS``, where set, wins).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from . import groups as kv_groups
from . import protocol
from .heads import prefill_sources, ranks_to_release, readers
from .scheduler import SchedulerSide
from .stats import FlagcxMeshKVConnectorStats, FlagcxMeshPromMetrics, counter_changes
from .transfer import KVTransfer

log = logging.getLogger("vllm.flagcx_mesh")

__all__ = ["FlagcxMeshConnector", "FlagcxMeshConnectorMetadata", "FlagcxMeshHandshake"]

# kv_connector_extra_config keys this connector reads (others are warned about: a typo must not pass silently)
KNOWN_KEYS = ("secret", "hold_timeout", "fetch_timeout", "push_timeout", "connect_timeout", "agent_name",
              "listen_ports", "pull")


def _flag(v) -> bool:
    """A setting's truth: booleans, numbers, and the strings a command line gives (true / false,
    1 / 0, yes / no, on / off); anything else is false, with a warning."""
    if isinstance(v, str):
        word = v.strip().lower()
        if word in ("true", "1", "yes", "on", "false", "0", "no", "off", ""):
            return word in ("true", "1", "yes", "on")
        log.warning("FlagcxMeshConnector: %r is not true or false; taken as false", v)
        return False
    return bool(v)


def warn_unknown_keys(extra: dict) -> None:
    for key in sorted(set(extra) - set(KNOWN_KEYS)):
        log.warning("FlagcxMeshConnector: kv_connector_extra_config key %r is not known (ignored); "
                    "known keys: %s", key, ", ".join(KNOWN_KEYS))


class FlagcxMeshConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers each step: blocks to hold for a decode
    (prefill), blocks to fetch, fetches to cancel, prefills to release (decode)."""

    def __init__(self):
        self.to_hold: dict = {}      # request id -> block ids (a list, or one per KV cache group)
        self.to_fetch: dict = {}     # request id -> {local, remote_req, remote_blocks, agents}
        self.to_cancel: set = set()  # request ids
        self.to_release: list = []   # (agents, remote request id)


@dataclass
class FlagcxMeshHandshake(KVConnectorHandshakeMetadata):
    """A worker's agent, handed to the scheduler at start (``get_handshake_metadata``)."""

    agent_metadata: bytes
    tp_rank: int
    tp_size: int


def tp_rank_of_this_worker(vllm_config) -> int:
    """This worker's tensor-parallel rank (0 when tensor parallelism is off)."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def kv_heads_of(vllm_config) -> Optional[int]:
    """The model's KV heads as its KV cache holds them (heads.py): 1 for MLA (one latent, on
    every rank); None where the config does not say."""
    try:
        if vllm_config.model_config.use_mla:
            return 1
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except Exception:  # noqa: BLE001 - no model config (a test's), or one that cannot tell
        return None


def layer_groups(kv_caches: dict, kv_cache_config) -> Tuple[dict, dict]:
    """(the layers to register, {layer: its KV cache group}): with several groups (HMA) the
    layers of the transfer groups, each with its group's index among them; else every layer, group 0."""
    if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) == 1:
        return kv_caches, {}
    index = kv_cache_config.transfer_group_index_by_layer
    return {n: t for n, t in kv_caches.items() if n in index}, {n: index[n] for n in kv_caches if n in index}


class FlagcxMeshConnector(KVConnectorBase_V1, SupportsHMA):
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        return False  # the agents hold the KV buffers registered; sleep mode would free them

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        self.engine_id = str(cfg.engine_id)
        self._extra = cfg.kv_connector_extra_config or {}
        self._scheduler: Optional[SchedulerSide] = None
        self._transfer: Optional[KVTransfer] = None
        self._load_errors: set = set()
        self._unfetchable: dict = {}  # request id -> local block ids it can never receive
        self._stats_reported: dict = {}  # the transfer's counters at the last get_kv_connector_stats
        self._parts: dict = {}  # request id -> the tags of its fetches still out (from several prefill ranks)
        self._part_of: dict = {}  # such a fetch's tag -> its request id
        self._secret = self._extra.get("secret") or os.environ.get("FLAGCX_MESH_AGENT_SECRET")
        self._pull = _flag(self._extra.get("pull", False))
        if role == KVConnectorRole.SCHEDULER:
            warn_unknown_keys(self._extra)
            self._scheduler = SchedulerSide(vllm_config, self.engine_id, FlagcxMeshConnectorMetadata,
                                            kv_cache_config, hold_timeout=self._setting("hold_timeout", 120),
                                            pull_secret=str(self._secret or "").encode() if self._pull else b"")
        else:
            self.tp_size = vllm_config.parallel_config.tensor_parallel_size
            self.tp_rank = tp_rank_of_this_worker(vllm_config)
            self.kv_heads = kv_heads_of(vllm_config)
            if not self._secret:
                raise ValueError("FlagcxMeshConnector: set FLAGCX_MESH_AGENT_SECRET (or "
                                 "kv_connector_extra_config.secret) to the same secret on prefill and decode")

    def _setting(self, key: str, default: float) -> float:
        return float(self._extra.get(key, default))

    # ---- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        if self._transfer is not None:
            return
        prefix = str(self._extra.get("agent_name", "vllm"))
        if self._extra.get("listen_ports") and not os.environ.get("FLAGCX_MESH_AGENT_PORTS"):
            os.environ["FLAGCX_MESH_AGENT_PORTS"] = str(self._extra["listen_ports"])  # read by the agent
        kv_caches, groups = layer_groups(kv_caches, self._kv_cache_config)
        self._transfer = KVTransfer(
            f"{prefix}-{self.engine_id}-tp{self.tp_rank}", kv_caches, self._kv_cache_config.num_blocks,
            secret=self._secret, hold_timeout=self._setting("hold_timeout", 120),
            fetch_timeout=self._setting("fetch_timeout", 120), push_timeout=self._setting("push_timeout", 60),
            connect_timeout=self._setting("connect_timeout", 10), layer_groups=groups,
            pull=self._pull)
        log.info("FlagcxMeshConnector: agent %s registered %d layers", self._transfer.name, len(kv_caches))

    def get_handshake_metadata(self) -> Optional[FlagcxMeshHandshake]:
        if self._transfer is None:
            return None
        return FlagcxMeshHandshake(self._transfer.metadata, self.tp_rank, self.tp_size)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        t = self._transfer
        assert isinstance(meta, FlagcxMeshConnectorMetadata) and t is not None
        for req_id, blocks in meta.to_hold.items():
            t.hold(req_id, blocks)
        for req_id, f in meta.to_fetch.items():
            self._fetch(t, req_id, f)
        for req_id in meta.to_cancel:
            for tag in self._parts.get(req_id, (req_id,)):
                t.cancel(tag)
        for agents, remote_req in meta.to_release:
            try:
                ranks = self._ranks_to_tell(len(agents))
            except ValueError:
                continue
            for rank in ranks:
                t.release(protocol.unb64(agents[rank]), remote_req)

    def _ranks_to_tell(self, prefill_tp: int) -> list:
        """The prefill ranks this rank tells to release a request it does not fetch: those it
        reads from and those no decode rank reads from that fall to it (heads.py)."""
        sources = prefill_sources(self.tp_rank, self.tp_size, prefill_tp, self.kv_heads)
        return [rank for rank, _ in sources] + ranks_to_release(self.tp_rank, self.tp_size, prefill_tp, self.kv_heads)

    def _fetch(self, t: KVTransfer, req_id: str, f: dict) -> None:
        """One fetch per prefill rank this rank takes heads from (several: tagged req#part<j>);
        the prefill ranks no decode rank reads from (replicated heads) are told to release."""
        agents = f["agents"]
        try:
            sources = prefill_sources(self.tp_rank, self.tp_size, len(agents), self.kv_heads)
            unread = ranks_to_release(self.tp_rank, self.tp_size, len(agents), self.kv_heads)
        except ValueError as e:
            log.error("FlagcxMeshConnector: %s: %s; its blocks are load errors", req_id, e)
            self._unfetchable[req_id] = kv_groups.flat(kv_groups.as_groups(f["local"]))
            return
        tags = [req_id] if len(sources) == 1 else [f"{req_id}#part{j}" for j in range(len(sources))]
        if len(sources) > 1:
            self._parts[req_id] = set(tags)
            self._part_of.update((tag, req_id) for tag in tags)
        for tag, (rank, part) in zip(tags, sources):
            n = readers(rank, self.tp_size, len(agents), self.kv_heads)
            t.fetch(tag, protocol.unb64(agents[rank]), f["remote_req"], f["remote_blocks"], f["local"], part,
                    readers=n if n != part[1] else 0, hold_until=f.get("hold_until", 0.0))
        for rank in unread:
            t.release(protocol.unb64(agents[rank]), f["remote_req"])

    def _whole_requests(self, tags) -> set:
        """The requests whose every fetch (each part) has now been reported."""
        out = set()
        for tag in tags:
            req_id = self._part_of.pop(tag, None)
            if req_id is None:
                out.add(tag)
                continue
            left = self._parts[req_id]
            left.discard(tag)
            if not left:
                del self._parts[req_id]
                out.add(req_id)
        return out

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete between steps (the request waits in WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # the prefill pushes finished requests; nothing is saved during the forward

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set):
        if self._transfer is None:
            return None, None
        done = self._transfer.poll()
        recving = self._whole_requests(done.recving)
        for req_id, blocks in done.failed.items():
            self._load_errors.update(blocks)
        for req_id, blocks in self._unfetchable.items():
            self._load_errors.update(blocks)
            recving.add(req_id)
        self._unfetchable.clear()
        return (done.sending or None), (recving or None)

    def get_kv_connector_stats(self) -> Optional[FlagcxMeshKVConnectorStats]:
        """The worker's counters' increase since its last call (vLLM sums the workers')."""
        if self._transfer is None:
            return None
        now = self._transfer.stats()
        changes = counter_changes(now, self._stats_reported)
        self._stats_reported = now
        return FlagcxMeshKVConnectorStats(data=changes) if changes else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> FlagcxMeshKVConnectorStats:
        return FlagcxMeshKVConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return FlagcxMeshPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._transfer is not None:
            self._transfer.close()
            self._transfer = None

    # ---- scheduler side -----------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        assert self._scheduler is not None
        self._scheduler.set_agents(metadata)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids):
        """SupportsHMA: the request's block ids per KV cache group (groups.py)."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()
