#!/usr/bin/env bash
# One GPU lease's measurements on a one-GPU host (kind nvidia-h200), run in the background so that they outlast the
# 10-minute limit of one device command; jobs run one after another (one GPU: no side-by-side pairs), and a job that
# would end after the plan's end (second argument, seconds from now) is skipped and says so in jobs.tsv.
#
# A pipeline arm in embeds mode runs the tower in vLLM's engine unless its job sets VLMSTREAM_INFER__ENGINE_TOWER=false
# (the default since [z]); lists written before then, where they set nothing, measured the tower in the consumer.
#
# Job lists (third argument):
#   tower-mps  T1 the Qwen2.5-VL-7B tower alone at 0.2 / 1 / 12.8 MP with its achieved TFLOPS (tower_flops.py)
#              A1 this code, 0.2 MP and 1 MP / 64, embeds;  B1 the code of /root/ab-tree (a whole tree of an older
#              commit, from `git archive`; without it the job is skipped), 0.2 MP / 64, embeds
#              M1 this code under CUDA MPS (gpu_bench.py --mps), 0.2 MP and 1 MP / 64, embeds
#   qwen3      T2 the Qwen2.5-VL-7B tower alone, the Triton q/k/v kernel against the compiled torch code, side by
#              side at 0.2 / 1 / 12.8 MP; the Qwen3-VL-8B config (dummy weights): Q0 gpu_engine_smoke.py (the
#              engine's image_embeds against transformers' tower, DeepStack included, bf16; text in both modes),
#              Q1 the tower alone with TFLOPS, Q2 the pipeline in both modes at 0.2 MP / 64, Q3 naive vLLM at 0.2 MP;
#              T3 the Qwen3-VL-8B tower alone, transformers' blocks against the fast ones, at 0.2 / 1 / 12.8 MP
#   models     the model-family comparisons, 64 tokens: Q0 our Qwen3-VL-8B tower (fast blocks) against transformers'
#              (bf16, DeepStack included); Q2 Qwen3-VL-8B config (dummy weights) at 0.2 MP and 1 MP: naive vLLM,
#              vLLM given image_embeds (its language model alone), the pipeline in both modes; Q3 `vllm serve` on
#              the same images and budgets; G1 Gemma 3 4B config (the generic path) at 1 MP: naive vLLM against the
#              pipeline (pixels); C5 the Qwen2.5-VL-7B tower (fast blocks, Triton q/k/v) against transformers';
#              T4 the Qwen3-VL-8B tower alone, transformers' blocks against the fast ones, with TFLOPS
#   ab         Qwen2.5-VL-7B at 0.2 MP / 64, embeds, this code (A) against /root/ab-tree (B), in the order A B B A so
#              that neither side always runs on the colder machine
#   tower-q3   the Qwen3-VL-8B tower alone at 0.2 MP, 16 and 64 images per forward, transformers' blocks against the
#              fast ones (eager, compiled, compiled with the torch q/k/v code), then profiles: is the fast blocks' cost
#              at 0.2 MP a fixed cost per forward (about 3 minutes)
#   ba         the ab list's first half in the other order, B then A (one pair, for a lease of about 10 minutes)
#   qwen3-long Qwen3-VL-8B: L1 the pipeline in both modes at 1 MP with 60 s phases; L2 `vllm serve` with 4 and 12 API
#              servers at 0.2 and 1 MP (8 is in [j]); L3 the tower alone at 0.2 MP with a profile of the fast blocks
#   embeds-q3  Qwen3-VL-8B at 0.2 MP and 1 MP / 64, 40 s phases: I2 the pipeline in embeds mode, I3 pixels mode
#              without embeddings (the faster mode in [j])
#   diagnose   D1 the Qwen3-VL-8B tower at 0.2 and 1 MP, fast (Triton q/k/v) / fast-torchqkv / fast-fp8 in two rounds,
#              the second in reverse order (in [o] a process's first compiled variant ran at half speed at 0.2 MP),
#              profiles at 0.2 MP; D2 the Qwen2.5-VL-7B tower at 1 MP, bf16 against FP8 with profiles (where FP8's
#              time goes); I2 of the embeds-q3 list, then D3 = I2 with infer.vision_qkv_kernel=torch (about 17 minutes)
#   fp8        the towers' block products in FP8 (infer.vision_fp8) against bf16: F1 the Qwen2.5-VL-7B tower and F2 the
#              Qwen3-VL-8B tower alone, fast+vllm_fa3 against fast-fp8+vllm_fa3 at 0.2 / 1 / 12.8 MP with TFLOPS;
#              F3/F4 both towers in FP8 against transformers' full model (cosines, reported: dummy weights); F5 the
#              Qwen2.5-VL-7B pipeline at 1 MP / 64, embeds, bf16 then FP8 then bf16 (40 s phases); then the
#              tower-q3 diagnostic, then the generic list (about 25 minutes in all)
#   large      Qwen2.5-VL-7B at 12.8 MP / 64, embeds, against `vllm serve` (8 API servers), alternated: X1 serve and
#              X2 the pipeline for 60 s each, X4 the pipeline under CUDA MPS and X5 serve for 5 minutes each
#              (sustained; about 24 minutes)
#   engine-tower  infer.engine_tower (our tower in vLLM's engine process), 64 tokens, with the tower's GPU ms per
#              image there from its clock: E0 gpu_engine_smoke.py, embeds mode against embeds mode with the tower in
#              the engine (pixel rows: same texts?); Qwen2.5-VL-7B at 12.8 MP (60 s): E1 the pipeline in embeds mode
#              with the tower in the engine (pixel rows), then `vllm serve` (8 API servers); at 1 MP (40 s): E2 the
#              same pair; Qwen3-VL-8B at 1 MP (40 s): Q1 the rows pipeline, then serve; in any time left E1 in
#              pixels mode with vLLM's own tower clocked (infer.tower_clock), C1 and M2 of the tower-ab and moe lists
#              (about 27 minutes; the jobs that decide the most come first)
#   rows-long  Qwen2.5-VL-7B / 64, embeds mode with our tower in vLLM's engine (pixel rows, embeddings kept there
#              for the consumer) against `vllm serve` (8 API servers): R0 gpu_engine_smoke.py, embeds mode against
#              it (same texts? embeddings' cosine?); R1 the pipeline and R2 serve at 12.8 MP for 5 minutes each
#              (sustained), then R3 and R4 the same pair at 1 MP for 60 s in any time left (about 27 minutes)
#   sustained  Qwen2.5-VL-7B / 64 (about 25 minutes): R0 gpu_engine_smoke.py, embeds mode against embeds mode with
#              our tower in vLLM's engine (same texts? embeddings' cosine?); R1 that rows pipeline, publishing the
#              engine's embeddings when R0 passed (without embeddings otherwise), and R2 `vllm serve` (8 API
#              servers) at 12.8 MP for 5 minutes each; then the tower alone at 12.8 MP on every kit image (the mix
#              gpu_bench cycles through), and TA/TB the tower at 0.2 / 1 / 12.8 MP, this code against /root/ab-tree
#   rows-q3    Qwen3-VL-8B at 0.2 MP and 1 MP / 64, 40 s phases, one lease: S1 the rows pipeline (embeds with our
#              tower in vLLM's engine), S2 `vllm serve` (8 API servers), S3 naive vLLM and vLLM given image_embeds
#              (its language model alone), S4 the pipeline in pixels mode with our tower in the engine (about 22
#              minutes)
#   small-q3   the Qwen2.5-VL-7B tower alone at 0.2 MP, each variant in a process of its own with profiles (TS1
#              fast, TS2 torch q/k/v, TS3 eager, TS4 /root/ab-tree's fast, TS5 fast twice in one process, TS6 fast
#              and torch q/k/v in one process, twice each, TS7 fast compiled without Inductor's worker pool; about 7
#              minutes), then the rows-q3 list (about 29 minutes in all: with PLAN_S 1600, S4 does not fit)
#   fixcheck   the vision blocks compiled in-process ([s]: the first encoder of a process ran three times slower at
#              0.2 MP while Inductor's compile workers started) and the gated MLP's Triton kernel ([t]), the jobs that
#              decide the most first: F1 the Qwen2.5-VL-7B tower alone at 0.2 / 1 / 12.8 MP, this code with the Triton
#              kernel and with the compiled one; C1 check_tower.py (Qwen2.5-VL-7B); F2 the tower in /root/ab-tree;
#              Qwen2.5-VL-7B at 0.2 MP / 64: P1 this code's pipeline (embeds), P3 `vllm serve`; Qwen3-VL-8B at 1 MP in
#              80-s phases: Q2 pixels mode with our tower in vLLM's engine, Q3 `vllm serve` (8 API servers); P2
#              /root/ab-tree's pipeline at 0.2 MP; M0/M2 the moe list's tower checks; K1 bench_mlp_activation.py
#              (about 27 minutes)
#   gelu-moe   after [u] (the GELU kernels on by default): G1 Qwen3-VL-8B's tower alone at 0.2 / 1 / 12.8 MP, the
#              Triton MLP kernel against the compiled one, two rounds; the towers against transformers' full models:
#              Q0 Qwen3-VL-8B, M0 Qwen3-VL-30B-A3B, M2 Qwen3.5-397B-A17B; Qwen2.5-VL-7B at 0.2 MP / 64: A1 this
#              code's pipeline, B1 /root/ab-tree's; M1 the moe list's pipeline run; then B2 and A2 (the pair in the
#              other order) in any time left (about 35 minutes: a full lease drops the tail)
#   long-small K2 bench_block_norm.py (the norms alone: Inductor's kernels against the Triton ones); V0 the
#              Qwen2.5-VL-7B tower alone at 0.2 / 1 / 12.8 MP, this code (`fast`: v handed to FA3 as a view of the
#              projection, the Triton norms) against v copied out by the q/k/v kernel (`fast-contigv`) and the
#              compiled norms (`fast-torchnorm`), two rounds; C1 and Q0 the Qwen2.5-VL-7B and Qwen3-VL-8B towers
#              against transformers' full models; then 0.2 MP / 64 in phases long enough for the steady rate
#              (120 s, not a 40-s phase's set that runs out while the pipeline ramps up): Qwen2.5-VL-7B L1 the
#              pipeline (embeds), L2 `vllm serve` (8 API servers); Qwen3-VL-8B L3 the pipeline in pixels mode with
#              our tower in vLLM's engine, L4 vLLM given image_embeds (its language model alone), L5 `vllm serve`
#              ([s] measured it at 0.2 MP: the least needed); then B2 and A2 (the gelu-moe list's A/B pair in the
#              other order) in any time left (about 24.5 minutes before L5, B2 and A2: a plan of 1,500 s skips them)
#   engine-q25 after [x] (Qwen2.5-VL-7B at 0.2 MP / 64: 1.70x `vllm serve`, its tower in the consumer's process at
#              11.8 ms of wall time per image against 2.8-2.9 alone, while Qwen3-VL-8B's ran inside vLLM's engine at
#              its speed alone): does `infer.engine_tower` lift Qwen2.5-VL at 0.2 MP? 120-s phases, one lease: E1 the
#              pipeline in embeds mode with the tower in the engine (pixel rows, embeddings published), E2 pixels
#              mode with it (no embeddings), E3 `vllm serve` (8 API servers), B2 and A2 (the gelu-moe list's A/B
#              pair in the other order; A2 is also the tower in the consumer in this lease, 40 s, as that code's
#              default), then E4 the tower in the consumer in 120 s in any time left (about 29 minutes by the jobs'
#              estimates, which [x]'s jobs ran under: a plan of 1,580 s skips E4)
#   tower-place after [y] (the tower in vLLM's engine ran 1.89x `vllm serve` at 0.2 MP, the tower in the consumer 1.70x
#              in [x]'s lease; their steady rates were within 4%, across leases): Qwen2.5-VL-7B at 0.2 MP / 64,
#              embeds mode with embeddings published, 120-s phases, the tower in the consumer (C) against the tower
#              in vLLM's engine (E) in one lease, in the order C E E C, then `vllm serve` (8 API servers) in any time
#              left (about 27 minutes by the jobs' estimates; the four pairs' jobs alone about 22)
#   engine-tower-smoke  gpu_engine_smoke.py: embeds mode, then pixels mode with our tower in vLLM's engine (same texts?
#              [p]: 1.0)
#   engine-tower-q3  Qwen3-VL-8B at 0.2 MP and 1 MP / 64, 40 s phases, our tower in vLLM's engine: the pipeline in
#              embeds mode (pixel rows; Q1), in pixels mode (Q2), then `vllm serve` (8 API servers; about 16 minutes)
#   tower-ab   the Qwen2.5-VL-7B tower alone (fast+vllm_fa3) at 0.2 / 1 / 12.8 MP, this code (A) against /root/ab-tree
#              (B, a whole older tree as in the ab list), one process each, in the order A B B A A B: the same code
#              has timed 80 and 106 ms per 12.8 MP image in different processes ([n], [o]), so one pair decides
#              nothing; then C1, C2 both towers against transformers' full model (about 12 minutes)
#   moe        Qwen3-VL-30B-A3B's config (the MoE member of the family, dummy weights): M0 our tower (fast blocks)
#              against transformers' full model (bf16, DeepStack included); M1 at 0.2 MP and 1 MP / 64: naive vLLM,
#              vLLM given image_embeds (its language model alone), the pipeline in both modes; M2 the Qwen3.5 tower
#              (Qwen3.5-397B-A17B's config) against transformers' full model (about 18 minutes)
#   qwen35-dense  Qwen3.5-27B's config (the dense Qwen3.5, dummy weights): D0 our tower (fast blocks) against
#              transformers' full model; D1 at 0.2 MP and 1 MP / 64, 60-s phases: naive vLLM, vLLM given image_embeds
#              (its language model alone), the pipeline in both modes; D2 `vllm serve` (8 API servers) at both
#              budgets (about 25 minutes: a whole lease; each 27B engine's first start takes 4-5 minutes)
#   qwen35-short  Qwen3.5-27B at 0.2 MP / 64 only: F1 the pipeline in both modes (90-s phases), then F2 naive vLLM
#              and vLLM given image_embeds (its language model alone, 60-s phases); about 21 minutes
#   qwen35-checked  the towers against transformers' full models after the kept grid parts (327822f): C1
#              Qwen2.5-VL-7B, Q0 Qwen3-VL-8B; then the qwen35-short list (F1, F2; the first lease whose engines all
#              answer the start check's one-token request), then TA the Qwen2.5-VL-7B tower alone at 0.2 / 1 / 12.8 MP
#              with TFLOPS in any time left (about 23 minutes)
#   generic    G2 the generic path (Gemma 3 4B config) at 1 MP / 64: naive vLLM against the pipeline (pixels), with
#              every arm's CPU cores and CPU ms per image (the front-end cores the issue compares)
#   generic-tiling  G3 the generic path with a tiling processor (LLaVA-OneVision-Qwen2-7B's config, `mk_model.py
#              DIR llava-onevision-7b`: 384-px tiles by grid pinpoints, up to about 7,300 image tokens) at the model's
#              own size / 64 (`--budgets default`: decode caps at what its processor keeps, naive vLLM gets the files):
#              naive vLLM against the pipeline (pixels), 60-s phases (about 10 minutes)
#   tower-queued  the towers alone at 0.2 / 1 / 12.8 MP with each timing's passes also queued back to back (one wait
#              at the end, as the pipeline's tower queues its next pass: bench_vision_tower.py's queued_* figures):
#              U1 Qwen2.5-VL-7B, U2 Qwen3-VL-8B, two rounds each, a profile of Qwen2.5-VL at 12.8 MP with the GPU's
#              idle gaps between its kernels (DEVICE GAPS: where the wall time above the kernels' goes; about 3 minutes)
#   tower-gaps the Qwen2.5-VL-7B tower alone at 1 / 12.8 MP, torch's default CUDA allocator against expandable
#              segments, one process each in the order A X X A, the first two profiled at 12.8 MP with DEVICE GAPS
#              (about 4 minutes)
#   tower-residual the block's last residual add in the MLP's last product against an add after it, both towers
#              alone at 0.2 / 1 / 12.8 MP (two rounds), both towers against transformers' full model, then Qwen2.5-VL
#              at 12.8 MP / 64: the pipeline (embeds) and `vllm serve`, 60 s each (about 15 minutes)
#   tower-fa2window  Qwen2.5-VL's window blocks through torch's varlen flash attention (FlashAttention 2), its
#              whole-image blocks through FA3, against FA3 everywhere: the attention alone, the tower alone at three
#              budgets in two rounds, the tower with it against transformers' full model (about 4 minutes)
#   serve-ratios  Qwen2.5-VL-7B / 64 with the window blocks on FA2: the pipeline (embeds) and `vllm serve` (8 API
#              servers) at 12.8 MP for 5 minutes each, then at 1 MP for 90 s each (about 24 minutes: a whole lease)
#   serve-ratios-2  Qwen2.5-VL-7B / 64 at 1 MP: the pipeline (embeds) and `vllm serve` (8 API servers) alternated,
#              P S P S, 150 s each (about 1,260 s of jobs: a whole lease)
#   serve-ratios-02  the same at 0.2 MP, 90 s each, then the pipeline once more with the tower in the consumer under
#              CUDA MPS (about 1,300 s of jobs)
#   tower-ahead  infer.tower_ahead (the engine's tower run ahead of its step on a stream of its own; [ak] ran H0-A1
#              serve, 0.2 MP only): H0 check_ahead_hooks.py (its hooks against vLLM's own types, on the CPU, seconds), A0
#              gpu_engine_smoke.py with the tower in the step, then ahead of it (same texts and embeddings?
#              how many images the step took made ahead); then Qwen2.5-VL-7B / 64, embeds with embeddings published,
#              at 0.2 MP in 90-s phases, the tower in the step (S) and ahead (A), with `vllm serve` (8 API servers,
#              V) in the middle: S A V A S (the last S about 80 s past a whole lease's 1,600 s of jobs); then at
#              1 MP A S in any time left
#   honesty    H1 `estimate_honesty.py --cases g` with the Qwen2.5-VL-7B config at 0.2 MP / 64: an estimate from a 5%
#              sample, then the whole job (26,000 documents, 82,725 images). In [m] the sample took about 250 s and
#              the run about 66 img/s with start-up (scale 14 ran 22.6 min and was cut 13 s before its end); at
#              scale 13 the run lasts about 21.4 minutes there and about 20.5 on a machine as fast as [k]'s. The
#              run stops 80 s before the plan's end (20 s here, 60 s in the script for stopping it and reading its
#              results back), so a cut run still prints what it reached; the whole lease (PLAN_S = the budget left
#              after staging less about 60 s, about 1,600 s).
#              If it fails early, the embeds-q3 list runs in the time left
#
# On the device, after unpack_device.sh:
#   setsid nohup bash benchmarks/gpu/plan_x1.sh /root/res 1500 tower-mps > /root/plan.log 2>&1 < /dev/null &
#   bash benchmarks/gpu/wait_plan.sh /root/res 540      # in each later call: waits, then copies /root/res to $OUT
set -u
RES=${1:-/root/res}
PLAN_S=${2:-1380}
LIST=${3:-tower-mps}
SNAPSHOT=/root/vlmstream-plan
if [ "$(cd "$(dirname "$0")/../.." && pwd)" != "$SNAPSHOT" ]; then
  # Later device calls refresh the working tree in place: the plan runs from a copy of it, taken now.
  rm -rf "$SNAPSHOT"; mkdir -p "$SNAPSHOT"
  (cd "$(dirname "$0")/../.." && tar cf - --exclude=./.gpu --exclude=./.venv --exclude=./.git .) | tar xf - -C "$SNAPSHOT"
  exec bash "$SNAPSHOT/benchmarks/gpu/plan_x1.sh" "$RES" "$PLAN_S" "$LIST"
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
PIPE="--seconds 40 --stop-after 1.5 --arms pipeline-embeds --profile"
# The Qwen2.5-VL-7B tower alone at the three budgets (bench_vision_tower.py), for the A/B lists.
TOWER_ARGS="--model /root/model --imgs /root/imgs --budgets 256,1280,default --variants fast+vllm_fa3 --seconds 3"
# The A/B lists' pipeline, Qwen2.5-VL-7B at 0.2 MP / 64: this code (ab_a LABEL), /root/ab-tree's (ab_b LABEL).
ab_a() { job "$1" 240 360 $BENCH --model /root/model --budgets 256 $PIPE --out "$RES/$1"; }
ab_b() { job "$1" 240 360 $IN_AB_TREE/benchmarks/gpu/gpu_bench.py \
  --imgs /root/imgs --max-tokens 64 --gpu-ids 0 --model /root/model --budgets 256 $PIPE --out "$RES/$1"; }
