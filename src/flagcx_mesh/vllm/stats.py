"""FlagcxMeshConnector's counters through vLLM's KV connector stats: each worker hands the
change of its ``KVTransfer.stats()`` since its last step to vLLM (``get_kv_connector_stats``),
vLLM sums the workers' (``aggregate``), logs them with its periodic stats line (``reduce``) and
adds them to Prometheus counters ``vllm:flagcx_mesh_<counter>_total`` on /metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from .transfer import STATS

HELP = {
    "bad_messages": "notifications ignored (not a well-formed KV transfer message)",
    "unexpected_answers": "done / failed answers for a request not awaited from that peer",
    "refused": "requests a prefill refused to push (unknown, released, layout or block size mismatch)",
    "pushes": "pushes a prefill issued",
    "pushes_served": "of those, pushes its core served (the decode's want taken with no Python thread)",
    "pushes_done": "pushes that completed",
    "pushes_failed": "pushes that failed (the decode died or refused)",
    "pushes_abandoned": "pushes past their deadline, abandoned with their connection",
    "connections_abandoned": "connections a prefill closed to abandon pushes",
    "bytes_pushed": "bytes of KV blocks a prefill pushed",
    "push_seconds": "seconds the completed pushes took, summed",
    "released_served": "held requests released after a decode took them",
    "released_cancelled": "held requests released on a decode's cancel",
    "released_expired": "held requests released at the hold timeout (no decode took them)",
    "released_abandoned": "held requests released after their push was abandoned",
    "fetches_done": "requests whose KV blocks a decode received",
    "fetch_seconds": "seconds the received fetches took (asked to done), summed",
    "fetches_failed": "fetches reported to vLLM as load errors",
    "pulls": "requests whose KV blocks a decode read itself (no push asked for)",
    "bytes_pulled": "bytes of KV blocks a decode read itself",
}


def counter_changes(now: Dict[str, float], before: Dict[str, float]) -> Dict[str, float]:
    """The counters that changed since ``before``, by how much."""
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


@dataclass
class FlagcxMeshKVConnectorStats(KVConnectorStats):
    """``data``: counter name -> its increase over the interval (summed over workers)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> Dict[str, Any]:
        out = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.data.items() if v}
        if self.data.get("bytes_pushed") and self.data.get("push_seconds"):
            out["push MB/s"] = round(self.data["bytes_pushed"] / self.data["push_seconds"] / 2**20, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class FlagcxMeshPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per name of ``STATS``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for key in STATS:
            c = self._counter_cls(name=f"vllm:flagcx_mesh_{key}", labelnames=labelnames,
                                  documentation=f"FlagcxMeshConnector: {HELP.get(key, key)}")
            self.counters[key] = create_metric_per_engine(c, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine: Optional[dict] = self.counters.get(key)
            if per_engine is not None and value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
