"""The fused decode step: one token per row through the model's own weights, ~9 kernels a layer.

megatron-core's layer modules spend a decode step (one token per row) on small kernels: fp32
norms and their casts, a dozen RoPE and reshape ops, SwiGLU's chunk / silu / mul, bias-dropout-
add. A CUDA graph removes their launch cost but not their per-kernel floor (a 0.6B model's
step: ~1000 kernels). This path reads the same parameters and runs per layer::

    add + RMSNorm -> QKV GEMM -> q/k norm + RoPE + KV-cache write -> attention -> proj GEMM
    (TP all-reduce) -> add + RMSNorm -> fc1 GEMM -> SwiGLU -> fc2 GEMM (TP all-reduce)

with each element-wise step one kernel (``ops.layers.decode``: Triton on GPU, the torch reference
elsewhere) that keeps the module path's roundings in the model dtype. An MoE layer's MLP runs
through its own module (router, token dispatch, grouped experts), whose output is already summed
over TP and EP, between the fused attention half and the next add + RMSNorm. Prefill stays on
the modules (its cost is the GEMMs).

:func:`plan_decode` decides once, as data, which path a model decodes with: the fused path
covers GPT layers of the portable spec (dense or MoE) with RMSNorm, SwiGLU, optional q/k RMSNorm
and biases, RoPE (YaRN, partial, interleaved) or learned positions, and TP with at least one KV
head per rank; anything else decodes through the modules, and the plan says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor

from megatron_grpo.megatron.attention.rope import PackedRopeSelfAttention
from megatron_grpo.megatron.model.layers import Norm, SwiGLUMLP
from megatron_grpo.megatron.model.tp_overlap import (
    OverlapColumnParallelLinear,
    OverlapRowParallelLinear,
)
from megatron_grpo.ops.kernels import check_choice, resolve_impl, triton_runs_on
from megatron_grpo.ops.layers import decode as decode_ops
from megatron_grpo.ops.layers.decode import DecodeKernels
from megatron_grpo.rollout.engine.cached_attention import decode_attention, softmax_scale
from megatron_grpo.rollout.engine.decode_overlap import HalvesReduce, plan_overlap
from megatron_grpo.rollout.engine.decode_overlap import describe as describe_overlap
from megatron_grpo.rollout.engine.graphs import plan_graphs
from megatron_grpo.rollout.engine.kv_cache import KVCache
from megatron_grpo.rollout.engine.tp_all_reduce import describe, reduce_tiers

if TYPE_CHECKING:
    from megatron_grpo.megatron.layout import ParallelLayout
    from megatron_grpo.rollout.engine.options import EngineOptions

PATHS = ("auto", "fused", "modules")


@dataclass(frozen=True)
class DecodePlan:
    """How decode steps run, decided once when the engine is built: ``path`` "fused" or
    "modules", the kernels' ``impl`` and their functions (``kernels``: the fused step's ops and
    the sampler), the decode ``attention`` ("triton": exact row lengths, or "sdpa": the masked
    context bucket), and why the modules path was taken (``reason``; empty for the fused path).
    ``graphs``: decode steps replay CUDA graphs (``graphs.plan_graphs``; ``graphs_off``: why
    not, where auto would). ``all_reduce``: the fused step's TP all-reduce tiers
    (``tp_all_reduce.reduce_tiers``; empty: NCCL). ``overlap_rows``: steps of this many rows or
    more run in two overlapped halves (``decode_overlap.plan_overlap``; 0: never). ``str(plan)``
    is the engine's start-up line."""

    path: str
    impl: str
    kernels: DecodeKernels = field(repr=False, compare=False)
    reason: str = ""
    attention: str = "sdpa"
    graphs: bool = False
    graphs_off: str = ""
    all_reduce: tuple[tuple[int, str], ...] = ()
    overlap_rows: int = 0

    def __str__(self) -> str:
        where = f"{self.path}/{self.impl}" if self.path == "fused" else f"modules ({self.reason})"
        reduce = f", TP all-reduce {describe(self.all_reduce)}" if self.all_reduce else ""
        return f"{where}, {self.attention} attention{reduce}{describe_overlap(self.overlap_rows)}"


