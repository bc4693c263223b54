#!/usr/bin/env bash
# One device session's measurements on a two-GPU host (kind nvidia-h200-x2), run in the background so that they
# outlast the 10-minute limit of one device command. Pairs of runs go side by side, one per GPU, on one shared
# broker. Only GPU-bound runs (12.8 MP, 1 MP) keep a CPU-bound 0.2 MP run company: two 0.2 MP runs side by side
# measured each other's CPU load (2026-11-30, third session: see benchmarks/RESULTS.md). That session ran this
# script as of commit ba10793 (another job list); this is the list for the next one.
#
#   S1  both GPUs: the pipeline, embeds mode, two `vlmstream infer` in one group, 0.2 MP / 64 tokens, 120 s
#   S2  GPU 0: the sustained run, embeds mode, 0.2 MP / 64 tokens, 480 s after warm-up (one-GPU figure for S1)
#       GPU 1: the pipeline at 12.8 MP, embeds then pixels (400 documents each; engine timings per image)
#       Both profile their `vlmstream infer` (--profile: which thread each process waits on, EngineCore's CPU).
#   S3  GPU 0: naive + ceiling (offline vLLM) at 0.2 MP, then the engine smoke (embeddings vs transformers, guided
#       JSON) | GPU 1: the pipeline at 1 MP, embeds then pixels
#   S4  GPU 0: naive + ceiling at 1 MP | GPU 1: `vllm serve --api-server-count 8` at 1 MP (both CPU-heavy: a pair
#       that may slow each other; 0.2 MP serve and the 12.8 MP arms were measured 2026-11-30)
# A job that would end after the plan's end (second argument, seconds from now) is skipped and says so in jobs.tsv.
#
# On the device, after unpack_device.sh:
#   setsid nohup bash benchmarks/gpu/plan_x2.sh /root/res 1480 > /root/plan.log 2>&1 < /dev/null &
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
mkdir -p "$RES"
END=$(( $(date +%s) + PLAN_S ))
BENCH="python3 benchmarks/gpu/gpu_bench.py --model /root/model --imgs /root/imgs --max-tokens 64"
# For scripts that use the first visible GPU (gpu_bench takes --gpu-ids and does the same itself).
ON_GPU0="env CUDA_VISIBLE_DEVICES=0 VLLM_CACHE_ROOT=$HOME/.cache/vllm-gpu0"

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

job s1_two_gpus 330 480 $BENCH --gpu-ids 0,1 --budgets 256 --seconds 120 --stop-after 1.0 \
  --arms pipeline-embeds --out "$RES/s1_two_gpus"

job s2_sustained_embeds 610 700 $BENCH --gpu-ids 0 --budgets 256 --seconds 480 --stop-after 1.0 \
  --pipeline-docs 40000 --arms pipeline-embeds --profile --out "$RES/s2_sustained_embeds" &
job s2_pipeline_12mp 540 660 $BENCH --gpu-ids 1 --budgets default --seconds 120 --stop-after 1.5 \
  --pipeline-docs 400 --arms pipeline-embeds,pipeline-pixels --profile --out "$RES/s2_pipeline_12mp" &
wait

( job s3_offline_256 270 400 $BENCH --gpu-ids 0 --budgets 256 --seconds 40 --arms naive,ceiling \
    --out "$RES/s3_offline_256"
  mkdir -p "$RES/s3_smoke"
  job s3_smoke 120 240 $ON_GPU0 python3 benchmarks/gpu_engine_smoke.py --images /root/imgs --n 32 --modes embeds \
    --out "$RES/s3_smoke/engine_smoke.json" ) &
job s3_pipeline_1mp 340 480 $BENCH --gpu-ids 1 --budgets 1280 --seconds 90 --stop-after 1.5 \
  --pipeline-docs 1300 --arms pipeline-embeds,pipeline-pixels --out "$RES/s3_pipeline_1mp" &
wait

job s4_offline_1mp 220 330 $BENCH --gpu-ids 0 --budgets 1280 --seconds 30 --arms naive,ceiling \
  --out "$RES/s4_offline_1mp" &
job s4_serve_1mp 200 300 $BENCH --gpu-ids 1 --budgets 1280 --seconds 40 --arms serve --out "$RES/s4_serve_1mp" &
wait

vlmstream broker stop > "$RES/broker_stop.log" 2>&1
date +%T > "$RES/DONE"
