"""Device import check: vLLM (the modules the Qwen2.5-VL path loads), our wheels, TurboJPEG through the carried
libturbojpeg exactly as consumers/decode builds it, the JRE, and the vlmstream CLI."""
import glob
import importlib
import importlib.util
import os
import subprocess

import vllm, vllm.entrypoints.llm  # noqa: E401
from vllm import LLM, SamplingParams  # noqa: F401
import vllm.model_executor.models.qwen2_5_vl, vllm.v1.engine.core, vllm.v1.engine.llm_engine  # noqa: E401
import vllm.multimodal.hasher  # noqa: E401
# The GPU model runner's module: vllm.v1.worker.gpu_model_runner in 0.26, vllm.v1.worker.gpu.model_runner in 0.34.
importlib.import_module("vllm.v1.worker.gpu_model_runner" if importlib.util.find_spec("vllm.v1.worker.gpu_model_runner")
                        else "vllm.v1.worker.gpu.model_runner")
print("IMPORT_OK vllm", vllm.__version__)

import cv2, fastjsonschema, kafka, orjson, pydantic, pydantic_settings, turbojpeg  # noqa: E401
print("IMPORT_OK kafka", kafka.__version__, "orjson", orjson.__version__, "pydantic", pydantic.VERSION,
      "pydantic_settings", pydantic_settings.__version__, "cv2", cv2.__version__)

from turbojpeg import TurboJPEG  # noqa: E402
jpegs = sorted(glob.glob("/root/imgs/*.jpg"))
img = TurboJPEG().decode(open(jpegs[0], "rb").read()) if jpegs else None
print("IMPORT_OK turbojpeg", turbojpeg.__version__ if hasattr(turbojpeg, "__version__") else "",
      "decoded", None if img is None else img.shape)
try:
    from consumers.decode.decoder import Decoder
    print("IMPORT_OK consumers.decode uses turbojpeg:", Decoder().uses_turbojpeg)
except ImportError as e:
    print("consumers.decode not importable yet:", e)

import vlmstream.cli.main  # noqa: E402,F401
print("IMPORT_OK vlmstream.cli")
java = os.path.join(os.environ.get("JAVA_HOME", "/opt/jre"), "bin", "java")
print("JAVA", subprocess.run([java, "-version"], capture_output=True, text=True).stderr.splitlines()[0])
