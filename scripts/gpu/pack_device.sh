#!/bin/bash
# Build everything the H200 device lacks into parts under <repo>/.gpu/p1, p2, ... (git-ignored; one `run` call
# carries one folder; split_parts.sh keeps each folder within 62 MiB).
# One zstd stream (the device has no zstd binary; pyarrow decompresses it there) holding:
#   site/                 vLLM $VLLM_VERSION (0.34.0, the release vlmstream/vllm_adapter.py is checked against, by
#                         default) + its wheel list deps-$VLLM_VERSION.txt + deps_vlmstream.txt wheels. 0.34.0's list
#                         holds torch 2.14, torchvision 0.29 and triton 3.8 (IMAGE_TORCH=1 leaves those three out, to
#                         try that release on the image's own torch); 0.26.0's runs on the image's torch
#   lib/libturbojpeg.so.0 this Debian's libjpeg-turbo 2.1 (PyTurboJPEG 1.x drives it; the device has none)
#   lib/libnccl_2_30_stubs.so  only when the kit ships torch: nccl_2_30_stubs.c, which env.sh preloads
#   jre/                  jlink'ed Java 17 runtime with only the modules the Kafka 4.1 broker uses
#   kafka-4.1.1-jars/     the broker's jars (what vlmstream/broker/jars.py would fetch with mvn), minus unused ones
# and, outside the stream (JPEGs do not compress), <last part folder>/imgs/: real JPEGs of at least 1 MP from the
# corpus, smallest files first, up to IMG_MB (2026-11-30: 15 files, 10.2 MiB, mean 5.83 MP) for gpu_bench.py.
# Usage: bash scripts/gpu/pack_device.sh
#   env: CORPUS=/work/shared/corpus IMG_MB=12 LEVEL=19 (PART_MIB=62: see split_parts.sh) WORK=/tmp/vlmstream-gpu-pack
#        VLLM_VERSION=0.34.0 IMAGE_TORCH= DRY_RUN= (DRY_RUN=1 lists the wheels it would fetch and stops)
# Wheels are cached in $WORK/whl (another vLLM release: $WORK/whl-<release>) between runs. zstd -19 takes ~4 min on
# 2 idle cores and far longer on a busy shared machine; LEVEL=12 is ~10x faster for a few per cent more bytes.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../.." && pwd)
work=${WORK:-/tmp/vlmstream-gpu-pack}; corpus=${CORPUS:-/work/shared/corpus}; img_mb=${IMG_MB:-12}
jars_src=${KAFKA_JARS:-$HOME/.cache/vlmstream/kafka-4.1.1-jars}
vllm_version=${VLLM_VERSION:-0.34.0}
deps=$here/deps-$vllm_version.txt; whl=$work/whl-$vllm_version${IMAGE_TORCH:+-imagetorch}
[ -f "$deps" ] || { echo "no wheel list for vLLM $vllm_version: $deps" >&2; exit 2; }
wheels=$(grep -hv -e '^#' -e '^PyTurboJPEG' "$deps" "$here/deps_vlmstream.txt")
if [ -n "${IMAGE_TORCH:-}" ]; then wheels=$(printf '%s\n' $wheels | grep -v -E '^(torch|torchvision|triton)=='); fi
if [ -n "${DRY_RUN:-}" ]; then
  printf '%s\n' "into $whl:" "vllm==$vllm_version" $wheels "PyTurboJPEG (built here)"; exit 0
fi
command -v zstd >/dev/null || apt-get install -y -q zstd >/dev/null
tree=$work/tree; rm -rf "$tree" "$work"/all.tar.zst "$work/imgs"; mkdir -p "$whl" "$tree/site" "$tree/lib" "$work/imgs"
t0=$(date +%s)

# (a)+(b) wheels for cp312 manylinux x86_64, unpacked into one site folder (pip download --no-deps: every need is pinned)
P=""; for n in 2_5 2_17 2_24 2_27 2_28 2_31 2_34; do P="$P --platform manylinux_${n}_x86_64"; done
P="$P --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
( cd "$whl" && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P \
    -d . vllm=="$vllm_version" $wheels
  # PyTurboJPEG is published as an sdist only (one pure-Python module): build its wheel here.
  ls pyturbojpeg-*.whl >/dev/null 2>&1 || python3 -m pip wheel -q --no-deps -w . "$(grep -h '^PyTurboJPEG' "$here/deps_vlmstream.txt")" )
