"""Fast vision blocks. transformers' block is correct but slow on a GPU: besides its unaligned MLP width
(``block_shapes.py``), the norms, rotary and activation run as ~20 separate float32 elementwise kernels per layer (a
third of a 1 MP Qwen2.5-VL forward on an H200). ``FastVisionBlocks`` replaces each block's forward with the same
function: the MLP's weights padded, the attention kernel (``attention.py``) called directly on (tokens, heads, dim),
and on CUDA the code around the attention compiled by torch.compile so the elementwise work fuses, with the Triton
kernels (``qkv_rotary.py``, ``block_norm.py``, ``mlp_activation.py``) where Triton imports."""

from __future__ import annotations

import functools
import logging

import torch
from torch.nn.functional import linear

from consumers.infer.vision.attention import windowed_sdpa
from consumers.infer.vision.block_norm import add_norm, norm
from consumers.infer.vision.block_norm import triton_kernels as triton_norm_kernels
from consumers.infer.vision.block_shapes import GEMM_ALIGNMENT, BlockShape, block_shape
from consumers.infer.vision.mlp_activation import gelu_tanh, quick_gelu, silu_gate
from consumers.infer.vision.mlp_activation import triton_kernels as triton_mlp_kernels
from consumers.infer.vision.qkv_rotary import rotate, triton_rotate_qkv

log = logging.getLogger(__name__)


def _before_attention(x, norm_weight, norm_bias, qkv_weight, qkv_bias, cos, sin, eps: float, heads: int):
    h = norm(x, norm_weight, norm_bias, eps)
    q, k, v = linear(h, qkv_weight, qkv_bias).view(x.shape[0], 3, heads, -1).unbind(1)
    return rotate(q, cos, sin), rotate(k, cos, sin), v.contiguous()


def _project(x, norm_weight, norm_bias, qkv_weight, qkv_bias, eps: float):
    return linear(norm(x, norm_weight, norm_bias, eps), qkv_weight, qkv_bias)


def _after_attention(x, attended, proj_weight, proj_bias, norm_weight, norm_bias, up_weight, up_bias,
                     down_weight, down_bias, eps: float, activation):
    x, h = _up_projection(x, attended, proj_weight, proj_bias, norm_weight, norm_bias, up_weight, up_bias, eps)
    return x + linear(activation(h), down_weight, down_bias)


def _up_projection(x, attended, proj_weight, proj_bias, norm_weight, norm_bias, up_weight, up_bias, eps: float,
                   residual_bias=None):
    """The block after its attention up to the MLP's activation: (residual stream, the MLP's first projection).
    ``residual_bias`` (the MLP's last bias, for ``_add_down_projection``) is added to the residual stream that is
    returned, not to what the norm reads."""
    x = x + linear(attended.reshape(x.shape[0], -1), proj_weight, proj_bias)
    h = linear(norm(x, norm_weight, norm_bias, eps), up_weight, up_bias)
    return (x if residual_bias is None else x + residual_bias), h


def _add_down_projection(residual: torch.Tensor, activated: torch.Tensor, down_weight) -> torch.Tensor:
    """``residual + activated @ down_weight.T``, the block's last residual add done by the product itself: cuBLAS
    adds its output to ``residual`` in place (beta = 1), so the sum costs no pass of its own over the rows (a product
    and then an add write the product's rows and read them back). ``residual`` must be a tensor nothing else reads:
    the up step's fresh output, with the MLP's last bias already in it."""
    return residual.addmm_(activated, down_weight.t())


def _steps_with_norm_kernels(kernels):
    """``_project`` and ``_up_projection`` with the blocks' norms run by the Triton kernels (``block_norm.py``):
    what is left of them are matrix products, cuBLAS calls with nothing to compile."""

    def project(x, norm_weight, norm_bias, qkv_weight, qkv_bias, eps: float):
        return linear(kernels.norm(x, norm_weight, norm_bias, eps), qkv_weight, qkv_bias)

    def up_projection(x, attended, proj_weight, proj_bias, norm_weight, norm_bias, up_weight, up_bias, eps: float,
                      residual_bias=None):
        x, normed = kernels.add_norm(x, linear(attended.reshape(x.shape[0], -1), proj_weight, proj_bias),
                                     norm_weight, norm_bias, eps, shift=residual_bias)
        return x, linear(normed, up_weight, up_bias)

    return project, up_projection


