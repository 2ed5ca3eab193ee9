#!/usr/bin/env bash
# The device calls behind docs/benchmarks.md's table on a 4-GPU machine (nvidia-h100-x4), as run: a call may
# last 10 minutes, so the table takes two calls on the same machine; their speed.json files are merged after
# (python3 bench/speed_table.py --merge A/speed.json B/speed.json --out DIR, on any machine).
# Every stage has its own time limit, so a call always returns with what it measured; logs go to $OUT.
#   bench/device_session.sh table-small   1-GPU rows (one per GPU at once; beside them on GPU 3: the CUDA-only
#                                         tests and two profiles, fused loss on and off), then the 2-GPU rows
#                                         (one per GPU pair at once)
#   bench/device_session.sh table-4gpu    the 4-GPU rows: LoRA and full 1.5B (scaling), full 7B zero3 and hsdp
#   bench/device_session.sh sockets JOBS [MODES]   two agents x 2 GPUs, NCCL on sockets (docs/multi-node.md)
# Needs: .whl (pydantic wheels) and .peer/peer_hf.py carried; PYTHONPATH set as below.
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
B="python3 bench/speed_table.py --peer .peer/peer_hf.py --work /tmp/wt --streams"
case "$1" in
table-small)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m | head -6
  mkdir -p "$OUT/diag"
  ( CUDA_VISIBLE_DEVICES=3 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_paths.py \
      > "$OUT/cuda_tests.log" 2>&1
    CUDA_VISIBLE_DEVICES=3 timeout 200 python3 bench/speed_table.py --rows lora-1.5b --no-peer --work /tmp/wd \
      --out "$OUT/diag" --variants "profile_steps=12-13;fused_loss=false,profile_steps=12-13" > "$OUT/diag.log" 2>&1 ) &
  timeout 300 $B --rows lora-1.5b,full-1.5b,lora-7b,qlora-7b --out "$OUT/p1" > "$OUT/p1.log" 2>&1
  wait
  timeout 120 $B --rows lora-1.5b-2gpu,full-1.5b-2gpu --out "$OUT/p2" > "$OUT/p2.log" 2>&1
  python3 bench/speed_table.py --merge "$OUT"/p[12]/speed.json --out "$OUT"
  tail -n 4 "$OUT/cuda_tests.log"; grep -h '^{' "$OUT/diag.log"; head -n 3 "$OUT"/diag/profile-*.txt ;;
table-4gpu)
  timeout 520 $B --rows lora-1.5b-4gpu,full-1.5b-4gpu,full-7b-4gpu-zero3,full-7b-4gpu-hsdp --out "$OUT/p3" \
    > "$OUT/p3.log" 2>&1
  cat "$OUT/p3/speed.md" ;;
sockets)
  mkdir -p /tmp/w2/7b /tmp/w2/1.5b
  for size in 7b 1.5b; do [ -e /tmp/wt/models/model-$size ] && ln -sfn /tmp/wt/models/model-$size /tmp/w2/$size/model-$size; done
  timeout 560 python3 bench/gpu_two_agents.py --speed --layouts sockets --jobs "$2" --modes "${3:-zero2,zero3,hsdp}" \
    --gpus-per-node 2 --steps 8 --job-timeout 150 --work /tmp/w2 --out "$OUT" ;;
esac
