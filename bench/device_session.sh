#!/usr/bin/env bash
# The device calls behind docs/benchmarks.md's table on a 4-GPU machine (nvidia-h100-x4), as run: a call may
# last 10 minutes, so the table takes two calls on the same machine; their speed.json files are merged after
# (python3 bench/speed_table.py --merge A/speed.json B/speed.json --out DIR, on any machine).
# Every stage has its own time limit, so a call always returns with what it measured; logs go to $OUT.
#   bench/device_session.sh table-small   1-GPU rows (one per GPU at once; beside them on GPU 3: the CUDA-only
#                                         tests and two profiles, fused loss on and off), then the 2-GPU rows
#                                         (one per GPU pair at once)
#   bench/device_session.sh full-and-4gpu     see its comment below
#   bench/device_session.sh steady-and-small | four-gpu   session 9's two table calls
#   bench/device_session.sh table | scaling | levers   the next session's calls: the whole table in one call
#                                         (if it fits), the scaling call, the 7B call (see below)
#   bench/device_session.sh qlora | scaling-full   session 11's calls 1 and 2; s11-7b | s11-mixed | s11-lora-base: its
#                                         calls 3-5 (levers-7b and scaling-lora, planned, did not fit its 30 minutes)
#   bench/device_session.sh defaults-1.5b | defaults-7b   session 12: the defaults new in session 11 measured
#   bench/device_session.sh eight-gpu PART   the 8-GPU issue, one part a call (see below)
#   bench/device_session.sh sockets JOBS MODES [STEPS]   the two-node picture alone (what a call fits)
#   bench/device_session.sh sockets-and-variance [SECONDS]   two agents x 2 GPUs, NCCL on sockets: full 1.5B
#                                             zero2/zero3/hsdp, LoRA 7B ddp/hsdp; then full 1.5B on each GPU
#                                             at once, printing every step's seconds, compile seconds so far, and the recompiles
# Needs: .whl (pydantic wheels) and .peer/peer_hf.py carried (and .whl-ao, torchao, for the qlora stage); PYTHONPATH set as below.
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
steps() {  # every full-fine-tuning run under the given folders: seconds per step, compile seconds so far, recompiles
  for m in $(find "$@" -path '*out-full*' -name metrics.jsonl 2>/dev/null); do python3 -c "import json,sys
r=[json.loads(l) for l in open(sys.argv[1])]
print(sys.argv[1].split('/')[-2], [(round(x['tokens']/x['tokens_per_s'],2), x.get('compile_s')) for x in r])" "$m"
    echo "  recompiles: $(grep -c Recompiling "$(dirname "$m")/train.log")"; done; }
