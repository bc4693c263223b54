#!/usr/bin/env bash
# One GPU lease's measurements on a two-GPU host (kind nvidia-h200-x2), run in the background so that they
# outlast the 10-minute limit of one device command. Pairs of runs go side by side, one per GPU, on one shared
# broker; a CPU-bound run (0.2 MP pipeline or offline arms) is paired only with a GPU-bound one (1 MP, 12.8 MP),
# because two CPU-bound runs measured each other (benchmarks/RESULTS.md, 2026-11-30, code at ba10793, when each
# engine spun ~15 cores). Earlier lists ran on 2026-11-30 at 71801ff, 9781a78 and d1480f4 (RESULTS.md has each
# run's section); this list ran at e68d8ed. Jobs run in order and a job that would end after the
# plan's end (second argument, seconds from now) is skipped and says so in jobs.tsv, so the list may be longer than
# one lease.
#
#   S1  0.2 MP / 64, embeds, 150 s, side by side: GPU 0 this code | GPU 1 the code before a change (an overlay made
#       here by `benchmarks/gpu/ab_overlay.sh BASE .gpu/ab` and copied to /root/ab in call 3; without /root/ab the
#       A/B jobs are skipped). For d907c5c: one copy off the GPU per batch instead of two per image.
#   S2  the same with the GPUs swapped, so a difference between the two GPUs cancels.
#   S3  two GPUs in one group at 0.2 MP / 128, embeds, 150 s (the table's last empty cells: two GPUs at 128 tokens)
#   S4  two GPUs at 1 MP / 128, 150 s
#   S5  two GPUs at 12.8 MP / 128, 600 documents
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
# The device may keep /root from an earlier lease: an old DONE would end wait_plan.sh at once.
[ -e "$RES" ] && mv "$RES" "$RES.before-$(date +%s)"
mkdir -p "$RES"
END=$(( $(date +%s) + PLAN_S ))
BENCH="python3 benchmarks/gpu/gpu_bench.py --model /root/model --imgs /root/imgs --max-tokens 64"
BENCH128="python3 benchmarks/gpu/gpu_bench.py --model /root/model --imgs /root/imgs --max-tokens 128"

source benchmarks/gpu/plan_jobs.sh  # job LABEL EXPECTED_S LIMIT_S CMD...

vlmstream broker start > "$RES/broker_start.log" 2>&1  # shared by every pipeline run below (they reuse it)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$RES/gpus.txt" 2>&1

AB_TREE=/root/vlmstream-ab
if [ -d /root/ab ]; then
  rm -rf "$AB_TREE"; cp -r "$SNAPSHOT" "$AB_TREE"; cp -r /root/ab/. "$AB_TREE/"
  cp /root/ab/BASE_COMMIT "$RES/ab_base_commit.txt"
  BENCH_BEFORE="env PYTHONPATH=/tmp/site:$AB_TREE python3 $AB_TREE/benchmarks/gpu/gpu_bench.py --model /root/model --imgs /root/imgs --max-tokens 64"
  AB_ARGS="--budgets 256 --seconds 150 --stop-after 1.0 --arms pipeline-embeds --profile"
  job s1_this_gpu0 300 480 $BENCH --gpu-ids 0 $AB_ARGS --out "$RES/s1_this_gpu0" &
  job s1_before_gpu1 300 480 $BENCH_BEFORE --gpu-ids 1 $AB_ARGS --out "$RES/s1_before_gpu1" &
  wait
  job s2_before_gpu0 300 480 $BENCH_BEFORE --gpu-ids 0 $AB_ARGS --out "$RES/s2_before_gpu0" &
  job s2_this_gpu1 300 480 $BENCH --gpu-ids 1 $AB_ARGS --out "$RES/s2_this_gpu1" &
  wait
else
  printf 's1_s2_ab\tskipped\t%s\t0\tno /root/ab overlay\n' "$(date +%T)" >> "$RES/jobs.tsv"
fi

job s3_two_gpus_256_128 330 480 $BENCH128 --gpu-ids 0,1 --budgets 256 --seconds 150 --stop-after 1.0 --workers 16 \
  --arms pipeline-embeds --out "$RES/s3_two_gpus_256_128"

job s4_two_gpus_1mp_128 330 480 $BENCH128 --gpu-ids 0,1 --budgets 1280 --seconds 150 --stop-after 1.0 --workers 16 \
  --arms pipeline-embeds --out "$RES/s4_two_gpus_1mp_128"

job s5_two_gpus_12mp_128 330 520 $BENCH128 --gpu-ids 0,1 --budgets default --seconds 150 --stop-after 1.5 \
  --pipeline-docs 600 --arms pipeline-embeds --out "$RES/s5_two_gpus_12mp_128"

vlmstream broker stop > "$RES/broker_stop.log" 2>&1
date +%T > "$RES/DONE"