( cd "$tree/site" && for w in "$whl"/*.whl; do unzip -qo "$w" -d .; done
  # What no model here needs on Hopper: FA3 serves both the language model and the vision tower. The MoE kernels
  # (_moe_C_stable_libtorch, 47 MB) stay: Qwen3-VL-30B-A3B's router calls torch.ops._moe_C.topk_softmax.
  rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs
  rm -rf vllm/third_party/fmha_sm100 vllm/third_party/deep_gemm/include vllm/third_party/deep_gemm/_C.cpython-31[134]-*.so \
         vllm/third_party/deep_gemm/_C_extension.abi3.so vllm/entrypoints/serve/instrumentator/static ./*.data
  # Triton, where the kit ships it: its CUPTI copies serve only its profiler, ptxas-blackwell only compute
  # capability 10 and up, and the test libraries nothing.
  rm -rf triton/backends/nvidia/lib/cupti triton/backends/nvidia/lib/cupti-blackwell \
         triton/backends/nvidia/bin/ptxas-blackwell triton/instrumentation/libGPUInstrumentationTestLib.so \
         triton/plugins/libTritonPluginsTestLib.so
  find . -name __pycache__ -prune -exec rm -rf {} \; )

# (c) libjpeg-turbo's TurboJPEG library; with torch in the kit, the NCCL functions it links that the image's NCCL lacks
cp -L /usr/lib/x86_64-linux-gnu/libturbojpeg.so.0 "$tree/lib/libturbojpeg.so.0"
if [ -d "$tree/site/torch" ]; then
  gcc -O2 -shared -fPIC -nostdlib -o "$tree/lib/libnccl_2_30_stubs.so" "$here/nccl_2_30_stubs.c"
fi

# (d) a minimal Java runtime and the broker's jars
bash "$here/jlink_jre.sh" "$tree/jre"
mkdir -p "$tree/kafka-4.1.1-jars"
cp "$jars_src"/*.jar "$tree/kafka-4.1.1-jars/"
# Never loaded by a single-node KRaft broker whose clients send uncompressed/gzip/lz4 records: zstd-jni, snappy,
# scala-reflect, Jackson CSV/YAML + snakeyaml (checked with broker_smoke.py on the jlink'ed JRE; 43 -> 28 MB).
for j in $(grep -v '^#' "$here/kafka_jars_drop.txt"); do rm -f "$tree/kafka-4.1.1-jars/$j"; done

# images: real JPEGs of at least 1 MP (no thumbnails), smallest files first, until IMG_MB
python3 - "$corpus" "$work/imgs" "$img_mb" <<'PY'
import os, shutil, struct, sys
corpus, dst, mb = sys.argv[1], sys.argv[2], float(sys.argv[3])
def jpeg_size(path):  # (w, h) from the first SOFn marker; no Pillow needed here
    b = open(path, "rb").read(); i = 2
    while i < len(b):
        while b[i] == 0xFF: i += 1
        m = b[i]; ln = struct.unpack(">H", b[i + 1:i + 3])[0]
        if 0xC0 <= m <= 0xCF and m not in (0xC4, 0xC8, 0xCC):
            h, w = struct.unpack(">HH", b[i + 4:i + 8]); return w, h
        i += 1 + ln
files = sorted((os.path.getsize(p), p) for d in sorted(os.listdir(corpus)) if os.path.isdir(os.path.join(corpus, d))
               for p in [os.path.join(corpus, d, f) for f in sorted(os.listdir(os.path.join(corpus, d)))]
               if p.lower().endswith((".jpg", ".jpeg")))
total, mps = 0, []
for size, p in files:
    w, h = jpeg_size(p)
    if w * h < 1_000_000 or total + size > mb * 1048576: continue
    shutil.copy(p, os.path.join(dst, os.path.basename(os.path.dirname(p)) + "_" + os.path.basename(p)))
    total += size; mps.append(w * h / 1e6)
print(f"images: {len(mps)} JPEGs, {total / 1048576:.1f} MiB, mean {sum(mps) / len(mps):.2f} MP")
PY

echo "tree (uncompressed):"; du -sh "$tree"/*
tar -C "$tree" -cf - . | zstd -"${LEVEL:-19}" -T0 -q -o "$work/all.tar.zst"
bash "$here/split_parts.sh"
echo "built in $(( $(date +%s) - t0 )) s"
