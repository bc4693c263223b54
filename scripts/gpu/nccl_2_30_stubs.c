/* The NCCL functions torch 2.14's libtorch_cuda.so links that the device image's NCCL 2.28.9 lacks (they came in
   NCCL 2.29 and 2.30). CPython loads extensions with RTLD_NOW, so without them `import torch` fails with "undefined
   symbol: ncclCommResume". Preloaded (env.sh), this library answers each with ncclInvalidUsage (5); every other
   NCCL function still comes from the image's library. torch calls these only for ProcessGroupNCCL suspend/resume,
   memory statistics and regrowth, and NCCL-window symmetric memory: none of them on a single-GPU engine. */
#define STUB(name) int name(void) { return 5; }
STUB(ncclCommGetUniqueId) STUB(ncclCommGrow) STUB(ncclCommMemStats) STUB(ncclCommResume) STUB(ncclCommSuspend)
STUB(ncclGetLsaMultimemDevicePointer) STUB(ncclGetPeerDevicePointer) STUB(ncclPutSignal) STUB(ncclSignal)
STUB(ncclWaitSignal) STUB(ncclWinGetUserPtr)