# A tower as this code runs it against transformers' full model on 8 kit images at 1 MP: check_tower LABEL MODEL
# EXPECTED_S (check_tower.py names the model by a config it ships or a folder).
check_tower() { job "$1" "$3" $(( $3 + 90 )) python3 benchmarks/gpu/check_tower.py --model "$2" --images /root/imgs \
  --n 8 --max-pixels 1003520 --out "$RES/$1.json"; }

if [ "$LIST" = tower-mps ]; then
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  job t1_tower 150 240 python3 benchmarks/gpu/bench_vision_tower.py --model /root/model --imgs /root/imgs \
    --variants fast+vllm_fa3 --seconds 3 --profile-budget default --out "$RES/t1_tower.json"
  job a1_this 300 420 $BENCH --model /root/model --budgets 256,1280 $PIPE --out "$RES/a1_this"
  if ab_tree_ready b1_before; then
    ab_b b1_before
  fi
  job m1_mps 300 420 $BENCH --model /root/model --budgets 256,1280 $PIPE --mps --out "$RES/m1_mps"
fi

if [ "$LIST" = honesty ]; then
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  # The job reuses 16 pictures: without this vLLM would serve their repeats from its prefix cache.
  export VLMSTREAM_INFER__ENABLE_PREFIX_CACHING=false
  job h1_honesty 1300 $(( END - $(date +%s) )) python3 benchmarks/estimate_honesty.py --cases g --images /root/imgs \
    --scale 13 --sample-fraction 0.048 --run-options "--model /root/model --max-new-tokens 64" --timeout-s 1600 \
    --deadline $(( END - 20 )) --reports "$RES"
  unset VLMSTREAM_INFER__ENABLE_PREFIX_CACHING
  # If it failed early, the rest of the lease goes to the embeds-q3 list below.
  grep -q "^h1_honesty	rc=0" "$RES/jobs.tsv" || LIST=embeds-q3
