#!/usr/bin/env bash
# The GPU tests and benchmarks in one command, on a machine with an NVIDIA GPU and torch:
#   bash scripts/test-gpu.sh [LOG_DIR]        (default: $OUT, else ./gpu-logs)
# Installs the package from this tree (and builds the test doubles into build/test-doubles, outside
# the package, for the fake-driver tests), then runs tests/test_gpu.py (real GPU), the
# fake-driver tests, device memory over the ucx path (tests/ucx_device_prog.py, when a CUDA-enabled libucx is installed), 4 ranks of staged random traffic (its figures in staged-traffic-4.log), `bench put --device cuda`, `bench stream-wait`, `bench notify --device cuda`,
# the P2P engine form's connector sequence on CUDA tensors (tests/p2p_prog.py), agents with CUDA tensors between two
# processes (tests/agent_device_prog.py pair), stream waits on notifications (tests/agent_stream_wait_prog.py all), batched device copies (tests/agent_batch_prog.py all), the PD example and the vLLM connector's transfer part on the GPU, a write_blocks call's issue and wait (tests/write_blocks_probe.py); every
# log and the JSON figures go to LOG_DIR. Exit status: 0 only when every step passed.
set -u
cd "$(dirname "$0")/.."
logs=${1:-${OUT:-gpu-logs}}
mkdir -p "$logs"
py=${PYTHON:-python3}
status=0
step() {  # step NAME CMD...: runs CMD, logs to NAME.log, remembers a failure
  local name=$1; shift
  # FXM_GPU_STEPS: an extended regex of the step names to run (default: every step); install always runs
  if [ -n "${FXM_GPU_STEPS:-}" ] && [ "$name" != install ] && ! [[ $name =~ ^(${FXM_GPU_STEPS})$ ]]; then
    return 0
  fi
  echo "== $name: $*" | tee -a "$logs/summary.txt"
  local t0=$SECONDS
  if "$@" >"$logs/$name.log" 2>&1; then
    echo "   passed in $((SECONDS - t0)) s" | tee -a "$logs/summary.txt"
  else
    echo "   FAILED (exit $?) in $((SECONDS - t0)) s; tail of $name.log:" | tee -a "$logs/summary.txt"
    tail -n 40 "$logs/$name.log" | tee -a "$logs/summary.txt"
    status=1
  fi
}
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; uname -r; } >"$logs/machine.txt" 2>&1
step install "$py" -m pip install -q --no-deps --no-build-isolation -C cmake.define.FXM_TEST_DOUBLES=ON .
step gpu-tests "$py" -m pytest -q -p no:cacheprovider --timeout-method=thread tests/test_gpu.py tests/test_gpu_fake.py tests/test_agent_device_fake.py tests/test_agent_stream_wait_fake.py tests/test_agent_batch_fake.py tests/test_staged_batch_fake.py
step staged-traffic-4 env FLAGCX_MESH_CUDA_PATH=staged "$py" -m flagcx_mesh.launch -n 4 --timeout 900 -- \
  "$py" tests/staged_traffic_prog.py staged_traffic --device torch --max-size 8388608 --ops 200 --round-timeout 600
step bench-put-cuda "$py" -m flagcx_mesh.bench put --device cuda --json "$logs/bench-put-cuda.json" --plot "$logs/bench-put-cuda.png"
step bench-stream-wait "$py" -m flagcx_mesh.bench stream-wait --iters 2000 --json "$logs/bench-stream-wait.json"
step p2p-cuda "$py" tests/p2p_prog.py pair --device cuda --timeout 120
step agent-device "$py" tests/agent_device_prog.py pair --device torch --roles client,bad,self,waits --timeout 60
# stream waits on notifications on the GPU: each scenario (arrives, unread, peer, timeout on the legacy default
# stream, killed peer, closed agent) in its own bounded process; a copy queued behind the wait must land only
# once the wait was released, and each release's cause and time are printed ("<scenario> ok" per scenario)
step agent-stream-wait "$py" tests/agent_stream_wait_prog.py all "$logs" --device torch --timeout 30
step agent-batch "$py" tests/agent_batch_prog.py all --device torch --timeout 30
# batches of staged writes (one frame a call, gathered and scattered by the copy kernel): every byte;
# then staged reads of 8 B one at a time and 2000 in flight together (their us an op printed)
step agent-staged-blocks env FLAGCX_MESH_CUDA_PATH=staged FLAGCX_MESH_STAGED_CHUNK_BYTES=65536 \
  "$py" tests/agent_device_prog.py pair --device torch --roles blocks,blocks-host,reads-timed --timeout 60
