#!/usr/bin/env bash
# One prefill and one decode vLLM server with FlagcxMeshConnector, and the proxy in front:
#   bash examples/vllm/run_pd.sh [MODEL]        (default Qwen/Qwen2.5-0.5B-Instruct)
# then:
#   curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"model": "MODEL", "prompt": "The capital of France is", "max_tokens": 16}'
# Needs 2 GPUs (PREFILL_GPU, DECODE_GPU; the same one twice works with a lower
# GPU_MEMORY_UTILIZATION), vLLM 0.33.0 and flagcx_mesh (pip install .[vllm]) in this Python, and
# an agent that registers device memory (docs/vllm.md, "Status"). TP: TP_SIZE (equal on both).
# Ctrl-C stops all three.
set -euo pipefail
MODEL=${1:-Qwen/Qwen2.5-0.5B-Instruct}
PREFILL_GPU=${PREFILL_GPU:-0}
DECODE_GPU=${DECODE_GPU:-1}
TP_SIZE=${TP_SIZE:-1}
MEM=${GPU_MEMORY_UTILIZATION:-0.8}
PREFILL_PORT=${PREFILL_PORT:-8100}
DECODE_PORT=${DECODE_PORT:-8200}
PROXY_PORT=${PROXY_PORT:-8000}
# both engines' agents prove this secret to each other; keep it out of shell history in production
export FLAGCX_MESH_AGENT_SECRET=${FLAGCX_MESH_AGENT_SECRET:-$(python3 -c 'import os; print(os.urandom(16).hex())')}
# the interface the agents listen on (the mesh's choice when unset): export FLAGCX_MESH_IFNAME=eth0

kv_config() {  # kv_config ROLE
    printf '{"kv_connector":"FlagcxMeshConnector","kv_connector_module_path":"flagcx_mesh.vllm","kv_role":"%s","kv_connector_extra_config":{"hold_timeout":120,"fetch_timeout":120}}' "$1"
}

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait; }
trap cleanup EXIT INT TERM

CUDA_VISIBLE_DEVICES=$PREFILL_GPU vllm serve "$MODEL" --port "$PREFILL_PORT" --tensor-parallel-size "$TP_SIZE" \
    --gpu-memory-utilization "$MEM" --kv-transfer-config "$(kv_config kv_producer)" &
pids+=($!)
CUDA_VISIBLE_DEVICES=$DECODE_GPU vllm serve "$MODEL" --port "$DECODE_PORT" --tensor-parallel-size "$TP_SIZE" \
    --gpu-memory-utilization "$MEM" --kv-transfer-config "$(kv_config kv_consumer)" &
pids+=($!)

for port in "$PREFILL_PORT" "$DECODE_PORT"; do
    until curl -sf "localhost:$port/health" >/dev/null; do sleep 2; done
done
echo "prefill on :$PREFILL_PORT and decode on :$DECODE_PORT are up; proxy on :$PROXY_PORT"
python3 "$(dirname "$0")/proxy.py" --port "$PROXY_PORT" \
    --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT" &
pids+=($!)
wait