fi

if [ "$LIST" = qwen3 ]; then
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  job t2_tower_qkv 100 200 python3 benchmarks/gpu/bench_vision_tower.py --model /root/model --imgs /root/imgs \
    --variants fast-torchqkv+vllm_fa3,fast+vllm_fa3 --seconds 3 --profile-budget '' --out "$RES/t2_tower_qkv.json"
  check_tower q0_check_tower qwen3-vl-8b 120
  job t3_tower_qwen3 150 240 python3 benchmarks/gpu/bench_vision_tower.py --model qwen3-vl-8b --imgs /root/imgs \
    --variants transformers+vllm_fa3,fast+vllm_fa3 --seconds 3 --profile-budget 1280 --out "$RES/t3_tower_qwen3.json"
  job q1_engine_smoke 240 330 python3 benchmarks/gpu_engine_smoke.py --model qwen3-vl-8b --images /root/imgs --n 64 \
    --max-pixels 1003520 --tokens 64 --modes embeds,pixels --out "$RES/q1_engine_smoke.json"
  job c1_condense_shared 330 420 python3 benchmarks/gpu/bench_condense.py --imgs /root/imgs --seconds 30 --warmup 10 \
    --out "$RES/c1_condense_shared.json"
fi

if [ "$LIST" = models ]; then
  Q3=/root/qwen3-vl-8b; G3=/root/gemma3-4b
  [ -e $Q3/config.json ] || python3 benchmarks/gpu/mk_model.py $Q3 qwen3-vl-8b > "$RES/mk_q3.log" 2>&1
  [ -e $G3/config.json ] || python3 benchmarks/gpu/mk_model.py $G3 gemma3-4b > "$RES/mk_g3.log" 2>&1
  check_tower q0_check_tower qwen3-vl-8b 120
  job q2_qwen3 720 900 $BENCH --model $Q3 --budgets 256,1280 --seconds 25 --stop-after 1.5 --profile \
    --arms naive,ceiling-embeds,pipeline-embeds,pipeline-pixels --out "$RES/q2_qwen3"
  job q3_serve 200 300 $BENCH --model $Q3 --budgets 256,1280 --seconds 25 --arms serve --serve-k 8 \
    --out "$RES/q3_serve"
  job g1_gemma3 240 330 $BENCH --model $G3 --budgets 1280 --seconds 25 --stop-after 1.5 \
    --arms naive,pipeline-pixels --out "$RES/g1_gemma3"
  check_tower c5_check_qwen25 qwen2.5-vl-7b 100
  job t4_tower_qwen3 120 200 python3 benchmarks/gpu/bench_vision_tower.py --model qwen3-vl-8b --imgs /root/imgs \
    --variants transformers+vllm_fa3,fast+vllm_fa3 --seconds 3 --profile-budget '' --out "$RES/t4_tower_qwen3.json"
fi

if [ "$LIST" = ab ] || [ "$LIST" = ba ]; then
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  if ab_tree_ready ab; then
    if [ "$LIST" = ba ]; then ab_b b1_before; ab_a a1_this; else ab_a a1_this; ab_b b1_before; ab_b b2_before; ab_a a2_this; fi
  fi