step pd-example "$py" -m flagcx_mesh.launch -n 2 --timeout 240 -- "$py" examples/pd_kv_transfer.py --device cuda --rounds 3
# the vLLM connector's transfer part (no vLLM needed): CUDA KV caches in vLLM 0.33's layout, a
# prefill and a decode process on this GPU, every block checked (needs the agent's device memory)
# every device path: cuda-ipc (torch's cudaMalloc memory), staged (never read by the decode itself: --pull 0), and cuda-vmm (torch's expandable
# segments are cuMem memory); each run fails unless every push took the path named
vllm_kv=(--device cuda --layers 8 --blocks 512 --requests 24 --blocks-per-request 16 --heads 8 --head-size 128 --block-size 16)
step vllm-transfer-cuda timeout 300 "$py" tests/vllm_transfer_prog.py "${vllm_kv[@]}" --expect-path cuda-ipc
step vllm-transfer-cuda-staged env FLAGCX_MESH_CUDA_PATH=staged timeout 300 "$py" tests/vllm_transfer_prog.py \
  "${vllm_kv[@]}" --expect-path staged --pull 0
step vllm-transfer-cuda-vmm env FLAGCX_MESH_CUDA_PATH=cuda-vmm PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  timeout 300 "$py" tests/vllm_transfer_prog.py "${vllm_kv[@]}" --expect-path cuda-vmm
# the decode reading the requests after the first itself (a pull: cuda-ipc, cuda-vmm), every block checked
step vllm-transfer-cuda-pull timeout 300 "$py" tests/vllm_transfer_prog.py "${vllm_kv[@]}" --pull 23
step vllm-transfer-cuda-vmm-pull env FLAGCX_MESH_CUDA_PATH=cuda-vmm PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  timeout 300 "$py" tests/vllm_transfer_prog.py "${vllm_kv[@]}" --pull 23
step vllm-transfer-cuda-legacy timeout 300 "$py" tests/vllm_transfer_prog.py --device cuda --layout legacy \
  --layers 4 --blocks 128 --requests 8
# one request's KV (8B-model shape) through the connector's transfer part, beside a contiguous
# agent write of the same bytes, on every device path and on host memory
step bench-kv-cuda "$py" -m flagcx_mesh.bench kv --device cuda --json "$logs/bench-kv-cuda.json"
# the same requests, every one pushed by the prefill (the decode reads none itself): the pull's gain
step bench-kv-cuda-push "$py" -m flagcx_mesh.bench kv --device cuda --paths cuda-ipc,cuda-vmm --pull off \
  --peers none --json "$logs/bench-kv-cuda-push.json"
# the same request on a TP-4 rank (2 of the 8 KV heads): 4096 blocks of 16 KiB
step bench-kv-cuda-16k timeout 600 "$py" -m flagcx_mesh.bench kv --device cuda --heads 2 --tokens 2048 \
  --json "$logs/bench-kv-cuda-16k.json"
# one call of a request's blocks split in its issue and its wait (with and without a notification;
# 64 KiB, 16 KiB and 16-byte blocks), and notify alone: where the push's time goes
step write-blocks-probe "$py" tests/write_blocks_probe.py --device cuda
# where the 2k-token request's time goes around the push, step by step (bench kv --steps: both processes stamp)
step bench-kv-cuda-steps "$py" -m flagcx_mesh.bench kv --device cuda --paths cuda-ipc --tokens 2048 --reps 9 \
  --peers none --steps --json "$logs/bench-kv-cuda-steps.json"
step bench-kv-host "$py" -m flagcx_mesh.bench kv --device cpu --json "$logs/bench-kv-host.json"
# agents on GPU memory per device path, beside Mooncake TE and NIXL where their CUDA wheels are
# importable (PYTHONPATH); a peer that is not is printed NOT RUN with its reason
step bench-agent-cuda "$py" -m flagcx_mesh.bench agent --device cuda --bytes 1G --json "$logs/bench-agent-cuda.json"
step bench-agent-cuda-batch-off env FLAGCX_MESH_CUDA_BATCH_COPY=off "$py" -m flagcx_mesh.bench agent --device cuda \
  --bytes 1G --paths cuda-ipc,cuda-vmm --peers none --mesh-put off --json "$logs/bench-agent-cuda-batch-off.json"
