#!/usr/bin/env bash
# One device session's measurements on a two-GPU host (kind nvidia-h200-x2), run in the background so that they
# outlast the 10-minute limit of one device command. Pairs of runs go side by side, one per GPU, on one shared
# broker; a CPU-bound run (0.2 MP pipeline or offline arms) is paired only with a GPU-bound one (1 MP, 12.8 MP),
# because two CPU-bound runs measure each other (benchmarks/RESULTS.md, third session). The fourth session ran the
# previous list (commit 71801ff); the fifth ran this one. Jobs run in order and a job that would end after the
# plan's end (second argument, seconds from now) is skipped and says so in jobs.tsv, so the list may be longer than one session.
#
#   S1  both GPUs: two `vlmstream infer` in one group, embeds, 0.2 MP / 64 tokens, 150 s, alone on the host,
#       profiled, 16 decode workers: the two-GPU figure with EngineCore at one CPU thread (61413b6). If it yields no
#       figure, the rest runs with vLLM's own engine start (infer.engine_cpu_threads=0) and S1 runs once more.
#   S2  GPU 0: the sustained run, embeds, 0.2 MP / 64, 510 s from the first document (the fourth session's 480 s
#       stopped 6 s short of 8 minutes after its first one), profiled | GPU 1: 12.8 MP / 128 tokens: pipeline embeds
#       and pixels, then naive + ceilings
#   S3  GPU 0: pipeline embeds and pixels at 0.2 MP / 128 | GPU 1: naive + ceilings at 0.2 MP and 1 MP / 128 (both
#       CPU-heavier than S2's GPU 1 jobs; the sustained run is over by then)
#   Not in this list (next session): pipelines at 1 MP / 128, `vllm serve` at 128 tokens, a same-session serve at
#   0.2 MP / 64, two GPUs at 1 MP and 12.8 MP.
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

s1() {
  job "$1" 330 480 $BENCH --gpu-ids 0,1 --budgets 256 --seconds 150 --stop-after 1.0 --workers 16 \
    --arms pipeline-embeds --profile --out "$RES/$1"
}
s1 s1_two_gpus
if ! grep -q 'PHASE pipeline-embeds' "$RES/s1_two_gpus.log" 2>/dev/null; then
  # No figure: most likely the spawned engine start (61413b6) failed; go back to vLLM's own start and retry once.
  export VLMSTREAM_INFER__ENGINE_CPU_THREADS=0
  printf 's1_two_gpus\tno figure: VLMSTREAM_INFER__ENGINE_CPU_THREADS=0 from here on\t%s\n' "$(date +%T)" >> "$RES/jobs.tsv"
  s1 s1_two_gpus_fallback
fi

job s2_sustained_embeds 650 760 $BENCH --gpu-ids 0 --budgets 256 --seconds 510 --stop-after 1.0 \
  --pipeline-docs 45000 --arms pipeline-embeds --profile --out "$RES/s2_sustained_embeds" &
( job s2_pipeline_12mp_128 450 600 $BENCH128 --gpu-ids 1 --budgets default --seconds 120 --stop-after 1.5 \
    --pipeline-docs 300 --arms pipeline-embeds,pipeline-pixels --out "$RES/s2_pipeline_12mp_128"
  job s2_offline_12mp_128 230 330 $BENCH128 --gpu-ids 1 --budgets default --seconds 30 --arms naive,ceiling \
    --out "$RES/s2_offline_12mp_128" ) &
wait

job s3_pipeline_256_128 400 540 $BENCH128 --gpu-ids 0 --budgets 256 --seconds 120 --stop-after 1.0 \
  --arms pipeline-embeds,pipeline-pixels --out "$RES/s3_pipeline_256_128" &
job s3_offline_128 420 560 $BENCH128 --gpu-ids 1 --budgets 256,1280 --seconds 30 --arms naive,ceiling \
  --out "$RES/s3_offline_128" &
wait

vlmstream broker stop > "$RES/broker_stop.log" 2>&1
date +%T > "$RES/DONE"