def plan_decode(
    model: torch.nn.Module,
    tp_size: int,
    path: str = "auto",
    impl: str = "auto",
    attention: str = "auto",
) -> DecodePlan:
    """The decode path of ``model`` (``tp_size``: the layout's): ``path``/``impl`` "auto" picks
    the fused path where :func:`unsupported` finds nothing, with Triton on GPU; an explicit "fused" that the model
    cannot take is an error naming the reason. ``attention`` "auto" follows ``impl``."""
    if path not in PATHS:
        raise ValueError(f"decode path must be one of {PATHS}, got {path!r}")
    check_choice("impl", impl, "decode impl")
    check_choice("decode_attention", attention, "decode attention")
    device = next(model.parameters()).device.type
    if "triton" in (impl, attention) and not triton_runs_on(device):
        raise ValueError("decode impl 'triton' needs the model on GPU; use 'torch' or 'auto'")
    impl = resolve_impl(impl, device)
    if attention == "auto":
        attention = "triton" if impl == "triton" else "sdpa"
    reason = "" if path == "modules" else unsupported(model, tp_size)
    if path == "fused" and reason:
        raise ValueError(f"the fused decode path does not cover this model: {reason}")
    kernels = decode_ops.decode_kernels(impl)  # the one lookup of the impl's functions
    if path == "modules" or reason:
        return DecodePlan("modules", impl, kernels, reason or "chosen", attention)
    return DecodePlan("fused", impl, kernels, "", attention)


def engine_plan(
    model: torch.nn.Module, options: EngineOptions, layout: ParallelLayout, device: torch.device
) -> DecodePlan:
    """Every decode decision of an engine built with ``options`` for ``layout``: the path and
    kernels (:func:`plan_decode`), graphs, the TP all-reduce tiers and the halves' rows."""
    o, tp = options, layout.tp_size
    plan = plan_decode(model, tp, o.decode_path, o.decode_impl, o.decode_attention)
    use, off = plan_graphs(model, o.cuda_graphs, device.type == "cuda")
    reduce = reduce_tiers(o.tp_all_reduce, layout.tp_group, device, plan.path)
    moe = plan.path == "fused" and has_moe(model)
    rows = plan_overlap(o.decode_overlap, tp, plan.path, moe)
    return replace(plan, graphs=use, graphs_off=off, all_reduce=reduce, overlap_rows=rows)


def unsupported(model: torch.nn.Module, tp_size: int) -> str:
    """Why the fused step would not reproduce ``model``'s layers ("" when it does) under
    ``tp_size``-way tensor parallelism."""
    cfg, tp = model.config, tp_size
    checks = (
        (cfg.normalization == "RMSNorm", f"normalization={cfg.normalization}"),
        (cfg.gated_linear_unit and cfg.activation_func is F.silu, "the MLP is not SwiGLU"),
        (getattr(cfg, "activation_func_clamp_value", None) is None, "a clamped GLU"),
        (not getattr(cfg, "glu_linear_offset", 0.0), "glu_linear_offset"),
        (not getattr(cfg, "use_te_activation_func", False), "use_te_activation_func"),
        (not cfg.fp32_residual_connection, "fp32_residual_connection"),
        (not cfg.apply_residual_connection_post_layernorm, "residual after the norm"),
        (not getattr(cfg, "multi_latent_attention", False), "multi-latent attention"),
        (not getattr(cfg, "attention_output_gate", False), "attention_output_gate"),
        (getattr(cfg, "window_size", None) is None, "sliding-window attention"),
        (not getattr(cfg, "qk_l2_norm", False), "qk_l2_norm"),
        ((cfg.num_query_groups or cfg.num_attention_heads) >= tp, "fewer KV heads than TP"),
        (_is_rms(model.decoder.final_layernorm), "the final norm is not the portable RMSNorm"),
    )
    for ok, why in checks:
        if not ok:
            return why
    for i, layer in enumerate(model.decoder.layers):
        why = _layer_unsupported(layer)
        if why:
            return f"layer {i}: {why}"
    return ""


# megatron-core's local TP linears; the overlap ones are those layers (SP is off in generation)
_COLUMN = (ColumnParallelLinear, OverlapColumnParallelLinear)
_ROW = (RowParallelLinear, OverlapRowParallelLinear)


