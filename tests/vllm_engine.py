"""A vLLM 0.33 engine on a CPU for the connector's tests: vLLM's real Scheduler with
FlagcxMeshConnector loaded by vLLM's factory (kv_connector_module_path), one worker-role
connector per tensor-parallel rank with KV caches as CPU tensors in vLLM's layout, and a
stand-in for the model step that writes deterministic KV into every block a prefill computes.

Each KV head of a block holds bytes that depend on the prompt's tokens up to the block's end, the
head (its index in the model: rank r of tp holds heads r * kv_heads / tp and up, or where tp is
larger than kv_heads the one head r // (tp / kv_heads), replicated), the layer and
the block's position in the request (not on block ids, which differ between prefill and
decode), so a decode can check every byte it received (``check``), whatever the tensor-parallel
size of each side.

``window``: a hybrid model (vLLM's hybrid memory allocator): layers 0, 2, ... attend fully (KV
cache group 0), layers 1, 3, ... over a sliding window of ``window`` tokens (group 1), each pair
sharing one KV cache tensor as vLLM lays them out; ``check`` then checks a sliding-window layer's
blocks in the window.
"""

import hashlib
import json
import os

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

import flagcx_mesh.vllm.connector as fxm_connector
from vllm_kv import fill_head, head_matches, make_kv_caches

BLOCK = 16
KV_HEADS, HEAD_SIZE = 4, 16  # the model's; each of tp ranks holds KV_HEADS / tp
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
              "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-5, "torch_dtype": "float16"}


def model_dir(d, kv_heads=KV_HEADS):
    path = os.path.join(d, f"tiny-llama-{kv_heads}kv")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(TINY_LLAMA, num_key_value_heads=kv_heads), f)
    return path


def first_head(rank, tp, kv_heads):
    """The model's index of rank ``rank``'s first KV head (vLLM's split, replicated heads included)."""
    return rank * kv_heads // tp if tp <= kv_heads else rank // (tp // kv_heads)


def prompt_of(i: int, length: int) -> list:
    return [(i * 31 + k * 7) % 250 + 1 for k in range(length)]


def seed(prompt, head, layer, pos) -> str:
    """A block's KV depends on the tokens up to its end (as a model's does), so prompts that
    share a prefix share those blocks' contents (and prefix-cache hits hold the right bytes)."""
    key = hashlib.blake2b(bytes(prompt[:(pos + 1) * BLOCK]), digest_size=8).hexdigest()
    return f"{key}/{head}/{layer}/{pos}"


