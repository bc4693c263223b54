#!/usr/bin/env bash
# A GPU measurement longer than one sitting, on a one-GPU machine, run in the background: the jobs of one list run
# one after another, and a job that would end after the plan's end (second argument, seconds from now) is skipped
# and says so in RES/jobs.tsv. Each list reproduces figures of docs/benchmarks.md (benchmarks/RESULTS.md says how
# each was made); every job is a gpu_bench.py call with the code's defaults, 64 output tokens.
#
# Job lists (third argument; several, comma-separated, run one after another):
#   serve-ratios     Qwen2.5-VL-7B: the pipeline (embeds) and `vllm serve` (8 API servers and SERVE_ARGS) at 12.8 MP
#                    for 5 minutes each (sustained), then at 1 MP for 90 s each (about 24 minutes)
#   serve-ratios-2   Qwen2.5-VL-7B at 1 MP: the pipeline and `vllm serve` alternated, P S P S, 150 s each (about
#                    23 minutes)
#   serve-ratios-02  the same at 0.2 MP, 150 s each: at 1,024 requests in flight serve's first 30-s window is its fill
#                    (about 20 minutes)
#   serve-pairs      Qwen2.5-VL-7B at 0.2 and 1 MP: the pipeline (embeds) and `vllm serve` (8 API servers and
#                    SERVE_ARGS, by default vLLM 0.34's preprocessing options) alternated P S P S, each job one engine
#                    start measuring both budgets in turn in 90-s phases (a 45-s phase at 0.2 MP is mostly the fill
#                    of vLLM's 1,024 seats), after check_tower.py on Qwen3-VL-8B (about 26 minutes)
#   sustained        Qwen2.5-VL-7B at 12.8 MP: the pipeline (embeds) and `vllm serve` (8 API servers and SERVE_ARGS)
#                    for 5 minutes each (sustained) (about 17 minutes)
#   qwen3-embeds     Qwen3-VL-8B at 0.2 and 1 MP (60-s phases): the pipeline (embeds, the default) against `vllm
#                    serve` with SERVE_ARGS (about 11 minutes)
#   public-path      Qwen2.5-VL-7B, then Qwen3-VL-8B (whose image_embeds carry three DeepStack levels, 11x the bytes
#                    of the image), at 0.2 MP (45-s phases), embeds mode: the tower in vLLM's engine (the hooks)
#                    against the tower in the consumer's process handing vLLM image_embeds (the public enable_mm_embeds
#                    path) (about 15 minutes on a fresh machine, where each model's first engine start compiles cold)
#   serve-best       Qwen2.5-VL-7B at 0.2 MP, where serve is short of CPU (90-s phases): `vllm serve` with SERVE_ARGS
#                    and 8, then 12 API servers, its client at 192 and at 1,024 requests in flight on each (the fastest
#                    is the serve figure; gpu_bench.py's serve defaults are that run's fastest) (about 11 minutes)
#   gpu-time         Qwen2.5-VL-7B at 0.2 and 1 MP (60-s phases), vLLM's offline engine given images already at the
#                    model's size (vLLM's own tower and the language model) and given image_embeds (the language model
#                    alone, the ceiling any front end can reach): the GPU time per image of vLLM's tower, by
#                    difference, beside ours (about 8 minutes)
#   qwen35-short     Qwen3.5-27B at 0.2 MP: the pipeline in both modes (90 s), then naive vLLM and vLLM given
#                    image_embeds (60 s); a 27B engine's first start compiles for minutes (about 23 minutes)
#   generic          Gemma 3 4B (the generic path) at 1 MP: naive vLLM against the pipeline (pixels), 25-s phases
#   generic-tiling   LLaVA-OneVision-Qwen2-7B (the generic path, a tiling processor) at its own size: naive vLLM
#                    against the pipeline (pixels), 60-s phases
#   smoke            gpu_engine_smoke.py: embeds mode with our tower in vLLM's engine against transformers, then
#                    pixels mode, Qwen2.5-VL-7B at 1 MP (about 4 minutes)
#   honesty-1mp      `vlmstream estimate` against the whole run at 1 MP on a machine just started: estimate_honesty.py
#                    job h (distinct crops, 1-40 images per document, heavy ones mid-job, about 4,600 images; a
#                    sample of 9%; HONESTY_SCALE=2.0 sets the size) with the Qwen2.5-VL-7B config, 64 tokens
#                    (about 8 minutes)
#   ab, ba           Qwen2.5-VL-7B at 0.2 MP, embeds: this tree (A) against an older tree at /root/ab-tree (B, from
#                    `git archive`), in the order A B B A (ab) or B A (ba): the first engine start on a fresh machine
#                    compiles with cold caches, so a pair must run in both orders
#
# Usage (from the repository, with scripts/gpu/env.sh's environment; see benchmarks/gpu/README.md):
#   setsid nohup bash benchmarks/gpu/plan_x1.sh /root/res 1500 serve-ratios > /root/plan.log 2>&1 < /dev/null &
#   bash benchmarks/gpu/wait_plan.sh /root/res 540      # waits, then archives /root/res
set -u
RES=${1:-/root/res}
PLAN_S=${2:-1380}
LISTS=${3:-serve-ratios}
SNAPSHOT=/root/vlmstream-plan
if [ "$(cd "$(dirname "$0")/../.." && pwd)" != "$SNAPSHOT" ]; then
  # The working tree may change while the plan runs: the plan runs from a copy of it, taken now.
  rm -rf "$SNAPSHOT"; mkdir -p "$SNAPSHOT"
  (cd "$(dirname "$0")/../.." && tar cf - --exclude=./.gpu --exclude=./.venv --exclude=./.git .) | tar xf - -C "$SNAPSHOT"
  exec bash "$SNAPSHOT/benchmarks/gpu/plan_x1.sh" "$RES" "$PLAN_S" "$LISTS"