def _exactly(layer: torch.nn.Module, kinds: tuple[type, type]) -> bool:
    """``layer`` is megatron-core's linear (not another subclass) or one of our overlap ones."""
    return type(layer) is kinds[0] or isinstance(layer, kinds[1])


def _is_rms(norm: torch.nn.Module) -> bool:
    return type(norm) is Norm and norm.normalization == "RMSNorm"


def _layer_unsupported(layer: torch.nn.Module) -> str:
    attn, mlp = getattr(layer, "self_attention", None), getattr(layer, "mlp", None)
    if type(layer) is not TransformerLayer or type(attn) not in (
        SelfAttention,
        PackedRopeSelfAttention,
    ):
        return f"{type(layer).__name__} / {type(attn).__name__} is not the portable GPT layer"
    if not (_is_rms(layer.input_layernorm) and _is_rms(layer.pre_mlp_layernorm)):
        return "its norms are not the portable RMSNorm (Transformer Engine fuses them)"
    if not _exactly(attn.linear_qkv, _COLUMN) or not _exactly(attn.linear_proj, _ROW):
        return "its attention linears are not megatron-core's local ones"
    for qk in (attn.q_layernorm, attn.k_layernorm):
        if not (_is_rms(qk) or type(qk) is IdentityOp):
            return "its q/k norm is not the portable RMSNorm"
    if type(attn.q_layernorm) is not type(attn.k_layernorm):
        return "only one of q/k is normed"
    if _is_moe(mlp):
        pass  # the MoE block runs as its module
    elif type(mlp) not in (MLP, SwiGLUMLP) or not _exactly(mlp.linear_fc1, _COLUMN):
        return "its MLP is not megatron-core's local MLP"
    if type(getattr(layer, "cross_attention", IdentityOp)) is not IdentityOp:
        return "cross attention"
    return ""


def has_moe(model: torch.nn.Module) -> bool:
    """Whether any of ``model``'s layers is an MoE layer."""
    return any(_is_moe(layer.mlp) for layer in model.decoder.layers)


def _is_moe(mlp: torch.nn.Module) -> bool:
    return hasattr(mlp, "router")  # megatron-core's MoELayer and ours built on it


@dataclass(frozen=True)
class _Layer:
    """One layer's parameters (the live tensors: in-place updates are seen); an MoE layer's
    ``moe`` module instead of ``fc1`` / ``fc2``."""

    norm1: tuple[Tensor, float]
    qkv: tuple[Tensor, Tensor | None]
    qk_norm: tuple[Tensor, Tensor, float] | None
    proj: tuple[Tensor, Tensor | None]
    norm2: tuple[Tensor, float]
    fc1: tuple[Tensor, Tensor | None] | None
    fc2: tuple[Tensor, Tensor | None] | None
    moe: torch.nn.Module | None = None

    @classmethod
    def of(cls, layer: torch.nn.Module) -> _Layer:
        attn, mlp = layer.self_attention, layer.mlp
        qk = None
        if type(attn.q_layernorm) is Norm:
            qk = (attn.q_layernorm.weight, attn.k_layernorm.weight, attn.q_layernorm.eps)
        moe = _is_moe(mlp)
        return cls(
            _norm(layer.input_layernorm),
            _linear(attn.linear_qkv),
            qk,
            _linear(attn.linear_proj),
            _norm(layer.pre_mlp_layernorm),
            None if moe else _linear(mlp.linear_fc1),
            None if moe else _linear(mlp.linear_fc2),
            mlp if moe else None,
        )


def _norm(norm: Norm) -> tuple[Tensor, float]:
    return norm.weight, norm.eps


def _linear(linear: torch.nn.Module) -> tuple[Tensor, Tensor | None]:
    return linear.weight, linear.bias