class Engine:
    """One engine: ``role`` kv_producer / kv_consumer / kv_both; ``writes``: whether the
    model stand-in writes KV (a prefill's does, a decode's does not, so that nothing but the
    connector fills its blocks)."""

    def __init__(self, workdir, role, engine_id, *, tp=1, num_blocks=96, layers=2, writes=None,
                 extra=None, failure_policy="recompute", kv_heads=KV_HEADS, window=0):
        mc = ModelConfig(model=model_dir(workdir, kv_heads), tokenizer=None, skip_tokenizer_init=True, dtype="float16",
                         max_model_len=256, seed=0)
        sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=256,
                             is_encoder_decoder=False)
        cc = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto")
        cc.num_gpu_blocks = num_blocks
        kvt = KVTransferConfig(kv_connector="FlagcxMeshConnector", kv_connector_module_path="flagcx_mesh.vllm",
                               kv_role=role, engine_id=engine_id, kv_buffer_device="cpu",
                               kv_load_failure_policy=failure_policy, kv_connector_extra_config=dict(extra or {}))
        self.config = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, kv_transfer_config=kvt,
                                 device_config=DeviceConfig("cpu"))
        self.config.parallel_config.tensor_parallel_size = tp
        if window:  # a platform without the hybrid allocator (a CPU) made vLLM turn it off; a GPU keeps it
            self.config.scheduler_config.disable_hybrid_kv_cache_manager = False
        self.tp, self.kv_heads, self.window = tp, kv_heads, window
        self.heads = max(1, kv_heads // tp)  # per rank
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=self.heads, head_size=HEAD_SIZE, dtype=torch.float16)
        self.group_of = [i % 2 if window else 0 for i in range(layers)]  # each layer's KV cache group
        groups = [KVCacheGroupSpec(self.layer_names, spec)]
        if window:
            sw = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=self.heads, head_size=HEAD_SIZE,
                                   dtype=torch.float16, sliding_window=window)
            groups = [KVCacheGroupSpec(self.layer_names[0::2], spec), KVCacheGroupSpec(self.layer_names[1::2], sw)]
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.sched = Scheduler(self.config, self.kv_cache_config, StructuredOutputManager(self.config),
                               block_size=BLOCK, hash_block_size=BLOCK, log_stats=False)
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK, hash_fn)  # as EngineCore makes it
        self.writes = role == "kv_producer" if writes is None else writes
        self.workers, self.caches = [], []
        for rank in range(tp):
            fxm_connector.tp_rank_of_this_worker = lambda cfg, r=rank: r
            w = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
            kv, _ = make_kv_caches(self.layer_names, num_blocks, self.heads, BLOCK, HEAD_SIZE)
            if window:  # a sliding-window layer shares the tensor of the full-attention layer before it
                for a, b in zip(self.layer_names[0::2], self.layer_names[1::2]):
                    kv[b] = kv[a]
            w.register_kv_caches(kv)
            self.workers.append(w)
            self.caches.append(kv)
        self.sched.connector.set_xfer_handshake_metadata(
            {r: w.get_handshake_metadata() for r, w in enumerate(self.workers)})
        self.initial_free = self.free_blocks()
        self.prompts = {}
        self._pending = {"sending": {}, "recving": {}}
        self.first_scheduled = {}  # request id -> tokens scheduled the first time it ran
        self.invalid_blocks = set()
        self.released = set()  # requests whose blocks the workers released (finished sending)

    @property
    def connector(self):
        return self.sched.connector

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(self, req_id, prompt, max_tokens=1, params=None):
        self.prompts[req_id] = list(prompt)
        sp = SamplingParams(max_tokens=max_tokens,
                            extra_args=None if params is None else {"kv_transfer_params": dict(params)})
        self.sched.add_request(Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp,
                                       pooling_params=None, block_hasher=self.block_hasher))

    def abort(self, req_id):
        self.sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def status(self, req_id):
        r = self.sched.requests.get(req_id)
        return None if r is None else r.status

    def block_ids(self, req_id, group=0):
        return list(self.sched.kv_cache_manager.get_block_ids(req_id)[group])

    def _write_kv(self, req_id, start, count):
        """The model step: every block holding a position in [start, start+count) of the prompt
        (a sliding-window layer's: those vLLM still keeps, not its null block)."""
        prompt = self.prompts[req_id]
        end = min(start + count, len(prompt))
        for li, name in enumerate(self.layer_names):
            ids = self.block_ids(req_id, self.group_of[li])
            for pos in range(start // BLOCK, (end + BLOCK - 1) // BLOCK):
                for rank, kv in enumerate(self.caches):
                    for h in range(self.heads):
                        if ids[pos] != 0:
                            fill_head(kv[name], ids[pos], h, seed(prompt, self._head(rank, h), li, pos))

    def _head(self, rank, h):
        return first_head(rank, self.tp, self.kv_heads) + h

    def positions(self, req_id, layer):
        """The prompt's block positions a decode must have received for ``layer``: all of them, or
        for a sliding-window layer those holding the window of the last prompt token (which the
        decode computes itself)."""
        n = len(self.prompts[req_id])
        last = (n - 1) // BLOCK
        first = max(0, n - 1 - (self.window - 1)) // BLOCK if self.group_of[layer] else 0
        return range(first, last + 1)

    def check(self, req_id):
        """(blocks checked, [(rank, layer, position)] that differ) for a received request."""
        prompt = self.prompts[req_id]
        bad, n = [], 0
        for li, name in enumerate(self.layer_names):
            ids = self.block_ids(req_id, self.group_of[li])
            for pos in self.positions(req_id, li):
                for rank, kv in enumerate(self.caches):
                    n += 1
                    if ids[pos] == 0 or not all(
                            head_matches(kv[name], ids[pos], h, seed(prompt, self._head(rank, h), li, pos))
                            for h in range(self.heads)):
                        bad.append((rank, li, pos))
        return n, bad

    def _aggregate(self, kind, per_rank):
        """A request is done when every rank reported it (as vLLM's output aggregator does)."""
        done = set()
        counts = self._pending[kind]
        for ids in per_rank:
            for r in ids or ():
                counts[r] = counts.get(r, 0) + 1
                if counts[r] == self.tp:
                    done.add(r)
                    del counts[r]
        return done

    def step(self, on_scheduled=None):
        """One engine step; returns {request id: kv_transfer_params} of requests that finished.
        ``on_scheduled(engine, scheduler_output)`` runs after scheduling, before the workers."""
        out = self.sched.schedule()
        if on_scheduled is not None:
            on_scheduled(self, out)
        for req_id, n in out.num_scheduled_tokens.items():
            self.first_scheduled.setdefault(req_id, n)
            if self.writes:
                self._write_kv(req_id, self.sched.requests[req_id].num_computed_tokens - n, n)
        sending, recving, invalid = [], [], set()
        for w in self.workers:
            w.bind_connector_metadata(out.kv_connector_metadata)
            w.start_load_kv(None)
            w.wait_for_save()
            res = w.get_transfer_results(out.finished_req_ids)
            sending.append(res.finished_sending)
            recving.append(res.finished_recving)
            invalid |= w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
        self.invalid_blocks |= invalid
        released = self._aggregate("sending", sending)
        self.released |= released
        kco = KVConnectorOutput(finished_sending=released or None,
                                finished_recving=self._aggregate("recving", recving) or None,
                                invalid_block_ids=invalid)
        req_ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=[[7] for _ in req_ids], kv_connector_output=kco)
        finished = {}
        for eco in self.sched.update_from_output(out, mro).values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    finished[o.request_id] = o.kv_transfer_params
        return finished

    def idle(self) -> bool:
        return not self.sched.has_requests()

    def shutdown(self):
        for w in self.workers:
            w.shutdown()