fi

if [ "$LIST" = fp8 ]; then
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  job f1_tower_fp8_q25 150 240 python3 benchmarks/gpu/bench_vision_tower.py --model /root/model --imgs /root/imgs \
    --variants fast+vllm_fa3,fast-fp8+vllm_fa3 --seconds 3 --profile-budget '' --out "$RES/f1_tower_fp8_q25.json"
  job f2_tower_fp8_q3 150 240 python3 benchmarks/gpu/bench_vision_tower.py --model qwen3-vl-8b --imgs /root/imgs \
    --variants fast+vllm_fa3,fast-fp8+vllm_fa3 --seconds 3 --profile-budget '' --out "$RES/f2_tower_fp8_q3.json"
  job f3_check_fp8_q25 100 180 python3 benchmarks/gpu/check_tower.py --model qwen2.5-vl-7b --blocks fast-fp8 \
    --images /root/imgs --n 8 --max-pixels 1003520 --out "$RES/f3_check_fp8_q25.json"
  job f4_check_fp8_q3 120 200 python3 benchmarks/gpu/check_tower.py --model qwen3-vl-8b --blocks fast-fp8 \
    --images /root/imgs --n 8 --max-pixels 1003520 --out "$RES/f4_check_fp8_q3.json"
  F5="$BENCH --model /root/model --budgets 1280 --seconds 40 --stop-after 1.5 --arms pipeline-embeds --profile"
  job f5a_pipeline_bf16 200 300 $F5 --out "$RES/f5a_pipeline_bf16"
  job f5b_pipeline_fp8 200 300 env VLMSTREAM_INFER__VISION_FP8=true $F5 --out "$RES/f5b_pipeline_fp8"
  job f5c_pipeline_bf16 200 300 $F5 --out "$RES/f5c_pipeline_bf16"
  LIST=tower-q3; THEN=generic
fi

if [ "$LIST" = tower-q3 ]; then
  job l4_tower_q3_batches 150 240 python3 benchmarks/gpu/bench_vision_tower.py --model qwen3-vl-8b --imgs /root/imgs \
    --budgets 256 --batches 16,64 --variants transformers+vllm_fa3,fast-eager+vllm_fa3,fast+vllm_fa3,fast-torchqkv+vllm_fa3 \
    --seconds 2 --profile-budget 256 --out "$RES/l4_tower_q3_batches.json"
  if [ "${THEN:-}" = generic ]; then LIST=generic; fi
fi

if [ "$LIST" = diagnose ]; then
  # In [o] a process's first compiled variant of the Qwen3-VL tower ran at half speed at 0.2 MP until a second one
  # was compiled. Two rounds, the second in reverse order, with each timed pass's spread; then where FP8 loses.
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  job d1_tower_q3_order 150 240 python3 benchmarks/gpu/bench_vision_tower.py --model qwen3-vl-8b --imgs /root/imgs \
    --budgets 256,1280 --variants fast+vllm_fa3,fast-torchqkv+vllm_fa3,fast-fp8+vllm_fa3 --rounds 2 --seconds 2 \
    --profile-budget 256 --out "$RES/d1_tower_q3_order.json"
  job d2_tower_fp8_profile 90 180 python3 benchmarks/gpu/bench_vision_tower.py --model /root/model --imgs /root/imgs \
    --budgets 1280 --variants fast+vllm_fa3,fast-fp8+vllm_fa3 --seconds 2 --profile-budget 1280 \
    --out "$RES/d2_tower_fp8_profile.json"
  # Qwen3-VL-8B's pipeline at 0.2 and 1 MP, embeds: image_embeds through CUDA IPC, through host copies, and host
  # copies with the torch q/k/v code in the tower (does D1's difference reach the pipeline).
  Q3=/root/qwen3-vl-8b
  [ -e $Q3/config.json ] || python3 benchmarks/gpu/mk_model.py $Q3 qwen3-vl-8b > "$RES/mk_q3.log" 2>&1
  Q3PIPE="--model $Q3 --budgets 256,1280 --seconds 40 --stop-after 2 --profile --arms pipeline-embeds"
  job i2_embeds_host 330 450 $BENCH $Q3PIPE --out "$RES/i2_embeds_host"
  job d3_embeds_host_torchqkv 330 450 env VLMSTREAM_INFER__VISION_QKV_KERNEL=torch $BENCH $Q3PIPE \
    --out "$RES/d3_embeds_host_torchqkv"
fi

if [ "$LIST" = large ]; then
  # 12.8 MP (the model's default budget: the kit's images at their own size), Qwen2.5-VL-7B, 64 tokens, embeds:
  # `vllm serve` and the pipeline alternated; X4 and X5 run 5 minutes each (sustained), X4 under MPS so that the
  # tower and vLLM's engine share the GPU instead of time-slicing it.
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  LARGE="$BENCH --model /root/model --budgets default"
  LPIPE="--stop-after 1.5 --arms pipeline-embeds --profile"
  job x1_serve 200 330 $LARGE --seconds 60 --arms serve --serve-k 8 --out "$RES/x1_serve"
  job x2_pipeline 220 330 $LARGE --seconds 60 $LPIPE --out "$RES/x2_pipeline"
  job x4_pipeline_mps_5min 480 620 $LARGE --seconds 300 --stop-after 1.2 --arms pipeline-embeds --profile --mps \
    --out "$RES/x4_pipeline_mps_5min"
  job x5_serve_5min 450 600 $LARGE --seconds 300 --arms serve --serve-k 8 --out "$RES/x5_serve_5min"
fi

if [ "$LIST" = engine-tower ]; then
  # Each pipeline job's pipeline-*.log says whether vLLM's engine took the tower ("vLLM's engine process,
  # vlmstream's tower wrapper: {...}") and, at its end, the tower's GPU ms per image there (its clock); the phase
  # record's tower_tflops_in_engine comes from that clock. [p] found the pipeline at 12.8 MP in pixels mode with our
  # tower in the engine no faster than serve (2.75 img/s, float32 pixels); embeds mode with it sends the decoded
  # images there as uint8 pixel rows (an eighth of those bytes, no processor on the CPU).
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  Q3=/root/qwen3-vl-8b
  [ -e $Q3/config.json ] || python3 benchmarks/gpu/mk_model.py $Q3 qwen3-vl-8b > "$RES/mk_q3.log" 2>&1
  ET="env VLMSTREAM_INFER__ENGINE_TOWER=true"
  VT="env VLMSTREAM_INFER__TOWER_CLOCK=true"  # vLLM's own tower, clocked the same way
  # Does the engine take pixel rows: the same 16 images at 1 MP, embeds mode with our tower here, then in the engine.
  job e0_smoke_rows 200 330 python3 benchmarks/gpu_engine_smoke.py --images /root/imgs --n 16 \
    --modes embeds,embeds-engine-tower --out "$RES/e0_smoke_rows.json"
  job e1_rows 220 330 $ET $BENCH --model /root/model --budgets default --seconds 60 --stop-after 1.5 \
    --arms pipeline-embeds --profile --out "$RES/e1_rows"
  job e1_serve 200 330 $BENCH --model /root/model --budgets default --seconds 60 --arms serve --serve-k 8 \
    --out "$RES/e1_serve"
  job e2_rows_1mp 180 330 $ET $BENCH --model /root/model --budgets 1280 --seconds 40 --stop-after 1.5 \
    --arms pipeline-embeds --profile --out "$RES/e2_rows_1mp"
  job e2_serve_1mp 180 330 $BENCH --model /root/model --budgets 1280 --seconds 40 --arms serve --serve-k 8 \
    --out "$RES/e2_serve_1mp"
  # Qwen3-VL-8B: [j] tied serve at 1 MP (24.27 against 24.30 img/s); its image_embeds with three DeepStack levels
  # take 32,768 bytes per visual token, its pixel rows 3,072.
  job q1_rows_1mp 200 330 $ET $BENCH --model $Q3 --budgets 1280 --seconds 40 --stop-after 1.5 \
    --arms pipeline-embeds --profile --out "$RES/q1_rows_1mp"
  job q1_serve_1mp 180 300 $BENCH --model $Q3 --budgets 1280 --seconds 40 --arms serve --serve-k 8 \
    --out "$RES/q1_serve_1mp"
  # In any time left (each skipped when it would overrun).
  job e1_vllm_tower 220 330 $VT $BENCH --model /root/model --budgets default --seconds 60 --stop-after 1.5 \
    --arms pipeline-pixels --profile --out "$RES/e1_vllm_tower"
  check_tower c1_check_tower_q25 qwen2.5-vl-7b 100
  check_tower m2_check_tower_qwen35 qwen3.5-397b-a17b 150