def _norm_kernels_agree(kernels, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> bool:
    """The Triton norms against torch's on random rows of a block's width, dtype and device, once per tower (as the
    attention kernels are probed): a kernel that fails, or answers more than bf16 rounding apart, is not used."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x, y = (torch.randn(64, weight.shape[0], generator=gen).to(weight.device, weight.dtype) for _ in range(2))
    with torch.inference_mode():
        try:
            got = (kernels.norm(x, weight, bias, eps), *kernels.add_norm(x, y, weight, bias, eps))
        except Exception as exc:  # noqa: BLE001 - an optimisation must never stop the engine
            log.info("the Triton norm kernels failed their probe: %s", exc)
            return False
        want = (norm(x, weight, bias, eps), *add_norm(x, y, weight, bias, eps))
    return all(bool((g.float() - w.float()).abs().max() <= 0.02 * w.float().abs().max() + 1e-3)
               for g, w in zip(got, want))


# Inductor compiles in this process, not in its pool of compile workers. A process's first Triton compile starts that
# pool, one worker per core (16 on the H200 host), and the tower timed right after its compile then ran three times
# slower at 0.2 MP (9.8 against 3.1 ms per image) with every core of the host busy: at that
# budget the tower is bound by the one thread that launches its kernels. Compiled in this process it ran at full speed
# from its first pass, and compiled no slower. The option holds for every later recompile of these functions too.
IN_PROCESS_COMPILE = {"compile_threads": 1}


def compiled_in_process(fn):
    """``fn`` compiled by torch.compile for any tensor sizes, as one graph, Inductor compiling in this process."""
    return torch.compile(fn, dynamic=True, fullgraph=True, options=IN_PROCESS_COMPILE)


_reported_shapes: set[str] = set()


class FastVisionBlocks:
    """Replaces the ``forward`` of every block of a Qwen vision tower whose shape it knows (``block_shape``:
    Qwen2.5-VL's RMSNorm + gated MLP, or the LayerNorm + two-matrix MLP of Qwen2-VL, Qwen3-VL and Qwen3.5) with
    the fused version above; any other block keeps transformers' forward (said once at info). ``replaced`` counts
    the blocks it took over.

    The forward is the block's own call target, so the tower's forward still calls ``block(...)`` for each block in
    turn and still takes the DeepStack levels (Qwen3-VL) from the hidden states between blocks.

    ``attention`` is a varlen kernel ``(q, k, v, cu_q, cu_k, max_q, max_k, scale) -> out`` on (tokens, heads,
    dim) tensors, or None for the per-window sdpa loop. ``compile_blocks`` compiles the code around the
    attention (CUDA only; a failed compile falls back to eager with a warning).

    Compiled blocks also run the Triton kernels, where Triton imports (on an H200 each ran faster than Inductor's code
    for the same step, the tower faster with them: benchmarks/gpu/bench_vision_tower.py and the kernels' own
    benchmarks in benchmarks/gpu/): q, k, v split out of the projection and rotated in one pass (``qkv_rotary.py``);
    the MLP's activation in one pass (``mlp_activation.py``, between a
    compiled call for the code before it and the down projection: a gated MLP's ``silu(gate) * up``, GELU in its
    tanh form, quick GELU; any other activation keeps the compiled code); and the two norms in one pass over whole
    rows in the steps beside those kernels (``block_norm.py``; probed once against torch's norm on the tower's width,
    dtype and device, and dropped with a warning if they disagree). ``triton``: None decides so; True runs the
    kernels without compiling too, which tests do on the CPU through Triton's interpreter (an error where Triton does
    not import). Without the kernels each step is the compiled (or eager) torch code.
    ``strided_v``: the Triton q/k/v kernel leaves v as a view of the projection (``qkv_rotary.py``); only for an
    attention that reads it so (``takes_strided_v``; the per-window sdpa loop does).
    Where the MLP's activation has a Triton kernel, its last product adds its output to the residual stream in place
    (``_add_down_projection``) instead of a separate add after it.
    ``window_attention``: the varlen kernel for the blocks of a windowed tower (Qwen2.5-VL) that attend within
    windows, not over whole images (the blocks outside ``fullatt_block_indexes``); None: ``attention`` for those too.
    A kernel built for long sequences need not be the fastest on thousands of 64-patch windows.
    """

    def __init__(self, visual: torch.nn.Module, attention=None, compile_blocks: bool = False,
                 alignment: int = GEMM_ALIGNMENT, strided_v: bool = False, window_attention=None,
                 triton: bool | None = None):
        use_triton = compile_blocks if triton is None else triton
        self.attention = attention
        self.before, self.after, self.project, self.up = _before_attention, _after_attention, _project, _up_projection
        if compile_blocks:
            self.before, self.after, self.project, self.up = (
                compiled_in_process(f) for f in (_before_attention, _after_attention, _project, _up_projection))
        self.rotate_qkv = triton_rotate_qkv() if use_triton else None
        self.norm_kernels = triton_norm_kernels() if use_triton else None
        mlp_kernels = triton_mlp_kernels() if use_triton else None
        if triton and None in (self.rotate_qkv, self.norm_kernels, mlp_kernels):
            raise RuntimeError("triton=True needs Triton, which cannot be imported here")
        self.strided_v = self.rotate_qkv is not None and strided_v
        if self.strided_v:
            self.rotate_qkv = functools.partial(self.rotate_qkv, contiguous_v=False)
        if self.norm_kernels is not None:
            self.project, self.up = _steps_with_norm_kernels(self.norm_kernels)
        # The MLP activations run by a Triton kernel, by the activation function a block's shape names.
        self.mlp_kernels: dict = {}
        if mlp_kernels is not None:
            # Alone on an H200 each ran 1.8 to 2.5 times as fast as Inductor's kernel
            # (benchmarks/gpu/bench_mlp_activation.py).
            self.mlp_kernels = {silu_gate: mlp_kernels.silu_gate, gelu_tanh: mlp_kernels.gelu_tanh,
                                quick_gelu: mlp_kernels.quick_gelu}
        self.replaced = 0
        self.window_attention = window_attention
        whole_image = set(getattr(visual, "fullatt_block_indexes", None) or range(len(visual.blocks)))
        for index, block in enumerate(visual.blocks):
            shape = block_shape(block, alignment)
            if isinstance(shape, str):
                name = type(block).__name__
                if name not in _reported_shapes:
                    _reported_shapes.add(name)
                    log.info("vision block %s keeps transformers' forward: %s", name, shape)
                continue
            block.forward = self._block_forward(block, shape, windowed=index not in whole_image)
            self.replaced += 1
            if self.replaced == 1 and self.norm_kernels is not None and not _norm_kernels_agree(
                    self.norm_kernels, block.norm2.weight, shape.norm2_bias, shape.norm_eps):
                log.warning("the Triton norm kernels disagree with torch's norm on %s; the blocks run the torch "
                            "code for their norms", block.norm2.weight.device)
                self.norm_kernels = None
                self.project, self.up = (compiled_in_process(f) if compile_blocks else f
                                         for f in (_project, _up_projection))

    @staticmethod
    def remove(visual: torch.nn.Module) -> None:
        """Give every block back transformers' own forward."""
        for block in visual.blocks:
            block.__dict__.pop("forward", None)

    def use_eager(self) -> None:
        self.before, self.after, self.project, self.up = _before_attention, _after_attention, _project, _up_projection
        self.rotate_qkv, self.mlp_kernels, self.strided_v, self.norm_kernels = None, {}, False, None

    def _block_forward(self, block: torch.nn.Module, shape: BlockShape, windowed: bool = False):
        attn = block.attn
        up_weight, up_bias, down_weight = shape.mlp
        qkv_weight, proj_weight = attn.qkv.weight, attn.proj.weight
        heads, scale, eps = attn.num_heads, attn.scaling, shape.norm_eps
        # Fixed per block: a window block of a windowed tower takes its own kernel where one was given.
        attention = self.window_attention if windowed and self.window_attention is not None else self.attention

        def forward(hidden_states, cu_seqlens, max_seqlen=None, position_embeddings=None, **_):
            if self.rotate_qkv is not None:
                qkv = self.project(hidden_states, block.norm1.weight, shape.norm1_bias, qkv_weight,
                                   attn.qkv.bias, eps)
                q, k, v = self.rotate_qkv(qkv.view(hidden_states.shape[0], 3, heads, -1),
                                          *(t.float() for t in position_embeddings))
            else:
                cos, sin = (t.float().unsqueeze(-2) for t in position_embeddings)
                q, k, v = self.before(hidden_states, block.norm1.weight, shape.norm1_bias, qkv_weight,
                                      attn.qkv.bias, cos, sin, eps, heads)
            if attention is None:
                attended = windowed_sdpa(q, k, v, cu_seqlens, scale)
            else:
                if max_seqlen is None:
                    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
                cu = cu_seqlens.to(torch.int32)
                attended = attention(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), scale)
            activation = self.mlp_kernels.get(shape.activation)
            if activation is not None:
                # The add is in the product: the residual stream comes back with the MLP's last bias in it.
                x, h = self.up(hidden_states, attended, proj_weight, attn.proj.bias, block.norm2.weight,
                               shape.norm2_bias, up_weight, up_bias, eps, shape.down_bias)
                return _add_down_projection(x, activation(h), down_weight)
            return self.after(hidden_states, attended, proj_weight, attn.proj.bias, block.norm2.weight,
                              shape.norm2_bias, up_weight, up_bias, down_weight, shape.down_bias, eps,
                              shape.activation)

        return forward


def block_kernels(fast: FastVisionBlocks | None) -> dict[str, str]:
    """Which steps of a tower's fast blocks (None: none) run a Triton kernel, for logs and reports: q/k/v (and
    whether v stays in the projection), the norms, the MLP's activations."""
    if fast is None:
        return {"qkv": "torch", "norm": "torch", "mlp": "torch"}
    qkv = "torch" if fast.rotate_qkv is None else "triton, v strided" if fast.strided_v else "triton"
    # The norm kernels run only in the steps that have a Triton kernel (FastVisionBlocks says why).
    beside = fast.rotate_qkv is not None or bool(fast.mlp_kernels)
    return {"qkv": qkv, "norm": "triton" if fast.norm_kernels is not None and beside else "torch",
            "mlp": "triton" if fast.mlp_kernels else "torch"}
