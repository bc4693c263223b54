#!/bin/bash
# On the device, from the repo root: join the parts staged in /root/stage (plus any part carried in this very call
# under .gpu/pN/), check the checksum, unpack: vLLM + wheels -> /tmp/site, JRE -> /opt/jre,
# Kafka jars -> $VLMSTREAM_HOME/kafka-4.1.1-jars, libturbojpeg -> /tmp/vlmlib, .gpu/pN/imgs -> /root/imgs;
# patch flashinfer out of vLLM's sampler; put `vlmstream`/`vllm` wrappers in /tmp/vlmbin; check the imports.
# The device has no zstd binary; pyarrow (in its image) decompresses the stream. ~30 s.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd); stage=${STAGE:-/root/stage}
t0=$(date +%s)
mkdir -p "$stage"
for f in "$repo"/.gpu/p*/part.* "$repo"/.gpu/p*/all.sha256; do if [ -e "$f" ]; then mv "$f" "$stage/"; fi; done
cd "$stage"
echo "staged: $(ls part.* | tr '\n' ' ')"
cat part.* > all.zst
if [ -e all.sha256 ]; then
  [ "$(sha256sum all.zst | cut -d' ' -f1)" = "$(cat all.sha256)" ] || { echo "CHECKSUM MISMATCH: a part is missing or damaged"; exit 3; }
fi
x=/tmp/vlmpack; rm -rf "$x"; mkdir -p "$x"
python3 -c "import pyarrow as pa,sys,shutil; shutil.copyfileobj(pa.input_stream('$stage/all.zst', compression='zstd'), sys.stdout.buffer, 1<<24)" | tar -xf - -C "$x"
rm -f all.zst
source "$repo/scripts/gpu/env.sh"
rm -rf /tmp/site /opt/jre /tmp/vlmlib /root/imgs "$VLMSTREAM_HOME/kafka-4.1.1-jars"
mkdir -p "$VLMSTREAM_HOME" /tmp/vlmbin
mv "$x/site" /tmp/site; mv "$x/jre" /opt/jre; mv "$x/lib" /tmp/vlmlib
# The images travel beside the stream, in the last part's folder (JPEGs do not compress).
mkdir -p /root/imgs; for d in "$repo"/.gpu/p*/imgs; do if [ -d "$d" ]; then cp "$d"/* /root/imgs/; fi; done
mv "$x/kafka-4.1.1-jars" "$VLMSTREAM_HOME/"
rm -rf "$x"
printf '#!/bin/sh\nexec python3 -m vlmstream.cli "$@"\n' > /tmp/vlmbin/vlmstream
printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > /tmp/vlmbin/vllm
chmod +x /tmp/vlmbin/*
# Again, now that /tmp/vlmlib holds what the kit carries (a kit with torch 2.14 preloads its NCCL stub from there).
source "$repo/scripts/gpu/env.sh"
# A kit that ships torch must run it on this GPU; where it cannot, the image's own torch serves instead (said here, in
# the log every plan keeps) and vLLM's extensions run on it.
if [ -d /tmp/site/torch ] && ! python3 -c "import torch; x = torch.ones(64, 64, device='cuda'); assert float((x @ x).sum()) == 64 ** 3; print('TORCH_OK', torch.__version__, torch.cuda.get_device_name())"; then
  echo "KIT TORCH FAILED on this GPU: falling back to the image's torch"
  mkdir -p /tmp/kit-torch; mv /tmp/site/torch /tmp/site/torch-* /tmp/site/torchvision* /tmp/site/triton* /tmp/kit-torch/ 2>/dev/null || true
  rm -f /tmp/vlmlib/libnccl_2_30_stubs.so; unset LD_PRELOAD PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK
  python3 -c "import torch; print('TORCH_OK (image)', torch.__version__)"
fi
python3 "$repo/scripts/gpu/patch_vllm.py"
python3 "$repo/scripts/gpu/importcheck.py"
echo "UNPACKED in $(( $(date +%s) - t0 )) s: /tmp/site $(du -sh /tmp/site | cut -f1), /opt/jre, $VLMSTREAM_HOME/kafka-4.1.1-jars ($(ls "$VLMSTREAM_HOME/kafka-4.1.1-jars" | wc -l) jars), /root/imgs ($(ls /root/imgs | wc -l) files)"