fi

if [ "$LIST" = rows-long ]; then
  # [q] measured the rows pipeline (without embeddings) at 1.14x serve at 12.8 MP in 60-s phases; the issue asks
  # for five minutes. The pipeline arms here publish embeddings, which the engine keeps for the consumer.
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  ROWS="env VLMSTREAM_INFER__ENGINE_TOWER=true $BENCH --model /root/model --arms pipeline-embeds --profile"
  job r0_smoke_rows 200 330 python3 benchmarks/gpu_engine_smoke.py --images /root/imgs --n 16 \
    --modes embeds,embeds-engine-tower --out "$RES/r0_smoke_rows.json"
  job r1_rows_5min 480 620 $ROWS --budgets default --seconds 300 --stop-after 1.2 --out "$RES/r1_rows_5min"
  job r2_serve_5min 470 600 $BENCH --model /root/model --budgets default --seconds 300 --arms serve --serve-k 8 \
    --out "$RES/r2_serve_5min"
  job r3_rows_1mp 200 330 $ROWS --budgets 1280 --seconds 60 --stop-after 1.5 --out "$RES/r3_rows_1mp"
  job r4_serve_1mp 200 330 $BENCH --model /root/model --budgets 1280 --seconds 60 --arms serve --serve-k 8 \
    --out "$RES/r4_serve_1mp"
fi