class FusedDecoder:
    """``FusedDecoder(model, plan.kernels, layout.tp_group)(ids, pos, cache, rope)``:
    final-normed hidden ``[b, H]``."""

    def __init__(
        self,
        model: torch.nn.Module,
        kernels: DecodeKernels,
        tp_group: dist.ProcessGroup | None,
        reduce: HalvesReduce | None = None,
    ) -> None:
        """``tp_group``: the layout's (None without TP). ``reduce``: the row-parallel outputs'
        sums over TP (None: NCCL's, one batch); with ``rows`` it splits steps into two
        overlapped halves."""
        self.model = model
        self.add_norm, self.qkv_rope = kernels.add_rms_norm, kernels.qkv_rope_cache
        self.swiglu = kernels.swiglu
        cfg = model.config
        tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.groups = (cfg.num_query_groups or cfg.num_attention_heads) // tp
        self.per_group = cfg.num_attention_heads // (
            cfg.num_query_groups or cfg.num_attention_heads
        )
        self.layers = [_Layer.of(layer) for layer in model.decoder.layers]
        self.final = _norm(model.decoder.final_layernorm)
        device = next(model.parameters()).device
        self.reduce = reduce or HalvesReduce.build(tp_group, (), 0, device)
        self.scale = softmax_scale(model)

    def __call__(
        self,
        ids: Tensor,
        pos: Tensor,
        cache: KVCache,
        rope: tuple[Tensor, Tensor] | None,
    ) -> Tensor:
        """Tokens ``ids [b]`` at positions ``pos [b]`` (row i = cache slot i, mask planned).
        Each layer runs per half: its attention, then its MLP; a half's TP sum is waited for
        only when that half needs it (:mod:`decode_overlap`)."""
        emb = self.model.embedding(input_ids=ids[:, None], position_ids=pos[:, None])[0]
        res, x = self.add_norm(emb.contiguous(), *self.layers[0].norm1)
        rope_args = None if rope is None else (*rope, cache.rotary_interleaved)
        step = (cache, pos, rope_args)
        halves = self.reduce.halves(ids.size(0))
        state = [(res[rows], x[rows]) for rows in halves]
        after: list[tuple] = [()] * len(halves)  # the norm + bias that ends each half's sum
        for i in range(len(self.layers)):
            for stage in (self._attention, self._mlp):
                for j, rows in enumerate(halves):
                    state[j] = self._land(j, state[j], after[j])
                    after[j] = stage(j, rows, state[j][1], i, step)
        state = [self._land(j, state[j], after[j]) for j in range(len(halves))]
        return state[0][1] if len(state) == 1 else torch.cat([x for _, x in state])

    def _land(self, j: int, state: tuple[Tensor, Tensor], after: tuple) -> tuple[Tensor, Tensor]:
        """Half ``j``'s residual and normed input once its pending sum (if any) is added."""
        if not after:
            return state
        norm, bias = after
        return self.add_norm(self.reduce.wait(j), *norm, residual=state[0], bias=bias)

    def _attention(self, j: int, rows: slice, x: Tensor, i: int, step: tuple) -> tuple:
        """Launch half ``j``'s (rows ``rows``, normed ``x``) attention output sum in layer
        ``i``; returns what ends it (norm2, the projection's bias)."""
        cache, pos, rope_args = step
        layer = self.layers[i]
        k_cache, v_cache = cache.kv[i, 0, rows], cache.kv[i, 1, rows]
        qkv = F.linear(x, *layer.qkv)
        q = self.qkv_rope(
            qkv, self.groups, self.per_group, pos[rows], k_cache, v_cache, layer.qk_norm, rope_args
        )
        att = decode_attention(q, k_cache, v_cache, cache, self.scale, rows)
        self.reduce.launch(j, F.linear(att, layer.proj[0]))  # partial sums; bias added after
        return layer.norm2, layer.proj[1]

    def _mlp(self, j: int, rows: slice, x: Tensor, i: int, step: tuple) -> tuple:
        """Launch half ``j``'s MLP output sum over TP in layer ``i`` (an MoE module's is
        already summed over TP and EP); returns what ends it (the next norm, the MLP's bias)."""
        layer = self.layers[i]
        nxt = self.layers[i + 1].norm1 if i + 1 < len(self.layers) else self.final
        if layer.moe is not None:  # [s=1, b, H] through the module, already summed
            out, bias = layer.moe(x[None])
            self.reduce.ready(j, out[0])
            return nxt, bias
        hidden = self.swiglu(F.linear(x, layer.fc1[0]), layer.fc1[1])
        self.reduce.launch(j, F.linear(hidden, layer.fc2[0]))
        return nxt, layer.fc2[1]