fi
cd "$SNAPSHOT"
source scripts/gpu/env.sh
[ -e "$RES" ] && mv "$RES" "$RES.before-$(date +%s)"
mkdir -p "$RES"
END=$(( $(date +%s) + PLAN_S ))
git_commit=$(cat COMMIT 2>/dev/null || echo unknown); echo "$git_commit" > "$RES/commit.txt"

source benchmarks/gpu/plan_jobs.sh  # job LABEL EXPECTED_S LIMIT_S CMD...

vlmstream broker start > "$RES/broker_start.log" 2>&1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$RES/gpus.txt" 2>&1
BENCH="python3 benchmarks/gpu/gpu_bench.py --imgs /root/imgs --max-tokens 64 --gpu-ids 0"
# The serve jobs' options beyond the API servers: by default vLLM 0.34's preprocessing (renderer workers, tensors by
# shared memory).
SERVE_ARGS=${SERVE_ARGS:---renderer-num-workers 2 --mm-tensor-ipc torch_shm}
# The serve arm every serve list measures: 8 API servers with SERVE_ARGS (one word for gpu_bench.py, hence an array).
SERVE=(--arms serve --serve-k 8 --serve-args "$SERVE_ARGS")
# made DIR NAME: mk_model.py's NAME config (dummy weights) in DIR, written once per machine.
made() { [ -e "$1/config.json" ] || python3 benchmarks/gpu/mk_model.py "$1" "$2" > "$RES/mk_$(basename "$1").log" 2>&1; }
# The Qwen2.5-VL-7B model folder most lists measure.
need_model() { made /root/model qwen2.5-vl-7b; }
PIPE="--seconds 40 --stop-after 1.5 --arms pipeline-embeds --profile"
# The A/B lists' pipeline, Qwen2.5-VL-7B at 0.2 MP / 64: this code (ab_a LABEL), /root/ab-tree's (ab_b LABEL).
ab_a() { job "$1" 240 360 $BENCH --model /root/model --budgets 256 $PIPE --out "$RES/$1"; }
ab_b() { job "$1" 240 360 $IN_AB_TREE/benchmarks/gpu/gpu_bench.py \
  --imgs /root/imgs --max-tokens 64 --gpu-ids 0 --model /root/model --budgets 256 $PIPE --out "$RES/$1"; }

