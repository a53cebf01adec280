#!/usr/bin/env bash
# One prefill and one decode vLLM server with FlagcxMeshConnector, and the proxy in front:
#   bash examples/vllm/run_pd.sh [MODEL]        (default Qwen/Qwen2.5-0.5B-Instruct)
# then:
#   curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"model": "MODEL", "prompt": "The capital of France is", "max_tokens": 16}'
# Needs 2 GPUs (PREFILL_GPU, DECODE_GPU; the same one twice works with a lower
# GPU_MEMORY_UTILIZATION), vLLM 0.33.0 and flagcx_mesh (pip install .[vllm]) in this Python, and
# an agent that registers device memory (docs/vllm.md, "Status"). TP: TP_SIZE (equal on both).
# Ctrl-C stops all three. Each server's output goes to LOG_DIR (default: a new temporary folder)
# and is shown here; a server that exits before it is up, or is not up within STARTUP_TIMEOUT
# seconds (default 900), stops the script with the tail of its log.
set -euo pipefail
MODEL=${1:-Qwen/Qwen2.5-0.5B-Instruct}
PREFILL_GPU=${PREFILL_GPU:-0}
DECODE_GPU=${DECODE_GPU:-1}
TP_SIZE=${TP_SIZE:-1}
MEM=${GPU_MEMORY_UTILIZATION:-0.8}
PREFILL_PORT=${PREFILL_PORT:-8100}
DECODE_PORT=${DECODE_PORT:-8200}
PROXY_PORT=${PROXY_PORT:-8000}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-900}
LOG_DIR=${LOG_DIR:-$(mktemp -d -t flagcx-mesh-pd.XXXXXX)}
mkdir -p "$LOG_DIR"
# both engines' agents prove this secret to each other; keep it out of shell history in production
export FLAGCX_MESH_AGENT_SECRET=${FLAGCX_MESH_AGENT_SECRET:-$(python3 -c 'import os; print(os.urandom(16).hex())')}
# the interface the agents listen on (the mesh's choice when unset): export FLAGCX_MESH_IFNAME=eth0

kv_config() {  # kv_config ROLE
    printf '{"kv_connector":"FlagcxMeshConnector","kv_connector_module_path":"flagcx_mesh.vllm","kv_role":"%s","kv_connector_extra_config":{"hold_timeout":120,"fetch_timeout":120}}' "$1"
}

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait; }
trap cleanup EXIT INT TERM

serve() {  # serve NAME KV_ROLE GPU PORT: a vllm server in the background, its output in LOG_DIR/NAME.log too
    CUDA_VISIBLE_DEVICES=$3 vllm serve "$MODEL" --port "$4" --tensor-parallel-size "$TP_SIZE" \
        --gpu-memory-utilization "$MEM" --kv-transfer-config "$(kv_config "$2")" > "$LOG_DIR/$1.log" 2>&1 &
    pids+=($!)
}
fail_with_log() {  # fail_with_log NAME WHY: the end of NAME's log, then exit 1
    echo "run_pd.sh: the $1 server $2; the end of $LOG_DIR/$1.log:" >&2
    tail -n 30 "$LOG_DIR/$1.log" >&2
    exit 1
}
wait_up() {  # wait_up NAME:PID:PORT...: until each /health answers; fails fast when a server is gone
    local deadline=$((SECONDS + STARTUP_TIMEOUT)) left=("$@") server name pid port
    while [ ${#left[@]} -gt 0 ]; do
        # past the deadline or not: decided once a round, so that the first server not up is named
        # (the clock read per server named the decode when it ticked over after the prefill's check)
        local still=() late=$((SECONDS >= deadline))
        for server in "${left[@]}"; do
            IFS=: read -r name pid port <<< "$server"
            curl -sf "localhost:$port/health" >/dev/null && continue
            kill -0 "$pid" 2>/dev/null || fail_with_log "$name" "exited before it was up"
            [ "$late" -eq 0 ] || fail_with_log "$name" "was not up on :$port within ${STARTUP_TIMEOUT} s"
            still+=("$server")
        done
        left=("${still[@]}")
        [ ${#left[@]} -eq 0 ] || sleep 1
    done
}
serve prefill kv_producer "$PREFILL_GPU" "$PREFILL_PORT"
serve decode kv_consumer "$DECODE_GPU" "$DECODE_PORT"
echo "the servers' output: $LOG_DIR/prefill.log and $LOG_DIR/decode.log (shown below as it comes)"
tail -n +1 -F "$LOG_DIR/prefill.log" "$LOG_DIR/decode.log" 2>/dev/null &
pids+=($!)
wait_up "prefill:${pids[0]}:$PREFILL_PORT" "decode:${pids[1]}:$DECODE_PORT"
echo "prefill on :$PREFILL_PORT and decode on :$DECODE_PORT are up; proxy on :$PROXY_PORT"
python3 "$(dirname "$0")/proxy.py" --port "$PROXY_PORT" \
    --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT" &
pids+=($!)
wait