if [ "$LIST" = sustained ]; then
  # [q] measured the rows pipeline at 1.14x serve at 12.8 MP in 60-s phases, whose first window ran at half the
  # last (the engine fills); the issue asks for five minutes. R1 publishes the engine's embeddings only when R0 found
  # them equal to embeds mode's: a tap that fails would stall R1's five minutes on retriable failures.
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  # SUSTAINED_EMB=true|false skips R0 when the same code's R0 is on record (its verdict, given by hand).
  if [ -n "${SUSTAINED_EMB:-}" ]; then
    EMB=$SUSTAINED_EMB
  else
    job r0_smoke_rows 230 330 python3 benchmarks/gpu_engine_smoke.py --images /root/imgs --n 16 \
      --modes embeds,embeds-engine-tower --out "$RES/r0_smoke_rows.json"
    EMB=$(python3 -c "import json; r = json.load(open('$RES/r0_smoke_rows.json'));
print('true' if r.get('embeds-engine-tower_embeddings_vs_embeds', {}).get('pass') else 'false')" 2>/dev/null || echo false)
  fi
  echo "$EMB" > "$RES/r1_publish_embeddings.txt"
  job r1_rows_5min 540 620 env VLMSTREAM_INFER__ENGINE_TOWER=true VLMSTREAM_INFER__PUBLISH_EMBEDDINGS=$EMB \
    $BENCH --model /root/model --arms pipeline-embeds --profile --budgets default --seconds 300 --stop-after 1.2 \
    --out "$RES/r1_rows_5min"
  job r2_serve_5min 510 600 $BENCH --model /root/model --budgets default --seconds 300 --arms serve --serve-k 8 \
    --out "$RES/r2_serve_5min"
  job t_all_12mp 70 150 python3 benchmarks/gpu/bench_vision_tower.py --model /root/model --imgs /root/imgs \
    --budgets default --images all --variants fast+vllm_fa3 --seconds 3 --profile-budget '' --out "$RES/t_all_12mp.json"
  if ab_tree_ready tower-ab; then
    job ta1 70 150 python3 benchmarks/gpu/bench_vision_tower.py $TOWER_ARGS --profile-budget '' --out "$RES/ta1.json"
    job tb1 70 150 $IN_AB_TREE/benchmarks/gpu/bench_vision_tower.py $TOWER_ARGS --profile-budget '' --out "$RES/tb1.json"
    job tb2 70 150 $IN_AB_TREE/benchmarks/gpu/bench_vision_tower.py $TOWER_ARGS --profile-budget '' --out "$RES/tb2.json"
    job ta2 70 150 python3 benchmarks/gpu/bench_vision_tower.py $TOWER_ARGS --profile-budget '' --out "$RES/ta2.json"
  fi
fi

if [ "$LIST" = small-q3 ]; then
  # [r]: at 0.2 MP this code's tower alone took 11-12 ms per image against 3f19f77's 4.2-4.7, in every process, while
  # it was faster at 1 and 12.8 MP. Which part makes it slow: each variant in a process of its own (the order effect
  # of [o] cannot mix them), profiled in the state that was timed (the process's first encoder), the CPU table saying
  # where the launching thread's time goes. A pipeline has one encoder per process: the first.
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  SMALL="--model /root/model --imgs /root/imgs --budgets 256 --seconds 3 --profile-budget 256"
  TOWER_SMALL="python3 benchmarks/gpu/bench_vision_tower.py $SMALL"
  # Who else uses the host's cores while TS1 compiles and times (Inductor's compile workers?): a snapshot every 4 s.
  ( for _ in $(seq 20); do sleep 4; echo "== $(date +%T)"; top -b -n 1 -w 200 | head -22; done \
    > "$RES/ts1_top.txt" 2>&1 ) &
  job ts1_fast 45 120 $TOWER_SMALL --variants fast+vllm_fa3 --out "$RES/ts1.json"
  job ts2_torchqkv 45 120 $TOWER_SMALL --variants fast-torchqkv+vllm_fa3 --out "$RES/ts2.json"
  job ts3_eager 30 120 $TOWER_SMALL --variants fast-eager+vllm_fa3 --out "$RES/ts3.json"
  if ab_tree_ready ts4_b; then
    job ts4_b 45 120 $IN_AB_TREE/benchmarks/gpu/bench_vision_tower.py $SMALL --variants fast+vllm_fa3 \
      --out "$RES/ts4.json"
  fi
  # [p]: at 0.2 MP the second encoder of the same variant in one process ran three times as fast as the first.
  job ts5_fast_twice 60 150 $TOWER_SMALL --variants fast+vllm_fa3 --rounds 2 --out "$RES/ts5.json"
  # [o] P2: once a second variant had been compiled in the process, both ran at full speed. Still so at this code?
  job ts6_both 60 150 $TOWER_SMALL --variants fast+vllm_fa3,fast-torchqkv+vllm_fa3 --rounds 2 --out "$RES/ts6.json"
  # The same, with Inductor compiling in this process (no pool of compile workers left beside the timing).
  job ts7_one_compile_thread 100 240 env TORCHINDUCTOR_COMPILE_THREADS=1 $TOWER_SMALL --variants fast+vllm_fa3 \
    --out "$RES/ts7.json"
  LIST=rows-q3
fi

if [ "$LIST" = fixcheck ]; then
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  # The jobs that decide the most come first; a short lease drops the tail (jobs.tsv says which).
  # F1's profile at 12.8 MP: where the tower's time goes now ([o]: elementwise kernels a fifth of it). Beside this
  # code's default (the gated MLP's Triton kernel), the compiled kernel (infer.vision_mlp_kernel=torch), two rounds.
  job f1_tower_a 100 240 python3 benchmarks/gpu/bench_vision_tower.py $TOWER_ARGS --rounds 2 \
    --variants fast+vllm_fa3,fast-torchmlp+vllm_fa3 --profile-budget default --out "$RES/f1_tower_a.json"
  # The tower as this code runs it (the gated MLP's Triton kernel included) against transformers' full model.
  check_tower c1_check_tower_q25 qwen2.5-vl-7b 100
  if ab_tree_ready f2_tower_b; then
    job f2_tower_b 50 150 $IN_AB_TREE/benchmarks/gpu/bench_vision_tower.py $TOWER_ARGS --profile-budget '' \
      --out "$RES/f2_tower_b.json"
  fi
  ab_a p1_this
  job p3_serve 180 300 $BENCH --model /root/model --budgets 256 --seconds 40 --arms serve --serve-k 8 \
    --out "$RES/p3_serve"
  # [s]: a phase's first window ran at a fraction of its last (each request spends some 10 s in the engine), so 40-s
  # phases understate a pipeline that holds more requests in flight than serve does; 80-s phases here, at 1 MP only
  # (at 0.2 MP [s] met the targets against serve and naive).
  Q3=/root/qwen3-vl-8b
  [ -e $Q3/config.json ] || python3 benchmarks/gpu/mk_model.py $Q3 qwen3-vl-8b > "$RES/mk_q3.log" 2>&1
  job q2_engine_tower_pixels 190 360 env VLMSTREAM_INFER__ENGINE_TOWER=true $BENCH --model $Q3 --budgets 1280 \
    --seconds 80 --stop-after 1.5 --profile --arms pipeline-pixels --out "$RES/q2_engine_tower_pixels"
  job q3_serve 190 360 $BENCH --model $Q3 --budgets 1280 --seconds 80 --arms serve --serve-k 8 \
    --out "$RES/q3_serve"
  if ab_tree_ready p2_before; then
    ab_b p2_before
  fi
  # The MoE member's and Qwen3.5's towers against transformers' full models (the moe list's M0 and M2).
  check_tower m0_check_tower_moe qwen3-vl-30b-a3b 150
  check_tower m2_check_tower_qwen35 qwen3.5-397b-a17b 150
  # In any time left: the MLP activations alone, Inductor's kernels against the Triton ones ([t]: the gated MLP's).
  job k1_mlp_activation 50 120 python3 benchmarks/gpu/bench_mlp_activation.py --out "$RES/k1_mlp_activation.json"
fi

if [ "$LIST" = gelu-moe ]; then
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  # [u]: alone, the Triton GELU ran 2.0x Inductor's kernel; what is it worth in Qwen3-VL-8B's tower (two rounds)?
  job g1_tower_q3_mlp 110 240 python3 benchmarks/gpu/bench_vision_tower.py --model qwen3-vl-8b --imgs /root/imgs \
    --budgets 256,1280,default --variants fast+vllm_fa3,fast-torchmlp+vllm_fa3 --seconds 3 --rounds 2 \
    --profile-budget '' --out "$RES/g1_tower_q3_mlp.json"
  # The towers as this code runs them (Triton GELU included) against transformers' full models.
  check_tower q0_check_tower_q3 qwen3-vl-8b 120
  check_tower m0_check_tower_moe qwen3-vl-30b-a3b 150
  check_tower m2_check_tower_qwen35 qwen3.5-397b-a17b 150
  # Qwen2.5-VL-7B at 0.2 MP / 64, this code's pipeline against 3f19f77's, in both orders as time allows.
  if ab_tree_ready ab; then ab_a a1_this; ab_b b1_before; fi
  QM=/root/qwen3-vl-30b-a3b
  [ -e $QM/config.json ] || python3 benchmarks/gpu/mk_model.py $QM qwen3-vl-30b-a3b > "$RES/mk_qm.log" 2>&1
  job m1_moe 600 780 $BENCH --model $QM --budgets 256,1280 --seconds 25 --stop-after 1.5 --profile \
    --arms naive,ceiling-embeds,pipeline-embeds,pipeline-pixels --out "$RES/m1_moe"
  if ab_tree_ready ab; then ab_b b2_before; ab_a a2_this; fi
fi

if [ "$LIST" = long-small ]; then
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  # Are v as a view (the q/k/v kernel a third lighter) and the one-pass norms faster in the tower, and is its
  # output still transformers'?
  job k2_block_norm 30 90 python3 benchmarks/gpu/bench_block_norm.py --out "$RES/k2_block_norm.json"
  job v0_tower_v_norm 150 300 python3 benchmarks/gpu/bench_vision_tower.py --model /root/model --imgs /root/imgs \
    --budgets 256,1280,default --variants fast+vllm_fa3,fast-contigv+vllm_fa3,fast-torchnorm+vllm_fa3 --seconds 3 \
    --rounds 2 --profile-budget default --out "$RES/v0_tower_v_norm.json"
  check_tower c1_check_tower_q25 qwen2.5-vl-7b 40
  check_tower q0_check_tower_q3 qwen3-vl-8b 40
  # [u]/[v]: a 40-s phase's 4,000 documents ran out in 51-55 s while the pipeline still ramped up (first window
  # 47-52 img/s, last 115-124); 120-s phases ask whether the steady rate is 2x serve.
  LONG="--budgets 256 --seconds 120"
  job l1_pipeline 330 450 $BENCH --model /root/model $LONG --stop-after 1.5 --arms pipeline-embeds --profile \
    --out "$RES/l1_pipeline"
  job l2_serve 260 380 $BENCH --model /root/model $LONG --arms serve --serve-k 8 --out "$RES/l2_serve"
  Q3=/root/qwen3-vl-8b
  [ -e $Q3/config.json ] || python3 benchmarks/gpu/mk_model.py $Q3 qwen3-vl-8b > "$RES/mk_q3.log" 2>&1
  job l3_q3_pixels 330 450 env VLMSTREAM_INFER__ENGINE_TOWER=true $BENCH --model $Q3 $LONG --stop-after 1.5 \
    --arms pipeline-pixels --profile --out "$RES/l3_q3_pixels"
  job l4_q3_lm_alone 280 400 $BENCH --model $Q3 $LONG --arms ceiling-embeds --out "$RES/l4_q3_lm_alone"
  job l5_q3_serve 260 380 $BENCH --model $Q3 $LONG --arms serve --serve-k 8 --out "$RES/l5_q3_serve"
  if ab_tree_ready ab; then ab_b b2_before; ab_a a2_this; fi
fi

if [ "$LIST" = engine-q25 ]; then
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  LONG="--model /root/model --budgets 256 --seconds 120"
  ET="env VLMSTREAM_INFER__ENGINE_TOWER=true"
  job e1_engine_tower_embeds 330 450 $ET $BENCH $LONG --stop-after 1.5 --arms pipeline-embeds --profile \
    --out "$RES/e1_engine_tower_embeds"
  job e2_engine_tower_pixels 330 450 $ET $BENCH $LONG --stop-after 1.5 --arms pipeline-pixels --profile \
    --out "$RES/e2_engine_tower_pixels"
  job e3_serve 260 380 $BENCH $LONG --arms serve --serve-k 8 --out "$RES/e3_serve"
  # The A/B pair before the last long job, which the plan's clock cuts first: A2 is also this lease's figure for
  # the tower in the consumer (a 40-s phase).
  if ab_tree_ready ab; then ab_b b2_before; ab_a a2_this; fi
  job e4_consumer_tower 330 450 env VLMSTREAM_INFER__ENGINE_TOWER=false $BENCH $LONG --stop-after 1.5 --arms pipeline-embeds --profile \
    --out "$RES/e4_consumer_tower"
fi

if [ "$LIST" = tower-place ]; then
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  LONG="--model /root/model --budgets 256 --seconds 120 --stop-after 1.5 --arms pipeline-embeds --profile"
  # In the order C E E C, so that neither place always runs on the colder or the hotter machine.
  job p1_consumer_tower 330 450 env VLMSTREAM_INFER__ENGINE_TOWER=false $BENCH $LONG --out "$RES/p1_consumer_tower"
  job p2_engine_tower 330 450 env VLMSTREAM_INFER__ENGINE_TOWER=true $BENCH $LONG --out "$RES/p2_engine_tower"
  job p3_engine_tower 330 450 env VLMSTREAM_INFER__ENGINE_TOWER=true $BENCH $LONG --out "$RES/p3_engine_tower"
  job p4_consumer_tower 330 450 env VLMSTREAM_INFER__ENGINE_TOWER=false $BENCH $LONG --out "$RES/p4_consumer_tower"
  job p5_serve 260 380 $BENCH --model /root/model --budgets 256 --seconds 120 --arms serve --serve-k 8 \
    --out "$RES/p5_serve"
fi

if [ "$LIST" = rows-q3 ]; then
  Q3=/root/qwen3-vl-8b
  [ -e $Q3/config.json ] || python3 benchmarks/gpu/mk_model.py $Q3 qwen3-vl-8b > "$RES/mk_q3.log" 2>&1
  Q3B="$BENCH --model $Q3 --budgets 256,1280 --seconds 40"
  ET="env VLMSTREAM_INFER__ENGINE_TOWER=true"
  job s1_rows 330 450 $ET $Q3B --stop-after 1.5 --profile --arms pipeline-embeds --out "$RES/s1_rows"
  job s2_serve 250 360 $Q3B --arms serve --serve-k 8 --out "$RES/s2_serve"
  job s3_naive_lm 330 450 $Q3B --arms naive,ceiling-embeds --out "$RES/s3_naive_lm"
  job s4_engine_tower_pixels 330 450 $ET $Q3B --stop-after 1.5 --profile --arms pipeline-pixels \
    --out "$RES/s4_engine_tower_pixels"
fi

if [ "$LIST" = engine-tower-smoke ]; then
  # Does vLLM's engine take the tower: 16 images at 1 MP through VllmEngine in embeds mode (our tower here), then in
  # pixels mode with our tower in vLLM's engine; equal texts (same seeded tower and language model) say it ran ours
  # ([p]: 1.0).
  job e0_smoke_engine_tower 250 360 python3 benchmarks/gpu_engine_smoke.py --images /root/imgs --n 16 \
    --modes embeds,pixels-engine-tower --out "$RES/e0_smoke_engine_tower.json"
fi

if [ "$LIST" = engine-tower-q3 ]; then
  Q3=/root/qwen3-vl-8b
  [ -e $Q3/config.json ] || python3 benchmarks/gpu/mk_model.py $Q3 qwen3-vl-8b > "$RES/mk_q3.log" 2>&1
  Q3P="--model $Q3 --budgets 256,1280 --seconds 40 --stop-after 2 --profile"
  # Embeds mode with the tower in the engine sends 3,072 bytes per visual token (pixel rows) where image_embeds with
  # three DeepStack levels take 32,768: the cost that put embeds mode behind pixels mode for this model in [j].
  job q1_rows 330 450 env VLMSTREAM_INFER__ENGINE_TOWER=true $BENCH $Q3P --arms pipeline-embeds --out "$RES/q1_rows"
  job q2_engine_tower 330 450 env VLMSTREAM_INFER__ENGINE_TOWER=true $BENCH $Q3P --arms pipeline-pixels \
    --out "$RES/q2_engine_tower"
  job q3_serve 200 300 $BENCH --model $Q3 --budgets 256,1280 --seconds 40 --arms serve --serve-k 8 --out "$RES/q3_serve"
fi

if [ "$LIST" = tower-ab ]; then
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  if ab_tree_ready tower-ab; then
    tower_a() { job "$1" 70 150 python3 benchmarks/gpu/bench_vision_tower.py $TOWER_ARGS --profile-budget '' \
      --out "$RES/$1.json"; }
    tower_b() { job "$1" 70 150 $IN_AB_TREE/benchmarks/gpu/bench_vision_tower.py $TOWER_ARGS --profile-budget '' \
      --out "$RES/$1.json"; }
    tower_a ta1; tower_b tb1; tower_b tb2; tower_a ta2; tower_a ta3; tower_b tb3
  fi
  # The tower as this code runs it against transformers' full model, both families' released configs.
  check_tower c1_check_tower_q25 qwen2.5-vl-7b 100
  check_tower c2_check_tower_q3 qwen3-vl-8b 120
fi

if [ "$LIST" = moe ]; then
  QM=/root/qwen3-vl-30b-a3b
  [ -e $QM/config.json ] || python3 benchmarks/gpu/mk_model.py $QM qwen3-vl-30b-a3b > "$RES/mk_qm.log" 2>&1
  check_tower m0_check_tower_moe qwen3-vl-30b-a3b 150
  check_tower m2_check_tower_qwen35 qwen3.5-397b-a17b 150
  job m1_moe 720 900 $BENCH --model $QM --budgets 256,1280 --seconds 25 --stop-after 1.5 --profile \
    --arms naive,ceiling-embeds,pipeline-embeds,pipeline-pixels --out "$RES/m1_moe"
fi

if [ "$LIST" = qwen35-dense ]; then
  Q5=/root/qwen3.5-27b
  [ -e $Q5/config.json ] || python3 benchmarks/gpu/mk_model.py $Q5 qwen3.5-27b > "$RES/mk_q5.log" 2>&1
  check_tower d0_check_tower_qwen35_27b qwen3.5-27b 150
  job d1_qwen35_27b 1000 1200 $BENCH --model $Q5 --budgets 256,1280 --seconds 60 --stop-after 1.5 --profile \
    --start-limit 600 --arms naive,ceiling-embeds,pipeline-embeds,pipeline-pixels --out "$RES/d1_qwen35_27b"
  job d2_qwen35_27b_serve 450 700 $BENCH --model $Q5 --budgets 256,1280 --seconds 60 --arms serve --serve-k 8 \
    --start-limit 600 --out "$RES/d2_qwen35_27b_serve"
fi

if [ "$LIST" = qwen35-checked ]; then
  check_tower c1_check_tower_q25 qwen2.5-vl-7b 60
  check_tower q0_check_tower_q3 qwen3-vl-8b 60
  LIST=qwen35-short; THEN_TOWER=1
fi

if [ "$LIST" = qwen35-short ]; then
  # A 27B engine's first start on a fresh machine took 225-267 s with its compile ([aa]), so a start limit of 600 s;
  # at 0.2 MP vLLM's 1,024 seats hold an image about 18 s, so a phase shorter than a minute measures only the fill.
  Q5=/root/qwen3.5-27b
  [ -e $Q5/config.json ] || python3 benchmarks/gpu/mk_model.py $Q5 qwen3.5-27b > "$RES/mk_q5.log" 2>&1
  job f1_qwen35_27b_pipeline 800 1000 $BENCH --model $Q5 --budgets 256 --seconds 90 --stop-after 1.5 --profile \
    --start-limit 600 --arms pipeline-embeds,pipeline-pixels --out "$RES/f1_qwen35_27b_pipeline"
  job f2_qwen35_27b_offline 420 560 $BENCH --model $Q5 --budgets 256 --seconds 60 --start-limit 600 \
    --arms naive,ceiling-embeds --out "$RES/f2_qwen35_27b_offline"
fi

if [ "${THEN_TOWER:-0}" = 1 ]; then
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  job ta_tower_q25 70 150 python3 benchmarks/gpu/bench_vision_tower.py $TOWER_ARGS --profile-budget '' \
    --out "$RES/ta_tower_q25.json"
fi

if [ "$LIST" = generic ]; then
  G3=/root/gemma3-4b
  [ -e $G3/config.json ] || python3 benchmarks/gpu/mk_model.py $G3 gemma3-4b > "$RES/mk_g3.log" 2>&1
  job g2_generic_cores 330 450 $BENCH --model $G3 --budgets 1280 --seconds 25 --stop-after 1.5 \
    --arms naive,pipeline-pixels --out "$RES/g2_generic_cores"
fi

if [ "$LIST" = tower-queued ]; then
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  job u1_tower_q25 60 150 python3 benchmarks/gpu/bench_vision_tower.py $TOWER_ARGS --rounds 2 \
    --profile-budget default --out "$RES/u1_tower_q25.json"
  job u2_tower_q3 60 150 python3 benchmarks/gpu/bench_vision_tower.py --model qwen3-vl-8b --imgs /root/imgs \
    --budgets 256,1280,default --variants fast+vllm_fa3 --seconds 3 --rounds 2 --profile-budget '' \
    --out "$RES/u2_tower_q3.json"
fi

if [ "$LIST" = tower-gaps ]; then
  # The Qwen2.5-VL-7B tower alone at 1 and 12.8 MP, each process profiled at 12.8 MP (DEVICE GAPS), with torch's
  # default CUDA allocator (A) and with expandable segments (X), in the order A X X A: an allocator that grows or
  # frees its blocks for each new image size can stall the GPU between kernels, which a queued pass cannot hide.
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  GAPS_ARGS="--model /root/model --imgs /root/imgs --budgets 1280,default --variants fast+vllm_fa3 --seconds 3"
  EXPANDABLE="env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
  job g1_default 50 150 python3 benchmarks/gpu/bench_vision_tower.py $GAPS_ARGS --profile-budget default \
    --out "$RES/g1_default.json"
  job g2_expandable 50 150 $EXPANDABLE python3 benchmarks/gpu/bench_vision_tower.py $GAPS_ARGS \
    --profile-budget default --out "$RES/g2_expandable.json"
  job g3_expandable 50 150 $EXPANDABLE python3 benchmarks/gpu/bench_vision_tower.py $GAPS_ARGS \
    --profile-budget '' --out "$RES/g3_expandable.json"
  job g4_default 50 150 python3 benchmarks/gpu/bench_vision_tower.py $GAPS_ARGS --profile-budget '' \
    --out "$RES/g4_default.json"
fi

if [ "$LIST" = tower-residual ]; then
  # The block's last residual add in the MLP's last product (cuBLAS beta = 1, in place) against the add after it
  # (fast-addafter), both towers, one process each, two rounds (the second reversed); then both towers against
  # transformers' full model; then Qwen2.5-VL-7B at 12.8 MP / 64, the pipeline (embeds) and `vllm serve` (8 API
  # servers), 60 s each, in any time left.
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  job r1_tower_q25 90 200 python3 benchmarks/gpu/bench_vision_tower.py --model /root/model --imgs /root/imgs \
    --budgets 256,1280,default --variants fast+vllm_fa3,fast-addafter+vllm_fa3 --seconds 3 --rounds 2 \
    --profile-budget default --out "$RES/r1_tower_q25.json"
  job r2_tower_q3 90 200 python3 benchmarks/gpu/bench_vision_tower.py --model qwen3-vl-8b --imgs /root/imgs \
    --budgets 256,1280,default --variants fast+vllm_fa3,fast-addafter+vllm_fa3 --seconds 3 --rounds 2 \
    --profile-budget '' --out "$RES/r2_tower_q3.json"
  check_tower c1_check_qwen25 qwen2.5-vl-7b 100
  check_tower c2_check_qwen3 qwen3-vl-8b 120
  LARGE="$BENCH --model /root/model --budgets default"
  job x2_pipeline 220 330 $LARGE --seconds 60 --stop-after 1.5 --arms pipeline-embeds --profile \
    --out "$RES/x2_pipeline"
  job x1_serve 200 330 $LARGE --seconds 60 --arms serve --serve-k 8 --out "$RES/x1_serve"
fi

if [ "$LIST" = tower-fa2window ]; then
  # Qwen2.5-VL's window blocks through torch's varlen flash attention (FlashAttention 2, the default) and its
  # whole-image blocks through FA3, against FA3 everywhere (fast-fa3window): the attention alone (the 64-patch
  # windows, both kernels' packed calls), the tower alone at three budgets in two rounds, and the tower against
  # transformers' full model.
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  job a1_attention 30 120 python3 benchmarks/gpu/bench_attention.py --head-dims 80 --lengths 1024 \
    --out "$RES/a1_attention.json"
  job w1_tower_q25 90 200 python3 benchmarks/gpu/bench_vision_tower.py --model /root/model --imgs /root/imgs \
    --budgets 256,1280,default --variants fast-fa3window+vllm_fa3,fast+vllm_fa3 --seconds 3 --rounds 2 \
    --profile-budget '' --out "$RES/w1_tower_q25.json"
  check_tower c1_check_qwen25 qwen2.5-vl-7b 100
fi

if [ "$LIST" = serve-ratios ]; then
  # Qwen2.5-VL-7B / 64 with the window blocks on FA2 (37ac1ca): at 12.8 MP the pipeline (embeds) and `vllm serve`
  # (8 API servers) for 5 minutes each (sustained), then at 1 MP for 90 s each.
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  MID="$BENCH --model /root/model --budgets 1280"
  LARGE="$BENCH --model /root/model --budgets default"
  job s3_pipeline_5min 480 620 $LARGE --seconds 300 --stop-after 1.2 --arms pipeline-embeds --profile \
    --out "$RES/s3_pipeline_5min"
  job s4_serve_5min 450 600 $LARGE --seconds 300 --arms serve --serve-k 8 --out "$RES/s4_serve_5min"
  job s1_pipeline_1mp 250 360 $MID --seconds 90 --stop-after 1.5 --arms pipeline-embeds --profile \
    --out "$RES/s1_pipeline_1mp"
  job s2_serve_1mp 230 360 $MID --seconds 90 --arms serve --serve-k 8 --out "$RES/s2_serve_1mp"
fi

# alternated_pairs TAG BUDGET SECONDS STOP_AFTER PIPELINE_S SERVE_S: Qwen2.5-VL-7B / 64 with the code's defaults, the
# pipeline (embeds) and `vllm serve` (8 API servers) alternated at one budget, pipeline, serve, pipeline, serve; each
# job expected to take PIPELINE_S or SERVE_S. Both report the steady rate between their first and last windows
# (rates.py), so the ratio table holds the whole-phase ratio and the steady one.
alternated_pairs() {
  local tag=$1 budget=$2 seconds=$3 stop_after=$4 pipeline_s=$5 serve_s=$6 k
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  for k in 1 2; do
    job "${tag}${k}_pipeline" "$pipeline_s" $(( pipeline_s + 100 )) $BENCH --model /root/model --budgets "$budget" \
      --seconds "$seconds" --stop-after "$stop_after" --arms pipeline-embeds --profile --out "$RES/${tag}${k}_pipeline"
    job "${tag}${k}_serve" "$serve_s" $(( serve_s + 100 )) $BENCH --model /root/model --budgets "$budget" \
      --seconds "$seconds" --arms serve --serve-k 8 --out "$RES/${tag}${k}_serve"
  done
}
[ "$LIST" = serve-ratios-2 ] && alternated_pairs t_1mp 1280 150 1.3 350 280
if [ "$LIST" = serve-ratios-02 ]; then
  alternated_pairs u_02mp 256 90 1.5 280 230
  # The tower in the consumer's process under CUDA MPS, so that it runs beside vLLM's language model instead of
  # before it in the engine's step: whether overlapping the two beats the default at 0.2 MP.
  job u3_pipeline_mps_02mp 280 380 env VLMSTREAM_INFER__ENGINE_TOWER=false $BENCH --model /root/model --budgets 256 \
    --seconds 90 --stop-after 1.5 --arms pipeline-embeds --profile --mps --out "$RES/u3_pipeline_mps_02mp"
fi

if [ "$LIST" = tower-ahead ]; then
  [ -e /root/model/config.json ] || python3 benchmarks/gpu/mk_model.py /root/model > "$RES/mk_model.log" 2>&1
  job h0_ahead_hooks 30 120 python3 benchmarks/gpu/check_ahead_hooks.py
  job a0_smoke_ahead 300 420 python3 benchmarks/gpu_engine_smoke.py --images /root/imgs --n 32 \
    --modes embeds-engine-tower,embeds-engine-tower-ahead --out "$RES/a0_smoke_ahead.json"
  AHEAD="env VLMSTREAM_INFER__TOWER_AHEAD=true"
  SMALL="$BENCH --model /root/model --budgets 256 --seconds 90 --stop-after 1.5 --arms pipeline-embeds --profile"
  job a1_step_02mp 280 380 $SMALL --out "$RES/a1_step_02mp"
  job a1_ahead_02mp 280 380 $AHEAD $SMALL --out "$RES/a1_ahead_02mp"
  # serve in the same lease: whether either pipeline reaches 2x it at 0.2 MP.
  job a1_serve_02mp 230 330 $BENCH --model /root/model --budgets 256 --seconds 90 --arms serve --serve-k 8 \
    --out "$RES/a1_serve_02mp"
  job a2_ahead_02mp 280 380 $AHEAD $SMALL --out "$RES/a2_ahead_02mp"
  job a2_step_02mp 280 380 $SMALL --out "$RES/a2_step_02mp"
  MID="$BENCH --model /root/model --budgets 1280 --seconds 90 --stop-after 1.5 --arms pipeline-embeds --profile"
  job a3_ahead_1mp 250 360 $AHEAD $MID --out "$RES/a3_ahead_1mp"
  job a3_step_1mp 250 360 $MID --out "$RES/a3_step_1mp"
fi

if [ "$LIST" = generic-tiling ]; then
  LO=/root/llava-onevision-7b
  [ -e $LO/config.json ] || python3 benchmarks/gpu/mk_model.py $LO llava-onevision-7b > "$RES/mk_lo.log" 2>&1
  job g3_llava_ov 480 640 $BENCH --model $LO --budgets default --seconds 60 --stop-after 1.5 --start-limit 600 \
    --arms naive,pipeline-pixels --out "$RES/g3_llava_ov"
fi

if [ "$LIST" = qwen3-long ]; then
  Q3=/root/qwen3-vl-8b
  [ -e $Q3/config.json ] || python3 benchmarks/gpu/mk_model.py $Q3 qwen3-vl-8b > "$RES/mk_q3.log" 2>&1
  job l1_pipeline_1mp 420 560 $BENCH --model $Q3 --budgets 1280 --seconds 60 --stop-after 2 --profile \
    --arms pipeline-pixels,pipeline-embeds --out "$RES/l1_pipeline_1mp"
  job l2_serve_k 330 450 $BENCH --model $Q3 --budgets 256,1280 --seconds 25 --arms serve --serve-k 4,12 \
    --out "$RES/l2_serve_k"
  job l3_tower_profile 90 180 python3 benchmarks/gpu/bench_vision_tower.py --model qwen3-vl-8b --imgs /root/imgs \
    --variants transformers+vllm_fa3,fast+vllm_fa3 --seconds 3 --profile-budget 256 --out "$RES/l3_tower_profile.json"
fi

if [ "$LIST" = embeds-q3 ]; then
  Q3=/root/qwen3-vl-8b
  [ -e $Q3/config.json ] || python3 benchmarks/gpu/mk_model.py $Q3 qwen3-vl-8b > "$RES/mk_q3.log" 2>&1
  Q3PIPE="--model $Q3 --budgets 256,1280 --seconds 40 --stop-after 2 --profile"
  job i2_embeds_host 330 450 $BENCH $Q3PIPE --arms pipeline-embeds --out "$RES/i2_embeds_host"
  job i3_pixels 300 420 $BENCH $Q3PIPE --arms pipeline-pixels --out "$RES/i3_pixels"
fi

vlmstream broker stop > "$RES/broker_stop.log" 2>&1
date +%T > "$RES/DONE"