# alternated_pairs TAG BUDGET SECONDS STOP_AFTER PIPELINE_S SERVE_S: Qwen2.5-VL-7B / 64 with the code's defaults, the
# pipeline (embeds) and `vllm serve` (8 API servers and SERVE_ARGS) alternated at one budget, pipeline, serve,
# pipeline, serve; each job expected to take PIPELINE_S or SERVE_S, a pipeline job given 200 s more (a machine's first
# engine start compiles cold for about three minutes). Both report the steady rate between their first and last
# windows (rates.py), so the ratio table holds the whole-phase ratio and the steady one. A serve job's time includes
# its client's drain after each phase: 1,024 requests in flight can take up to a minute to answer at 1 MP.
alternated_pairs() {
  local tag=$1 budget=$2 seconds=$3 stop_after=$4 pipeline_s=$5 serve_s=$6 k
  need_model
  for k in 1 2; do
    job "${tag}${k}_pipeline" "$pipeline_s" $(( pipeline_s + 200 )) $BENCH --model /root/model --budgets "$budget" \
      --seconds "$seconds" --stop-after "$stop_after" --arms pipeline-embeds --profile --out "$RES/${tag}${k}_pipeline"
    job "${tag}${k}_serve" "$serve_s" $(( serve_s + 100 )) $BENCH --model /root/model --budgets "$budget" \
      --seconds "$seconds" "${SERVE[@]}" --out "$RES/${tag}${k}_serve"
  done
}

# sustained_pair: Qwen2.5-VL-7B at 12.8 MP, the pipeline (embeds) and `vllm serve` (8 API servers and SERVE_ARGS) for
# 5 minutes each. Serve's client keeps 192 requests in flight: at about 7,000 prompt tokens per image (the kit's photos
# at their own size) an H100's KV cache (898,048 tokens) holds some 125 requests, so 192 already keeps the engine full,
# and 1,024 would only lengthen the drain after the phase by minutes.
sustained_pair() {
  need_model
  job s3_pipeline_5min 560 700 $BENCH --model /root/model --budgets default --seconds 300 --stop-after 1.2 \
    --arms pipeline-embeds --profile --out "$RES/s3_pipeline_5min"
  job s4_serve_5min 430 560 $BENCH --model /root/model --budgets default --seconds 300 "${SERVE[@]}" \
    --serve-conc 192 --out "$RES/s4_serve_5min"
}

