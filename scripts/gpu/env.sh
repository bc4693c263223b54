# Source on the device (after unpack_device.sh) from anywhere: `source scripts/gpu/env.sh`.
# vLLM + our wheels in /tmp/site ahead of the repo; the jlink'ed JRE; the broker's home (jars already there, so
# vlmstream/broker/jars.py never calls mvn); libturbojpeg for PyTurboJPEG (it searches LD_LIBRARY_PATH for
# libturbojpeg.so.0 when the system has none); `vlmstream` and `vllm` wrappers on PATH.
_vlm_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
case ":${PYTHONPATH:-}:" in *":/tmp/site:"*) ;; *) export PYTHONPATH=/tmp/site:$_vlm_repo${PYTHONPATH:+:$PYTHONPATH} ;; esac
export JAVA_HOME=/opt/jre
export VLMSTREAM_HOME=${VLMSTREAM_HOME:-/root/vlmstream-home}
case ":${LD_LIBRARY_PATH:-}:" in *":/tmp/vlmlib:"*) ;; *) export LD_LIBRARY_PATH=/tmp/vlmlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ;; esac
case ":$PATH:" in *":/tmp/vlmbin:"*) ;; *) export PATH=/tmp/vlmbin:$JAVA_HOME/bin:$PATH ;; esac
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# A kit that ships torch 2.14 (pack_device.sh with VLLM_VERSION=0.34.0) runs it on the image's NCCL 2.28.9 and cuDNN
# 9.19: the stub library supplies the NCCL functions torch links that 2.28.9 lacks, and the variable lets
# torch.backends.cudnn.version() answer for a cuDNN older than the one torch was built with, as C++ already does.
if [ -e /tmp/vlmlib/libnccl_2_30_stubs.so ]; then
  case ":${LD_PRELOAD:-}:" in *":/tmp/vlmlib/libnccl_2_30_stubs.so:"*) ;;
    *) export LD_PRELOAD=/tmp/vlmlib/libnccl_2_30_stubs.so${LD_PRELOAD:+:$LD_PRELOAD} ;; esac
  export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
fi
# Keep NVLink multicast off on multi-GPU kinds (the device docs ask for it; harmless on one GPU).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset _vlm_repo
