"""Triton kernels of megatron-grpo (installed as megatron_grpo.kernels).

The kernel seam of the vocab-parallel log-prob op (see docs/DESIGN.md): per row-chunk of fp32
(or bf16) logits, ``logits_row_stats`` (max, sum-exp, target logit, entropy numerator over the
valid columns) and ``logits_grad`` (the fused softmax-gradient epilogue). The GEMMs and the TP
combine live in ``megatron_grpo.ops``. Importing this package works without Triton installed;
calling a kernel then raises a RuntimeError saying so.
"""

from ._runtime import AUTOTUNE_ENV, triton_available
from .logits_grad import logits_grad
from .logits_row_stats import logits_row_stats

__all__ = ["AUTOTUNE_ENV", "logits_grad", "logits_row_stats", "triton_available"]