for LIST in ${LISTS//,/ }; do
  if [ "$LIST" = ab ] || [ "$LIST" = ba ]; then
    need_model
    if ab_tree_ready ab; then
      if [ "$LIST" = ba ]; then ab_b b1_before; ab_a a1_this
      else ab_a a1_this; ab_b b1_before; ab_b b2_before; ab_a a2_this; fi
    fi
  fi

  if [ "$LIST" = serve-ratios ]; then
    sustained_pair
    MID="$BENCH --model /root/model --budgets 1280"
    job s1_pipeline_1mp 250 360 $MID --seconds 90 --stop-after 1.5 --arms pipeline-embeds --profile \
      --out "$RES/s1_pipeline_1mp"
    job s2_serve_1mp 290 400 $MID --seconds 90 "${SERVE[@]}" --out "$RES/s2_serve_1mp"
  fi

  [ "$LIST" = serve-ratios-2 ] && alternated_pairs t_1mp 1280 150 1.3 350 340
  [ "$LIST" = serve-ratios-02 ] && alternated_pairs u_02mp 256 150 1.3 330 290

  if [ "$LIST" = serve-pairs ]; then
    need_model
    # The tower check first: it is short, and a plan cut short by the device's time then still has it.
    job t1_tower_qwen3 120 240 python3 benchmarks/gpu/check_tower.py --model qwen3-vl-8b --images /root/imgs \
      --out "$RES/t1_tower_qwen3.json"
    for k in 1 2; do
      job "v${k}_pipeline" 330 480 $BENCH --model /root/model --budgets 256,1280 --seconds 90 --stop-after 1.5 \
        --arms pipeline-embeds --profile --out "$RES/v${k}_pipeline"
      job "v${k}_serve" 380 500 $BENCH --model /root/model --budgets 256,1280 --seconds 90 "${SERVE[@]}" \
        --out "$RES/v${k}_serve"
    done
  fi

  [ "$LIST" = sustained ] && sustained_pair

  if [ "$LIST" = qwen3-embeds ]; then
    Q3=/root/qwen3-vl-8b
    made $Q3 qwen3-vl-8b
    job q1_q3_pipeline 330 460 $BENCH --model $Q3 --budgets 256,1280 --seconds 60 --stop-after 1.5 \
      --arms pipeline-embeds --profile --out "$RES/q1_q3_pipeline"
    job q2_q3_serve 300 420 $BENCH --model $Q3 --budgets 256,1280 --seconds 60 "${SERVE[@]}" \
      --out "$RES/q2_q3_serve"
  fi

  if [ "$LIST" = public-path ]; then
    need_model
    Q3=/root/qwen3-vl-8b
    job p2_public_path_02mp 430 600 $BENCH --model /root/model --budgets 256 --seconds 45 --stop-after 1.3 \
      --arms pipeline-embeds,pipeline-embeds-public --profile --out "$RES/p2_public_path_02mp"
    made $Q3 qwen3-vl-8b
    job p3_public_path_q3_02mp 450 600 $BENCH --model $Q3 --budgets 256 --seconds 45 --stop-after 1.3 \
      --arms pipeline-embeds,pipeline-embeds-public --profile --out "$RES/p3_public_path_q3_02mp"
  fi

  if [ "$LIST" = serve-best ]; then
    need_model
    job b2_serve_02mp 640 800 $BENCH --model /root/model --budgets 256 --seconds 90 --arms serve --serve-k 8,12 \
      --serve-conc 192,1024 --serve-args "$SERVE_ARGS" --out "$RES/b2_serve_02mp"
  fi

  if [ "$LIST" = gpu-time ]; then
    need_model
    job c1_offline 480 620 $BENCH --model /root/model --budgets 256,1280 --seconds 60 \
      --arms ceiling-preresized,ceiling-embeds --out "$RES/c1_offline"
  fi

  [ "$LIST" = smoke ] && job e1_engine_smoke 250 360 python3 benchmarks/gpu_engine_smoke.py --images /root/imgs --n 64 \
    --modes embeds,pixels --out "$RES/e1_engine_smoke.json"

  if [ "$LIST" = honesty-1mp ]; then
    need_model
    job h1_honesty_1mp 300 $(( END - $(date +%s) )) python3 benchmarks/estimate_honesty.py --cases h --images /root/imgs \
      --scale "${HONESTY_SCALE:-2.0}" --sample-fraction 0.09 --timeout-s 900 \
      --run-options "--model /root/model --max-new-tokens 64" \
      --deadline $(( END - 20 )) --reports "$RES"
    mkdir -p "$RES/worker_logs"; cp "$VLMSTREAM_HOME"/logs/*.log "$RES/worker_logs/" 2>/dev/null
  fi

  if [ "$LIST" = qwen35-short ]; then
    # A 27B engine's first start on a fresh machine compiles for about four minutes, so a start limit of 600 s; at
    # 0.2 MP vLLM's 1,024 seats hold an image about 18 s, so a phase shorter than a minute measures only the fill.
    Q5=/root/qwen3.5-27b
    made $Q5 qwen3.5-27b
    job f1_qwen35_27b_pipeline 800 1000 $BENCH --model $Q5 --budgets 256 --seconds 90 --stop-after 1.5 --profile \
      --start-limit 600 --arms pipeline-embeds,pipeline-pixels --out "$RES/f1_qwen35_27b_pipeline"
    job f2_qwen35_27b_offline 420 560 $BENCH --model $Q5 --budgets 256 --seconds 60 --start-limit 600 \
      --arms naive,ceiling-embeds --out "$RES/f2_qwen35_27b_offline"
  fi

  if [ "$LIST" = generic ]; then
    G3=/root/gemma3-4b
    made $G3 gemma3-4b
    job g2_generic_cores 330 450 $BENCH --model $G3 --budgets 1280 --seconds 25 --stop-after 1.5 \
      --arms naive,pipeline-pixels --out "$RES/g2_generic_cores"
  fi

  if [ "$LIST" = generic-tiling ]; then
    LO=/root/llava-onevision-7b
    made $LO llava-onevision-7b
    job g3_llava_ov 480 640 $BENCH --model $LO --budgets default --seconds 60 --stop-after 1.5 --start-limit 600 \
      --arms naive,pipeline-pixels --out "$RES/g3_llava_ov"
  fi
done

vlmstream broker stop > "$RES/broker_stop.log" 2>&1
date +%T > "$RES/DONE"
