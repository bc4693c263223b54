"""The vision tower of the Qwen families, run on the target device (each family's numbers: vlmstream/models/qwen2_vl.py,
qwen3_vl.py, qwen3_5.py). Import each part from its module; this package exports nothing itself.

How an image flows through the parts:

- ``pixels``: the exact-size H x W x 3 uint8 image goes to the device as it is (``to_device``, staged in page-locked
  memory so the copy does not wait for the GPU) and is rescaled, normalised and cut into patches there
  (``patchify_batch``), in the layout transformers' Qwen2VLImageProcessor produces; ``request_problem`` says why a
  request's image cannot be encoded.
- ``encoder``: ``VisionEncoder`` batches images into one varlen forward of the tower, within
  ``max_patches_per_call`` (``groups_by_patches``), with the forward's index tensors derived on the CPU once per image
  grid (``GridIndexParts``) and the patch embedding run as a matrix product (``PatchProjection``).
- ``blocks``: ``FastVisionBlocks`` computes each block as transformers' does, faster: MLP weights padded to aligned
  widths (``block_shapes``), the attention kernel called directly (``attention``: vLLM's FlashAttention 3 or torch's
  varlen flash attention, each probed before use), and on CUDA the code around it compiled, with the Triton kernels
  for q/k/v and rotary (``qkv_rotary``), the norms (``block_norm``) and the MLP's activations (``mlp_activation``),
  built once where Triton imports (``triton_build``).
- ``outputs``: each image's ``image_embeds`` (the main merger's tokens, then for Qwen3-VL the DeepStack levels' tokens
  on the feature axis, ``ModelFamily.image_embeds_width``) and its embedding for the embeddings topic, the mean of
  the main merger's part (``mean_pool``, ``ModelFamily.embedding_width``), copied to the host without waiting for the
  GPU (``to_host_later``, ``TowerPass``).
- ``checkpoint``: the tower loaded alone from a checkpoint folder (``load_vision_tower``), for vLLM's embeds mode where
  vLLM holds the language model, and the family a tower belongs to (``family_of_tower``).
"""