install_torchao() {  # Q-LoRA's stages only: peft and transformers import torchao wherever it is installed
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-ao .whl-ao/*.whl || exit 1; }
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
full-and-4gpu)
  # the full fine-tuning rows again (fused loss off by default for full since table-small), the fused loss for full
  # once more with the allocator's retry count and once with expandable segments, LoRA 1.5B on 1 GPU for the
  # 4-GPU scaling on this machine; then the 4-GPU rows except hsdp
  one() { g=$1; name=$2; shift 2; CUDA_VISIBLE_DEVICES=$g timeout 240 python3 bench/speed_table.py --peer .peer/peer_hf.py \
      --work /tmp/w$name --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1; }
  mkdir -p "$OUT"/{a,b,c,d,e,f}
  one 0 a --rows full-1.5b &
  ( one 1 b --rows full-1.5b --no-peer --variants fused_loss=true; one 1 c --rows lora-1.5b --no-peer ) &
  ( one 2,3 d --rows full-1.5b-2gpu
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True one 2 e --rows full-1.5b --no-peer --variants fused_loss=true ) &
  wait
  timeout 330 $B --rows lora-1.5b-4gpu,full-1.5b-4gpu,full-7b-4gpu-zero3 --out "$OUT/f" > "$OUT/f.log" 2>&1
  python3 bench/speed_table.py --merge "$OUT"/[a-f]/speed.json --out "$OUT" ;;
sockets-and-variance)
  # the two-node picture, then (what time is left) four full 1.5B runs at once, one per GPU, with their step times
  T="python3 bench/gpu_two_agents.py --speed --layouts sockets --gpus-per-node 2 --job-timeout 110 --work /tmp/w2"
  timeout 175 $T --steps 8 --jobs full-1.5b --modes zero2,zero3,hsdp --out "$OUT" > "$OUT/s1.log" 2>&1; tail -n 5 "$OUT/s1.log"
  timeout 190 $T --steps 7 --jobs lora-7b --modes ddp,hsdp --out "$OUT" > "$OUT/s2.log" 2>&1; tail -n 4 "$OUT/s2.log"
  for g in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$g TORCH_LOGS=recompiles timeout "${2:-60}" python3 bench/speed_table.py \
      --rows full-1.5b --no-peer --work /tmp/v$g --out /tmp/v$g > /dev/null 2>&1 & done; wait
  for g in 0 1 2 3; do python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print($g, [(round(x['tokens']/x['tokens_per_s'],2), x.get('compile_s')) for x in r])" \
      /tmp/v$g/1.5b/out-full-1.5b-v0/metrics.jsonl; grep -c Recompiling /tmp/v$g/1.5b/out-full-1.5b-v0/train.log; done ;;
steady-and-small)
  # the fix of fe7423a measured: the CUDA tests, then full 1.5B alone on GPU 3 with its recompiles logged, beside
  # the 1-GPU rows (one per GPU); then the 2-GPU rows; every full row's step seconds and compile seconds printed.
  # Limits as after session 9, whose 150 / 300 / 130 s cut the CUDA tests, LoRA 7B and LoRA 1.5B on 2 GPUs
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  ( CUDA_VISIBLE_DEVICES=3 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_paths.py > "$OUT/cuda_tests.log" 2>&1
    CUDA_VISIBLE_DEVICES=3 TORCH_LOGS=recompiles timeout 150 python3 bench/speed_table.py --rows full-1.5b --no-peer \
      --work /tmp/wv --out /tmp/wv > "$OUT/steady.log" 2>&1 ) &
  timeout 340 $B --rows lora-1.5b,full-1.5b,lora-7b,qlora-7b --out "$OUT/p1" > "$OUT/p1.log" 2>&1
  wait
  timeout 160 $B --rows lora-1.5b-2gpu,full-1.5b-2gpu --out "$OUT/p2" > "$OUT/p2.log" 2>&1
  python3 bench/speed_table.py --merge "$OUT"/p[12]/speed.json --out "$OUT"
  grep -h '^\[g' "$OUT"/p[12].log  # every finished row, as its stream printed it (also where a limit cut the merge)
  tail -n 4 "$OUT/cuda_tests.log"; steps /tmp/wv /tmp/wt ;;
four-gpu)  # session 9's call 2, as run
  timeout 560 $B --rows lora-1.5b-4gpu,full-1.5b-4gpu,full-7b-4gpu-zero3,full-7b-4gpu-hsdp --out "$OUT" > "$OUT/f.log" 2>&1
  cat "$OUT/speed.md"; steps /tmp/wt ;;
table)
  # the performance issue's whole table in one call, which may now fit (no final/ written, weights read once):
  # rows print as they finish, so a row the limit cuts is the only one lost; the CUDA tests on GPU 3 meanwhile
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  CUDA_VISIBLE_DEVICES=3 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_paths.py > "$OUT/cuda_tests.log" 2>&1 &
  timeout 570 $B --out "$OUT" > "$OUT/t.log" 2>&1; wait
  grep -h '^\[g' "$OUT/t.log"; tail -n 3 "$OUT/cuda_tests.log"; cat "$OUT/speed.md"; steps /tmp/wt ;;
table-1.5b)
  # session 10's first call: every 1.5B row of the table (1 GPU beside the peer, 2 and 4 GPUs, with the new defaults:
  # parallel auto, rank-0 loading, gc_interval) and the CUDA tests on GPU 3 meanwhile; then full 1.5B on 4 GPUs
  # profiled (steps 12-13) with rank 0's Chrome trace brought back gzipped. The 7B rows are the 'levers' call's
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  CUDA_VISIBLE_DEVICES=3 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_paths.py > "$OUT/cuda_tests.log" 2>&1 &
  timeout 400 $B --rows lora-1.5b,full-1.5b,lora-1.5b-2gpu,full-1.5b-2gpu,lora-1.5b-4gpu,full-1.5b-4gpu --out "$OUT" \
    > "$OUT/t.log" 2>&1; wait
  grep -h '^\[g' "$OUT/t.log"; tail -n 3 "$OUT/cuda_tests.log"; cat "$OUT/speed.md"; steps /tmp/wt
  mkdir -p /tmp/wp; ln -sfn /tmp/wt/models /tmp/wp/models  # the models built above
  timeout 150 $B --rows full-1.5b-4gpu --no-peer --variants profile_steps=12-13 --work /tmp/wp --out "$OUT/p" > "$OUT/p.log" 2>&1
  grep -h '^\[g' "$OUT/p.log"; d=/tmp/wp/g4s0/1.5b/out-full-1.5b-4gpu-v0/profile
  cp "$d/summary.txt" "$OUT/profile-full-4gpu.txt"; gzip -c "$d/rank0.json" > "$OUT/rank0.json.gz"; head -n 12 "$OUT/profile-full-4gpu.txt" ;;
qlora)
  # Q-LoRA's first GPU run: LoRA 7B and Q-LoRA 7B side by side (one GPU each), uncompiled (Q-LoRA's default until
  # its compiled blocks have run on a GPU) and compiled; the table judges Q-LoRA against our LoRA (the target:
  # >= 0.7x its tokens/s at <= 40% of its peak memory). Needs the torchao wheel in .whl-ao/ (carried)
  # torchao only here: peft and transformers import it wherever it is installed, and whether this build (0.18)
  # imports on the image's torch 2.11 is checked first
  install_torchao
  PYTHONPATH=/tmp/site-ao:$PYTHONPATH python3 -c "from torchao.quantization import to_nf4; import torch
print('torchao NF4 on', torch.__version__, to_nf4(torch.randn(256, 64, device='cuda')).dtype)" || exit 1
  PYTHONPATH=/tmp/site-ao:$PYTHONPATH timeout 540 $B --rows lora-7b,qlora-7b --no-peer --variants "default;torch_compile=true" \
    --out "$OUT" > "$OUT/q.log" 2>&1
  grep -h '^\[g' "$OUT/q.log"; cat "$OUT/speed.md"; grep -h "qlora:" /tmp/wt/g1s1/7b/out-qlora-7b-v0/train.log ;;
scaling-full|scaling-lora)
  # session 11's scaling calls (the misses of session 10: 79% at 2 GPUs for full 1.5B, 81-84% for LoRA 1.5B).
  # full: NCCL alone at FSDP2's per-block sizes; the 1-GPU baseline alone on the machine; 4 GPUs with one, two and
  # four blocks per FSDP unit; then profiled, every rank's Chrome trace back gzipped (which rank the others wait for).
  # lora: the baseline alone; 4 GPUs with DDP, the flat sync, and without compiled blocks (105% in session 8); profiled
  kind=${1#scaling-}; rows=$kind-1.5b-4gpu
  variants="default;grad_sync=flat;torch_compile=false"
  if [ "$kind" = full ]; then
    variants="default;fsdp_blocks_per_unit=2;fsdp_blocks_per_unit=4"
    timeout 45 torchrun --nproc_per_node 4 bench/allreduce_probe.py 2>/dev/null | grep '^nccl'
  fi
  CUDA_VISIBLE_DEVICES=0 timeout 100 $B --rows $kind-1.5b --no-peer --out "$OUT/b" > "$OUT/b.log" 2>&1; grep -h '^\[g' "$OUT/b.log"
  timeout $([ "$kind" = full ] && echo 300 || echo 330) $B --rows $rows --no-peer --variants "$variants" --out "$OUT/f" > "$OUT/f.log" 2>&1; grep -h '^\[g' "$OUT/f.log"
  mkdir -p /tmp/wp; ln -sfn /tmp/wt/models /tmp/wp/models  # the model built above
  timeout 115 $B --rows $rows --no-peer --variants profile_steps=12-13 --work /tmp/wp --out "$OUT/p" > "$OUT/p.log" 2>&1
  grep -h '^\[g' "$OUT/p.log"; d=/tmp/wp/g4s0/1.5b/out-$rows-v0/profile; head -n 2 "$d/summary.txt"
  for r in 0 1 2 3; do gzip -c "$d/rank$r.json" > "$OUT/rank$r.json.gz"; done
  python3 bench/speed_table.py --merge "$OUT"/b/speed.json "$OUT"/f/speed.json --out "$OUT" > /dev/null; cat "$OUT/speed.md" ;;
levers-7b)
  # full 7B zero3 on 4 GPUs (27.6% MFU in session 10, with 50 allocator retries): as it is and with two blocks per
  # FSDP unit; then with expandable segments (no fragmentation retries), at batch 4 and 8. Building the 7B model
  # took about 3 minutes of session 10's call 3, so four rows are what fits
  timeout 370 $B --rows full-7b-4gpu-zero3 --no-peer --out "$OUT/z" \
    --variants "default;fsdp_blocks_per_unit=2" > "$OUT/z.log" 2>&1
  mkdir -p /tmp/we; ln -sfn /tmp/wt/models /tmp/we/models
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 185 $B --rows full-7b-4gpu-zero3 --no-peer --out "$OUT/e" \
    --work /tmp/we --variants "default;per_device_train_batch_size=8" > "$OUT/e.log" 2>&1
  grep -h '^\[g' "$OUT/z.log" "$OUT/e.log"; steps /tmp/wt /tmp/we ;;
scaling)
  # scaling on one machine in one call: the 1-GPU baselines alone on the machine first (a host-bound LoRA step
  # slows down beside other streams, which moved session 9's baseline), then the 4-GPU rows, the full one also
  # profiled (steps 12-13; rank 0's Chrome trace comes back gzipped), merged into one table
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/speed_table.py --rows lora-1.5b,full-1.5b --no-peer --work /tmp/wb \
    --out "$OUT/b" > "$OUT/b.log" 2>&1; grep '^{' "$OUT/b.log"
  timeout 400 $B --rows lora-1.5b-4gpu,full-1.5b-4gpu --no-peer --variants "default;profile_steps=12-13;grad_reduce_dtype=bf16" \
    --out "$OUT/f" > "$OUT/f.log" 2>&1
  python3 bench/speed_table.py --merge "$OUT"/b/speed.json "$OUT"/f/speed.json --out "$OUT"
  cp /tmp/wt/g4s0/1.5b/out-full-1.5b-4gpu-v1/profile/summary.txt "$OUT/profile-full-4gpu.txt"
  gzip -c /tmp/wt/g4s0/1.5b/out-full-1.5b-4gpu-v1/profile/rank0.json > "$OUT/rank0.json.gz"
  head -n 3 "$OUT/profile-full-4gpu.txt"; steps /tmp/wb /tmp/wt ;;
levers)
  # the 7B rows: zero3 as the table has it, with Python's own garbage collection, at batch 8 (fits without
  # checkpointing, by the 41.5 GiB of batch 4), and with bf16 gradient reduce-scatters; then hsdp as it is
  timeout 400 $B --rows full-7b-4gpu-zero3 --no-peer --out "$OUT/z" \
    --variants "default;gc_interval=0;per_device_train_batch_size=8;grad_reduce_dtype=bf16" > "$OUT/z.log" 2>&1
  timeout 150 $B --rows full-7b-4gpu-hsdp --no-peer --out "$OUT/h" > "$OUT/h.log" 2>&1
  grep -h '^\[g' "$OUT/z.log" "$OUT/h.log"; steps /tmp/wt ;;
s11-7b)  # session 11's call 3, as run: 7B zero3 default and 4 blocks a unit; then 4 blocks with expandable segments
  B="python3 bench/speed_table.py --peer .peer/peer_hf.py --work /tmp/w7 --streams"
  timeout 380 $B --rows full-7b-4gpu-zero3 --no-peer --out "$OUT/z" --variants "default;fsdp_blocks_per_unit=4" > "$OUT/z.log" 2>&1
  mkdir -p /tmp/we; ln -sfn /tmp/w7/models /tmp/we/models
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 150 $B --rows full-7b-4gpu-zero3 --no-peer --out "$OUT/e" \
    --work /tmp/we --variants "fsdp_blocks_per_unit=4" > "$OUT/e.log" 2>&1
  grep -h '^\[g' "$OUT/z.log" "$OUT/e.log" ;;
s11-mixed)  # session 11's call 4, as run, on the machine of s11-7b (models kept): 7B with expandable segments, default
  # and 2 blocks a unit; full 1.5B 2 GPUs at 4 blocks; LoRA 1.5B alone; LoRA 1.5B on 4 and 2 GPUs. Only the first
  # and last rows finished: a new work folder tokenizes and compiles for about 70 s, more than 80-100 s limits allow
  B="python3 bench/speed_table.py --peer .peer/peer_hf.py --streams --no-peer"
  for w in a b c d; do mkdir -p /tmp/x$w; done; ln -sfn /tmp/w7/models /tmp/xa/models
  for w in b c d; do ln -sfn /tmp/wt/models /tmp/x$w/models; done
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 200 $B --rows full-7b-4gpu-zero3 --work /tmp/xa --out "$OUT/a" \
    --variants "default;fsdp_blocks_per_unit=2" > "$OUT/a.log" 2>&1
  timeout 100 $B --rows full-1.5b-2gpu --work /tmp/xb --out "$OUT/b" --variants "fsdp_blocks_per_unit=4" > "$OUT/b.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 80 $B --rows lora-1.5b --work /tmp/xc --out "$OUT/c" > "$OUT/c.log" 2>&1
  timeout 160 $B --rows lora-1.5b-4gpu,lora-1.5b-2gpu --work /tmp/xd --out "$OUT/d" > "$OUT/d.log" 2>&1
  grep -h '^\[g' "$OUT"/?.log ;;
s11-lora-base)  # session 11's call 5, as run: LoRA 1.5B alone on the machine (the baseline of s11-mixed's 2-GPU row)
  mkdir -p /tmp/xe; ln -sfn /tmp/wt/models /tmp/xe/models
  CUDA_VISIBLE_DEVICES=0 timeout 140 python3 bench/speed_table.py --streams --no-peer --rows lora-1.5b --work /tmp/xe \
    --out "$OUT/e" > "$OUT/e.log" 2>&1; grep -h '^\[g' "$OUT/e.log" ;;
defaults-1.5b)  # session 12: the defaults new in session 11 (blocks per unit 4, expandable segments) on the 1.5B
  # scaling rows: each baseline alone on the machine, then 2 and 4 GPUs, one table
  CUDA_VISIBLE_DEVICES=0 timeout 150 $B --rows full-1.5b,lora-1.5b --no-peer --out "$OUT/b" > "$OUT/b.log" 2>&1
  timeout 380 $B --rows full-1.5b-2gpu,full-1.5b-4gpu,lora-1.5b-2gpu,lora-1.5b-4gpu --no-peer --out "$OUT/f" > "$OUT/f.log" 2>&1
  grep -h '^\[g' "$OUT/b.log" "$OUT/f.log"
  python3 bench/speed_table.py --merge "$OUT"/b/speed.json "$OUT"/f/speed.json --out "$OUT" > /dev/null; cat "$OUT/speed.md" ;;
defaults-7b)  # session 12: the 7B rows under the new defaults: zero3 and hsdp on 4 GPUs, then LoRA beside Q-LoRA
  install_torchao
  timeout 370 $B --rows full-7b-4gpu-zero3,full-7b-4gpu-hsdp --no-peer --out "$OUT/z" > "$OUT/z.log" 2>&1
  mkdir -p /tmp/wq; ln -sfn /tmp/wt/models /tmp/wq/models
  PYTHONPATH=/tmp/site-ao:$PYTHONPATH timeout 180 $B --rows lora-7b,qlora-7b --no-peer --work /tmp/wq --out "$OUT/q" > "$OUT/q.log" 2>&1
  grep -h '^\[g' "$OUT/z.log" "$OUT/q.log" ;;
eight-gpu)
  # the 8-GPU issue on nvidia-h100-x8 / h200-x8, one part a call (each fits 10 minutes; the issue's "one call"
  # does not): scaling-a (1, 2, 4 GPUs) and scaling-b (8 GPUs), merged after with --merge; nodes-zero3 and
  # nodes-hsdp (full 7B, two agents x 4 GPUs on sockets vs one agent with 8); restart (one agent killed after a
  # checkpoint, started again, resume and losses on CUDA)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  T="python3 bench/gpu_two_agents.py --gpus-per-node 4 --work /tmp/w8 --out $OUT"
  case "$2" in
  scaling-a) timeout 560 $B --no-peer --rows lora-1.5b,lora-1.5b-2gpu,full-7b-2gpu-zero3,full-7b-2gpu-hsdp,lora-1.5b-4gpu,full-7b-4gpu-zero3,full-7b-4gpu-hsdp \
               --out "$OUT" > "$OUT/a.log" 2>&1; grep '^\[g' "$OUT/a.log"; cat "$OUT/speed.md" ;;
  scaling-b) timeout 560 $B --no-peer --rows lora-1.5b-8gpu,full-7b-8gpu-zero3,full-7b-8gpu-hsdp --out "$OUT" > "$OUT/b.log" 2>&1
             grep '^\[g' "$OUT/b.log" ;;
  nodes-zero3|nodes-hsdp) timeout 560 $T --speed --jobs full-7b --modes "${2#nodes-}" --steps 8 --job-timeout 260 > "$OUT/n.log" 2>&1
             tail -n 6 "$OUT/n.log" ;;
  restart) timeout 560 $T --modes zero3 --size 0.5b --steps 120 --save-steps 40 > "$OUT/r.log" 2>&1; tail -n 5 "$OUT/r.log" ;;
  esac ;;
sockets)  # sockets JOBS MODES [STEPS]: one job list per call; a 7B job starts in about 2 minutes
  timeout 560 python3 bench/gpu_two_agents.py --speed --layouts sockets --gpus-per-node 2 --job-timeout 240 \
    --work /tmp/w2 --steps "${4:-8}" --jobs "$2" --modes "$3" --out "$OUT" > "$OUT/sockets.log" 2>&1; tail -n 8 "$OUT/sockets.log" ;;
esac
