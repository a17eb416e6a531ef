"""The attention's q / k RMSNorms and RoPE as one op: one autograd node and one launch each way.

Qwen3-style attention normalizes each q and k head (``q_layernorm`` / ``k_layernorm``) and then
rotates it. As separate ops that is four autograd nodes and eight launches per layer (and the
weight gradients' sums), each costing more host time than its kernel on packed micro-batches of
short rollouts; fused, it is one node whose forward and backward are one launch each, plus the
two weight-gradient sums.

* :func:`qk_norm_rope_torch`: the reference, the separate ops' references in turn
  (:func:`~megatron_grpo.ops.layers.rms_norm.rms_norm_torch`, then
  :func:`~megatron_grpo.ops.layers.rope.apply_rotary_torch`): equal to the unfused path bit
  for bit, forward and backward.
* ``impl="triton"``: ``kernels.qk_norm_rope``: the same math and roundings (the norm's output
  rounded to the model dtype, then RoPE's products and sum), the RMS mean summed in its own order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_grpo.ops.kernels import resolve_impl, triton_kernels
from megatron_grpo.ops.layers.rms_norm import rms_norm_torch
from megatron_grpo.ops.layers.rope import apply_rotary_torch


def qk_norm_rope_torch(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
) -> tuple[Tensor, Tensor]:
    """``q [T, NQ, D]``, ``k [T, NK, D]`` -> RoPE(RMSNorm(q)), RoPE(RMSNorm(k)) in their dtype."""
    q = apply_rotary_torch(rms_norm_torch(q, q_weight, eps), cos, sin, interleaved)
    return q, apply_rotary_torch(rms_norm_torch(k, k_weight, eps), cos, sin, interleaved)


def _heads(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _QKNormRopeTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps: float, cos, sin, interleaved: bool):
        q, k = _heads(q), _heads(k)
        qo, ko, rq, rk = triton_kernels.qk_norm_rope_fwd(
            q, k, q_weight, k_weight, cos, sin, eps, interleaved=interleaved
        )
        ctx.save_for_backward(q, k, q_weight, k_weight, rq, rk, cos, sin)
        ctx.interleaved = interleaved
        return qo, ko

    @staticmethod
    def backward(ctx, grad_q: Tensor, grad_k: Tensor):
        q, k, q_weight, k_weight, rq, rk, cos, sin = ctx.saved_tensors
        dq, dk, dwq, dwk = triton_kernels.qk_norm_rope_bwd(
            _heads(grad_q),
            _heads(grad_k),
            q,
            k,
            q_weight,
            k_weight,
            rq,
            rk,
            cos,
            sin,
            interleaved=ctx.interleaved,
        )
        return dq, dk, dwq, dwk, None, None, None, None


def qk_norm_rope(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    *,
    interleaved: bool = False,
    impl: str = "auto",
) -> tuple[Tensor, Tensor]:
    """RoPE of the RMS-normalized heads: ``q [T, NQ, D]``, ``k [T, NK, D]`` (any token / head
    strides, e.g. views of the fused QKV output), norm weights ``q_weight, k_weight [D]`` with
    ``eps``, per-token ``cos, sin [T, ROT]`` in q's dtype (``ROT <= D`` even) -> new
    ``[T, NQ, D]``, ``[T, NK, D]``.

    ``impl``: "torch" (:func:`qk_norm_rope_torch`), "triton" (the kernels) or "auto" (the kernels
    on CUDA when triton imports), as :func:`megatron_grpo.ops.kernels.resolve_impl` decides.
    """
    d = q.size(-1)
    if q.dim() != 3 or k.dim() != 3 or k.size(-1) != d or k.size(0) != q.size(0):
        raise ValueError(
            f"qk_norm_rope: q must be [T, NQ, D] and k [T, NK, D]; got q {list(q.shape)}, "
            f"k {list(k.shape)}"
        )
    if q_weight.shape != (d,) or k_weight.shape != (d,):
        raise ValueError(
            f"qk_norm_rope: q_weight and k_weight must be [D={d}]; got {list(q_weight.shape)} "
            f"and {list(k_weight.shape)}"
        )
    if cos.shape != (q.size(0), cos.size(-1)) or sin.shape != cos.shape:
        raise ValueError(
            f"qk_norm_rope: cos, sin must be [T={q.size(0)}, ROT]; got cos {list(cos.shape)}, "
            f"sin {list(sin.shape)}"
        )
    if resolve_impl(impl, q.device.type) == "torch":
        return qk_norm_rope_torch(q, k, q_weight, k_weight, eps, cos, sin, interleaved)
    args = (q, k, q_weight, k_weight, eps, cos.contiguous(), sin.contiguous(), interleaved)
    grads = (q, k, q_weight, k_weight)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in grads)):
        qo, ko, _, _ = triton_kernels.qk_norm_rope_fwd(
            _heads(q),
            _heads(k),
            q_weight,
            k_weight,
            args[5],
            args[6],
            eps,
            interleaved=interleaved,
        )
        return qo, ko  # no graph to record: skip Function.apply's cost
    return _QKNormRopeTriton.apply(*args)
