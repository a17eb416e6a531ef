"""The portable spec's layer modules: SP-aware norms (:class:`Norm`) and the dense MLP whose
SwiGLU is one kernel each way (:class:`SwiGLUMLP`); their kernels are the ``elementwise`` choice
of :class:`~megatron_grpo.ops.kernels.LayerKernels`, given when the layer spec is built."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_grpo.ops.kernels import check_choice
from megatron_grpo.ops.layers.rms_norm import rms_norm
from megatron_grpo.ops.layers.swiglu import swiglu


class Norm(torch.nn.Module):
    """LayerNorm or RMSNorm (``config.normalization``) computed in float32; SP-aware.

    Parameters get ``sequence_parallel = config.sequence_parallel``: under SP each TP rank
    normalizes different tokens, so Megatron sums their gradients across the TP group.
    Input ``[..., hidden_size]``; the output keeps the input dtype. RMSNorm runs
    :func:`megatron_grpo.ops.layers.rms_norm.rms_norm` with ``impl`` (``LayerKernels.elementwise``,
    given by the layer spec; "auto": the Triton kernels on CUDA).

    ``deferred`` (set by the attention around its q / k split, never by users): return the input
    unchanged because the attention applies this RMSNorm itself, fused with RoPE
    (``attention.rope.PackedRopeSelfAttention``). The module is still called, so hooks on it
    (e.g. megatron-core DDP's parameter-gather waits) run as before.
    """

    deferred = False

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str | None = None,
        impl: str = "auto",
    ) -> None:
        super().__init__()
        self.impl = check_choice("impl", impl, "Norm impl")
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma is not supported by the portable spec")
        self.normalization = normalization or config.normalization
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(
                f"normalization must be LayerNorm or RMSNorm, got {self.normalization}"
            )
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = None
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deferred:
            return x
        if self.bias is None:
            return rms_norm(x, self.weight, self.eps, impl=self.impl)
        shape = (self.hidden_size,)
        y = F.layer_norm(x.float(), shape, self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


class _QuietSubclassNotice(logging.Filter):
    """megatron-core 0.14-0.16 log "Unknown MLP type ... Using default kwargs" once per layer for
    any MLP subclass; for :class:`SwiGLUMLP` the defaults are right (the default TP group)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unknown MLP type" not in record.getMessage()


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_QuietSubclassNotice())


def fused_swiglu_applies(config: TransformerConfig) -> bool:
    """Whether megatron-core's MLP computes plain SwiGLU on a bias-free fc1 output (gated SiLU,
    no clamp, offset, fusion or FP8 storage): what :class:`SwiGLUMLP` replaces."""
    return (
        config.gated_linear_unit
        and config.activation_func is F.silu
        and not config.add_bias_linear
        and not config.bias_activation_fusion
        and not getattr(config, "use_te_activation_func", False)
        and getattr(config, "activation_func_clamp_value", None) is None
        and getattr(config, "glu_linear_offset", 0.0) == 0.0
        and not getattr(config, "activation_func_fp8_input_store", False)
        and config.fp8 is None
    )


class SwiGLUMLP(MLP):
    """megatron-core's dense ``MLP`` whose SwiGLU is :func:`megatron_grpo.ops.layers.swiglu.swiglu`
    with ``impl`` (one Triton kernel each way on GPU instead of ~8 element-wise kernels); any
    other activation, or extra forward arguments, take megatron-core's own forward. ``impl``:
    ``LayerKernels.elementwise``, given by the layer spec."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        *args,
        pg_collection=None,
        is_mtp_layer: bool | None = None,
        impl: str = "auto",
        default_groups=None,
        **kwargs,
    ) -> None:
        # megatron-core 0.19 hands a subclass of MLP the layer's process groups (MLP itself
        # gets them through ``as_mlp_submodule``); older versions pass none: the spec's
        # ``default_groups`` (a model with groups of its own), else the default TP group
        pg_collection = pg_collection if pg_collection is not None else default_groups
        if pg_collection is not None:
            kwargs.setdefault("tp_group", pg_collection.tp)
        super().__init__(config, submodules, *args, **kwargs)
        self.fused_swiglu = fused_swiglu_applies(config)
        self.impl = check_choice("impl", impl, "SwiGLUMLP impl")

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if not self.fused_swiglu or args or any(v is not None for v in kwargs.values()):
            return super().forward(hidden_states, *args, **kwargs)
        x, _ = self.linear_fc1(hidden_states)  # [s, b, 2F / TP]; no bias (fused_swiglu)
        return self.linear_fc2(swiglu(x, impl=self.impl))