# an 8-byte write's notification, one way (ping-pong between two processes), on host and device memory,
# beside NIXL's (as vLLM drives it, and without its progress thread) where nixl is importable (PYTHONPATH)
step bench-notify-cuda "$py" -m flagcx_mesh.bench notify --device cuda --json "$logs/bench-notify-cuda.json"
step bench-notify-cuda-nixl-nopt "$py" -m flagcx_mesh.bench notify --device cuda --nixl-progress-thread off \
  --json "$logs/bench-notify-cuda-nixl-nopt.json"
# agents on host memory beside the mesh's own puts (cma, shm, tcp: the agent's tcp lanes against the mesh's)
step bench-agent-host "$py" -m flagcx_mesh.bench agent --transports cma,shm,tcp --peers none \
  --json "$logs/bench-agent-host.json"
# a request's KV over staged as one batch, beside pinned D2H / H2D and raw loopback TCP of the same
# run ([staged refs] lines); then a staged put per block (FLAGCX_MESH_CUDA_BATCH_COPY=off), as before
step bench-agent-staged-batch "$py" -m flagcx_mesh.bench agent --device cuda --paths staged --blocks 64K,16K \
  --count 4096 --peers none --mesh-put off --json "$logs/bench-agent-staged-batch.json"
step bench-agent-staged-batch-off env FLAGCX_MESH_CUDA_BATCH_COPY=off "$py" -m flagcx_mesh.bench agent --device cuda \
  --paths staged --blocks 64K,16K --count 4096 --peers none --mesh-put off \
  --json "$logs/bench-agent-staged-batch-off.json"
# the staged path's other half of its goal (raw loopback TCP), and its chunk size either side of the default
step bench-put-host "$py" -m flagcx_mesh.bench put --sizes 1M,16M,64M,256M --batch 0 --json "$logs/bench-put-host.json"
for chunk in 1048576 16777216; do
  step "bench-put-staged-chunk-$chunk" env FLAGCX_MESH_STAGED_CHUNK_BYTES=$chunk "$py" -m flagcx_mesh.bench put \
    --device cuda --paths staged --sizes 1M,16M,64M,256M --json "$logs/bench-put-staged-chunk-$chunk.json"
done
# device memory over the ucx path (docs/rdma.md): two agent processes with CUDA tensors, forced ucx, once over
# UCX's cuda_copy/cuda_ipc/sm and once over tcp + cuda_copy: every byte of random writes, batches and reads,
# a batch ordered on a busy stream, write_blocks of 4096 x 64 KiB (GB/s); then the same KV-shaped writes
# in `bench agent` beside NIXL. Needs a libucx wheel built with CUDA
# (pip install --no-deps libucx-cu13 / libucx-cu12, or the [ucx-cu13] extra); skipped, saying so, without it.
ucx_why=$("$py" -c 'import flagcx_mesh._ucx as u; i = u.info(); print("" if i["loaded"] and any(t.startswith("cuda_copy") for t in i["transports"]) else (i["error"] or "this UCX offers no cuda transport: " + ", ".join(i["transports"])))' 2>&1 | tail -n 1)
if [ -z "$ucx_why" ]; then
  step ucx-device timeout 900 "$py" tests/ucx_device_prog.py all --timeout 300
  # UCX_TLS left to UCX: NIXL's UCX backend does not start with shared memory and cuda alone (no
  # transport there detects a peer's failure); for the same UCX as NIXL's, FLAGCX_MESH_UCX_LIB names
  # the libucp of the nixl wheel (docs/rdma.md)
  step bench-agent-cuda-ucx "$py" -m flagcx_mesh.bench agent --device cuda \
    --paths ucx --blocks 64K,16K --count 4096 --region 256M --bytes 2G --peers nixl --mesh-put off \
    --json "$logs/bench-agent-cuda-ucx.json"
  # a 2-rank mesh's device windows (a cuMem window as the source, torch tensors as the targets) over ucx
  step mesh-device-ucx env FLAGCX_MESH_TRANSPORT=ucx UCX_TLS=cuda_copy,cuda_ipc,sm,self "$py" -m flagcx_mesh.launch -n 2 \
    --timeout 300 -- "$py" tests/gpu_prog.py integrity --device torch --expect-alloc ucx --expect-user ucx
else
  echo "== ucx-device: SKIPPED: $ucx_why" | tee -a "$logs/summary.txt"
fi
exit $status
