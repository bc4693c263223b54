#!/usr/bin/env bash
# One device session's measurements on a two-GPU host (kind nvidia-h200-x2), run in the background so that they
# outlast the 10-minute limit of one device command. Pairs of runs go side by side, one per GPU, on one shared
# broker; a CPU-bound run (0.2 MP pipeline or offline arms) is paired only with a GPU-bound one (1 MP, 12.8 MP),
# because two CPU-bound runs measured each other (benchmarks/RESULTS.md, third session, when each engine
# spun ~15 cores; see S1 below). The fourth session ran the
# previous list (commit 71801ff), the fifth the list of commit 9781a78; this is the list for the sixth. Jobs run in
# order and a job that would end after the plan's end (second argument, seconds from now) is skipped and says so in
# jobs.tsv, so the list may be longer than one session.
#
#   S1  0.2 MP / 64, embeds, 150 s, side by side: GPU 0 with `infer.vision_batch_images` 64 | GPU 1 with the default
#       32. The fifth session's one-GPU run was bound by our tower's thread while vLLM ran ~100 requests at a time;
#       one reading (RESULTS.md, fifth session, not settled) is that bursts of 64 keep its decode batches larger.
#       Since 61413b6 a 0.2 MP run uses ~5 cores, so two of them side by side on 32 cores no longer measure each
#       other.
#   S2  GPU 0: the same with `infer.engine_cpu_threads=0` (vLLM's own start, the fourth session's faster one-GPU
#       rate), then `vllm serve` at 0.2, 1 and 12.8 MP / 128 | GPU 1: pipelines at 1 MP / 128, both modes, then our
#       tower alone at 0.2 MP with 16, 32 and 64 images per forward (this host's own figure: the pipeline's tower
#       took 15.5-16 ms per image in the fifth session, the second session's host 3.8 alone)
#   S3  both GPUs: two `vlmstream infer` in one group at 1 MP / 64, embeds, 150 s
#   S4  both GPUs: the same at 12.8 MP / 64 (600 documents)
#
# On the device, after unpack_device.sh:
#   setsid nohup bash benchmarks/gpu/plan_x2.sh /root/res 1560 > /root/plan.log 2>&1 < /dev/null &
#   bash benchmarks/gpu/wait_plan.sh /root/res 540      # in each later call: waits, then copies /root/res to $OUT
set -u
RES=${1:-/root/res}
PLAN_S=${2:-1380}
SNAPSHOT=/root/vlmstream-plan
if [ "$(cd "$(dirname "$0")/../.." && pwd)" != "$SNAPSHOT" ]; then
  # Later device calls refresh the working tree in place: the plan runs from a copy of it, taken now.
  rm -rf "$SNAPSHOT"; mkdir -p "$SNAPSHOT"
  (cd "$(dirname "$0")/../.." && tar cf - --exclude=./.gpu --exclude=./.venv --exclude=./.git .) | tar xf - -C "$SNAPSHOT"
  exec bash "$SNAPSHOT/benchmarks/gpu/plan_x2.sh" "$RES" "$PLAN_S"
fi
cd "$SNAPSHOT"
source scripts/gpu/env.sh
# The device may keep /root from an earlier session: an old DONE would end wait_plan.sh at once.
[ -e "$RES" ] && mv "$RES" "$RES.before-$(date +%s)"
mkdir -p "$RES"
END=$(( $(date +%s) + PLAN_S ))
BENCH="python3 benchmarks/gpu/gpu_bench.py --model /root/model --imgs /root/imgs --max-tokens 64"
BENCH128="python3 benchmarks/gpu/gpu_bench.py --model /root/model --imgs /root/imgs --max-tokens 128"

job() {  # job LABEL EXPECTED_S LIMIT_S CMD...: one line per job in jobs.tsv (label, rc, start, seconds)
  local label=$1 expect=$2 limit=$3; shift 3
  local start; start=$(date +%s)
  if (( start + expect > END )); then
    printf '%s\tskipped\t%s\t0\twould end %ss after the plan end\n' "$label" "$(date +%T)" $(( start + expect - END )) >> "$RES/jobs.tsv"
    return
  fi
  printf '%s\tstarted\t%s\n' "$label" "$(date +%T)" >> "$RES/jobs.tsv"
  timeout -k 30 "$limit" "$@" > "$RES/$label.log" 2>&1
  printf '%s\trc=%s\t%s\t%s\n' "$label" "$?" "$(date -d @"$start" +%T)" $(( $(date +%s) - start )) >> "$RES/jobs.tsv"
}

vlmstream broker start > "$RES/broker_start.log" 2>&1  # shared by every pipeline run below (they reuse it)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$RES/gpus.txt" 2>&1

job s1_tower_batch64 300 480 env VLMSTREAM_INFER__VISION_BATCH_IMAGES=64 $BENCH --gpu-ids 0 --budgets 256 \
  --seconds 150 --stop-after 1.0 --arms pipeline-embeds --profile --out "$RES/s1_tower_batch64" &
job s1_tower_batch32 300 480 $BENCH --gpu-ids 1 --budgets 256 --seconds 150 --stop-after 1.0 --arms pipeline-embeds \
  --profile --out "$RES/s1_tower_batch32" &
wait

( job s2_engine_threads0 300 480 env VLMSTREAM_INFER__ENGINE_CPU_THREADS=0 $BENCH --gpu-ids 0 --budgets 256 \
    --seconds 150 --stop-after 1.0 --arms pipeline-embeds --profile --out "$RES/s2_engine_threads0"
  job s2_serve_128 300 450 $BENCH128 --gpu-ids 0 --budgets 256,1280,default --seconds 40 --arms serve \
    --out "$RES/s2_serve_128" ) &
( job s2_pipeline_1mp_128 420 560 $BENCH128 --gpu-ids 1 --budgets 1280 --seconds 120 --stop-after 1.5 \
    --pipeline-docs 2000 --arms pipeline-embeds,pipeline-pixels --out "$RES/s2_pipeline_1mp_128"
  job s2_tower_alone 150 300 env CUDA_VISIBLE_DEVICES=1 python3 benchmarks/gpu/bench_vision_tower.py \
    --model /root/model --imgs /root/imgs --budgets 256 --variants fast+vllm_fa3 --batches 16,32,64 --seconds 4 \
    --profile-budget '' --out "$RES/s2_tower_alone.json" ) &
wait

job s3_two_gpus_1mp 330 480 $BENCH --gpu-ids 0,1 --budgets 1280 --seconds 150 --stop-after 1.0 --workers 16 \
  --arms pipeline-embeds --out "$RES/s3_two_gpus_1mp"

job s4_two_gpus_12mp 360 520 $BENCH --gpu-ids 0,1 --budgets default --seconds 150 --stop-after 1.5 \
  --pipeline-docs 600 --arms pipeline-embeds --out "$RES/s4_two_gpus_12mp"

vlmstream broker stop > "$RES/broker_stop.log" 2>&1
date +%T > "$RES/DONE"
