"""Triton kernels of megatron-grpo (installed as megatron_grpo.kernels).

The kernel seam of the vocab-parallel log-prob op (see docs/DESIGN.md): per row-chunk of fp32
(or bf16) logits, ``logits_row_stats`` (max, sum-exp, target logit, entropy numerator over the
valid columns) and ``logits_grad`` (the fused softmax-gradient epilogue). The GEMMs and the TP
combine live in ``megatron_grpo.ops``. The decode step's element-wise kernels (``add_rms_norm``,
``qkv_rope_cache``, ``swiglu``), ``decode_attention``, ``sample_rows`` and ``sort_keys`` (MoE
pairs by expert) serve the generation engine; ``rope``, ``rms_norm_fwd`` / ``rms_norm_bwd``,
``qk_norm_rope_fwd`` / ``qk_norm_rope_bwd`` (the attention's q / k norms and RoPE in one launch)
and ``gather_sum`` (the MoE dispatches' row sums) serve the training passes; ``split_acc_addmm``
/ ``split_acc_resolve`` keep the single pass's d_weight as a bf16 gradient with an int8 residual.
Importing this package works without Triton installed; calling a kernel then raises a
RuntimeError saying so.
"""

from ._runtime import AUTOTUNE_ENV, triton_available
from .add_rms_norm import add_rms_norm
from .decode_attention import decode_attention
from .gather_sum import gather_sum
from .head_gemm import head_gemm_grad, head_gemm_stats
from .logits_grad import logits_grad
from .logits_row_stats import logits_row_stats
from .qk_norm_rope import qk_norm_rope_bwd, qk_norm_rope_fwd
from .qkv_rope_cache import qkv_rope_cache
from .rms_norm import rms_norm_bwd, rms_norm_fwd
from .rope import rope
from .sample_rows import sample_rows
from .sort_keys import sort_keys
from .split_accumulator import split_acc_addmm, split_acc_resolve
from .swiglu import swiglu, swiglu_bwd, swiglu_scaled, swiglu_scaled_bwd

__all__ = [
    "AUTOTUNE_ENV",
    "add_rms_norm",
    "decode_attention",
    "gather_sum",
    "head_gemm_grad",
    "head_gemm_stats",
    "logits_grad",
    "logits_row_stats",
    "qk_norm_rope_bwd",
    "qk_norm_rope_fwd",
    "qkv_rope_cache",
    "rms_norm_bwd",
    "rms_norm_fwd",
    "rope",
    "sample_rows",
    "sort_keys",
    "split_acc_addmm",
    "split_acc_resolve",
    "swiglu",
    "swiglu_bwd",
    "swiglu_scaled",
    "swiglu_scaled_bwd",
    "triton_available",
]
