"""Per-rank memory plan and the ``--dry-run`` layout check, without GPUs and without a model.

``memory_plan`` estimates, for every distinct rank role (a pipeline stage; all TP/CP/DP/EP ranks
of a stage hold the same amounts), the bytes of parameters, gradients, optimizer state, an
optional frozen reference copy, activations of the in-flight micro-batches and the log-prob/loss
working set. Parameter counts are exact for the models ``build_model`` builds (the tests compare
them with ``numel``); activations and working sets are estimates whose assumptions the plan
lists. The log-prob working set is that of the LM-head plan the step runs
(:func:`megatron_grpo.ops.lm_head.plan.plan_lm_head`: path, tiles, loop order, d_weight mode). The rank
layout and ``--dry-run`` live in :mod:`megatron_grpo.train.dry_run`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron.config import ModelConfig, ParallelConfig
from megatron_grpo.megatron.model.build import padded_vocab_size
from megatron_grpo.megatron.plan.activations import (  # noqa: F401 (public names, re-exported)
    in_flight_micro_batches,
    layer_activation_bytes,
    stage_activation_bytes,
)
from megatron_grpo.megatron.plan.params import (  # noqa: F401 (public names, re-exported)
    is_moe_layer,
    layer_params,
    stage_layers,
    stage_params,
)
from megatron_grpo.ops.lm_head.options import LMHeadOptions
from megatron_grpo.ops.lm_head.plan import REQUESTS, HeadShape, LMHeadPlan, plan_lm_head
from megatron_grpo.ops.lm_head.reference import STATS_BLOCK

GIB = 2**30
ASSUMPTIONS = (
    "activations: bf16/fp16 tensors saved for backward with flash/SDPA attention (no s^2 term), "
    "no dropout masks; SP divides the norm/GEMM-input terms by TP, TP divides the rest",
    "MoE: balanced routing (each rank's experts get topk * ETP copies of its SP tokens)",
    "pipeline 1F1B with >= PP micro-batches: stage p holds PP - p micro-batches (interleaved: "
    "Megatron's warm-up count of model chunks)",
    "full recompute keeps each layer (uniform: each group of N layers) input plus one unit "
    "recomputed at a time; selective recompute (plan/activations.py): layernorm drops the norm "
    "outputs (portable spec; nothing with TE's fused norms), mlp the dense MLP's fc1 and "
    "activation outputs, core_attn flash attention's fp32 logsumexp only (q/k/v and the output "
    "stay saved), moe/moe_act/shared_experts counted as saving nothing; one layer's recomputed "
    "modules counted on top",
    "log-prob working set: every micro-batch token scored, d_weight into Megatron DDP's "
    "main_grad (fp32 with grad_reduce_in_fp32); fused/op: the returned d_hidden is not counted",
    "excluded: CUDA context, NCCL buffers, allocator fragmentation, rollout generation",
)


@dataclass(frozen=True)
class LossWorkingSet:
    """Bytes of one log-prob path on the last stage for one micro-batch beyond the parameter
    gradients: ``logits`` (the vocabulary-sized buffers: a logits tile / chunk for our paths) and
    ``other`` (gathered hidden, fp32 d_hidden / d_weight buffers, [T] vectors)."""

    path: str
    logits: float
    other: float

    @property
    def total(self) -> float:
        return self.logits + self.other


@dataclass(frozen=True)
class StagePlan:
    """One rank role: pipeline stage ``stage``; ``bytes`` per component, params in elements."""

    stage: int
    layers: int
    moe_layers: int
    dense_params: int
    expert_params: int
    in_flight: float
    bytes: dict[str, float]

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())


@dataclass(frozen=True)
class MemoryPlan:
    stages: tuple[StagePlan, ...]
    logprob_path: str  # as requested (GRPOStep's ``logprob_path``)
    loss_paths: dict[str, LossWorkingSet]
    micro_batch_tokens: int
    params_dtype: torch.dtype
    ranks_per_stage: int  # TP x CP x DP ranks share each stage's row
    lm_head: LMHeadPlan | None = None  # the plan of ``logprob_path`` (what the last stage runs)

    @property
    def peak_bytes(self) -> float:
        return max(s.total_bytes for s in self.stages)


# [T]-sized vectors of the ops per scored token (upper bound): int64 local targets, the fp32
# stats pass ([4, T]), lse / pz / logp / entropy, the upstream [T] gradients.
ROW_BYTES = 48
_DTYPE_OF_BYTES = {4: torch.float32, 2: torch.bfloat16}


def lm_head_plan(
    path: str,
    *,
    tokens: float,
    hidden: int,
    v_local: int,
    param_bytes: int,
    main_grad_bytes: int | None = 4,
    loss_cfg: GRPOLossConfig | None = None,
    options: LMHeadOptions | None = None,
) -> LMHeadPlan:
    """The LM-head plan of a training step on the last stage (CUDA, gradients of hidden and
    weight wanted, every one of ``tokens`` scored; ``main_grad_bytes``: see
    :func:`loss_working_set`; ``loss_cfg`` None = the default token-ratio loss; ``options``:
    the step's LM-head options, None = the defaults, their path replaced by ``path``)."""
    if param_bytes not in _DTYPE_OF_BYTES or main_grad_bytes not in (None, *_DTYPE_OF_BYTES):
        raise ValueError(
            f"param_bytes must be 2 or 4 and main_grad_bytes 2, 4 or None, got {param_bytes} "
            f"and {main_grad_bytes}"
        )
    main_grad = None if main_grad_bytes is None else _DTYPE_OF_BYTES[main_grad_bytes]
    shape = HeadShape(
        rows=max(math.ceil(tokens), 1),
        v_local=v_local,
        n_valid=v_local,
        hidden=hidden,
        dtype=_DTYPE_OF_BYTES[param_bytes],
        main_grad_dtype=main_grad,
        device_type="cuda",
    )
    loss = GRPOLossConfig() if loss_cfg is None else loss_cfg
    return plan_lm_head(shape, LMHeadOptions.of(options, path=path), loss=loss)


def _tiled_bytes(plan: LMHeadPlan, hidden: int, tp: int) -> tuple[float, float]:
    """(logits tile: fp32, or the GEMM dtype's d logits with the fused epilogue; d_hidden /
    d_weight buffers) of the op's tiled passes (``ops.lm_head.passes``) in the plan's loop order."""
    tiling, n = plan.tiling(), plan.rows
    tile = min(tiling.rows, n) * tiling.cols * _size(plan.tile_dtype)
    if plan.loop_order == "rows_outer":  # an fp32 [R, H] d_hidden block
        other = min(tiling.rows, n) * hidden * 4
    else:  # an fp32 [T, H] d_hidden, an fp32 [Vc, H] d_weight tile over several row blocks
        other = n * hidden * 4 + (tiling.cols * hidden * 4 if len(tiling.row_blocks()) > 1 else 0)
    other += n * hidden * 4 if tp > 1 else 0  # d_hidden kept in fp32 for the TP reduction
    return tile, other


def _single_pass_bytes(plan: LMHeadPlan, hidden: int, v_local: int, tp: int) -> tuple[float, float]:
    """([C, V_local] chunk: fp32 logits, or shifted logits in the GEMM dtype with the fused
    epilogue; buffers) of the fused single pass (``ops.lm_head.single_pass``): the chunk's fp32 [C, H]
    d_hidden and block statistics, the d_hidden kept for backward (fp32 [T, H] under TP, else
    in the hidden dtype: the gradient itself) and what the plan's d_weight accumulator holds
    beyond the gradient (an int8 residual, an fp32 buffer or nothing)."""
    n, chunk = plan.rows, min(plan.chunk_rows, plan.rows)
    blocks = -(-v_local // STATS_BLOCK)
    other = chunk * hidden * 4 + chunk * blocks * 16 + (n * hidden * 4 if tp > 1 else 0)
    other += plan.accumulator_bytes
    return chunk * v_local * _size(plan.tile_dtype), other


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def loss_working_set(
    path: str,
    *,
    tokens: float,
    hidden: int,
    v_local: int,
    param_bytes: int,
    sp: bool,
    tp: int,
    main_grad_bytes: int | None = 4,
    loss_cfg: GRPOLossConfig | None = None,
    options: LMHeadOptions | None = None,
) -> LossWorkingSet:
    """Log-prob + loss buffers of one micro-batch on the last stage (``tokens`` on this CP rank,
    all of them scored: an upper bound for our paths, which score response tokens only).

    ``main_grad_bytes``: the weight's ``main_grad`` (Megatron DDP: 4 with grad_reduce_in_fp32,
    else the param size), None = autograd's ``weight.grad``. ``path``: a ``GRPOStep``
    ``logprob_path``; the buffers are those of its plan (:func:`lm_head_plan`: "fused" takes the
    single pass where the plan does, else the op's tiled passes). Transients of the final TP
    reduction (after the tile is freed) are not counted.
    """
    if path not in REQUESTS:
        raise ValueError(f"logprob_path must be one of {list(REQUESTS)}, got {path!r}")
    plan = lm_head_plan(
        path,
        tokens=tokens,
        hidden=hidden,
        v_local=v_local,
        param_bytes=param_bytes,
        main_grad_bytes=main_grad_bytes,
        loss_cfg=loss_cfg,
        options=options,
    )
    if plan.path == "megatron":
        # output_layer logits [T, V_local] in the param dtype + the fp32 copy the cross entropy
        # turns into the saved softmax (in backward: fp32 grad in place + its cast for the GEMM).
        logits = tokens * v_local * (4 + param_bytes)
        other = 2 * tokens * hidden * param_bytes + 8 * tokens  # gathered input, d_hidden, [T]
        return LossWorkingSet(path, logits, other)
    if plan.path == "fused_single_pass":
        logits, other = _single_pass_bytes(plan, hidden, v_local, tp)
    else:
        logits, other = _tiled_bytes(plan, hidden, tp)
    n = plan.rows
    other += n * hidden * param_bytes if sp and tp > 1 else 0  # all-gathered hidden
    return LossWorkingSet(path, logits, other + ROW_BYTES * n)


# ----------------------------------------------------------------------------- the plan
def _dtype(cfg: ModelConfig, params_dtype: torch.dtype | str | None) -> torch.dtype:
    if isinstance(params_dtype, torch.dtype):
        return params_dtype
    if params_dtype is None:
        return cfg.torch_dtype("cuda")  # plans are for GPU runs: "auto" = bfloat16
    if params_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"params_dtype must be float32, bfloat16 or float16, got {params_dtype!r}")
    return getattr(torch, params_dtype)


def _static_bytes(
    params: tuple[int, int],
    pbytes: int,
    par: ParallelConfig,
    shards: tuple[int, int],
    optimizer: str,
    reference_model: bool,
) -> dict[str, float]:
    """params = (non-expert, expert) elements; shards = optimizer shards of each."""
    total = sum(params)
    states = (8 if optimizer == "adam" else 4) + (4 if pbytes < 4 else 0)  # m, v (+ fp32 master)
    return {
        "params": total * pbytes,
        "grads": total * (4 if par.grad_reduce_in_fp32 else pbytes),
        "optimizer": states * (params[0] / shards[0] + params[1] / shards[1]),
        "reference": total * pbytes if reference_model else 0.0,
    }


def _head_args(cfg: ModelConfig, par: ParallelConfig, tokens: float, pbytes: int, **kw) -> dict:
    """The arguments of :func:`lm_head_plan` for this model and layout (``kw``: loss config,
    LM-head options)."""
    tp = par.tensor_model_parallel_size
    main_grad = 4 if par.grad_reduce_in_fp32 else pbytes  # Megatron DDP's grad buffer dtype
    v_local = padded_vocab_size(cfg, tp) // tp
    return dict(
        tokens=tokens,
        hidden=cfg.hidden_size,
        v_local=v_local,
        param_bytes=pbytes,
        main_grad_bytes=main_grad,
        **kw,
    )


def _loss_paths(path: str, par: ParallelConfig, head_args: dict) -> dict:
    """Working sets of the three families (for comparison) and of ``path``."""
    tp, sp = par.tensor_model_parallel_size, par.sequence_parallel
    names = dict.fromkeys(("fused", "op", "megatron", path))
    return {p: loss_working_set(p, sp=sp, tp=tp, **head_args) for p in names}


def memory_plan(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    *,
    micro_batch_tokens: int,
    use_distributed_optimizer: bool,
    dp_size: int,
    lm_head: LMHeadOptions | None = None,
    params_dtype: torch.dtype | str | None = None,
    optimizer: str = "adam",
    reference_model: bool = False,
    loss_cfg: GRPOLossConfig | None = None,
) -> MemoryPlan:
    """Per-rank memory of training ``model_cfg`` under ``parallel_cfg`` with ``dp_size`` DP ranks.

    ``micro_batch_tokens``: packed tokens per micro-batch (before CP splitting). Recompute
    settings are the model's (``model_cfg.recompute_*``, the fields the model is built with).
    ``params_dtype`` None = the model's dtype on GPU (``auto`` = bfloat16). ``optimizer``:
    "adam" (fp32 m, v and master weights) or "sgd" (momentum); sharded over DP x CP (experts:
    expert-DP) with ``use_distributed_optimizer``. ``reference_model``: a frozen copy.
    ``lm_head``: the step's LM-head options (None = the defaults); their path (None = "fused",
    as ``GRPOStep``) picks which loss working set enters the last stage's total; "fused", "op"
    and "megatron" are all in ``loss_paths`` for comparison. ``loss_cfg`` (None = defaults:
    token ratio) and the options (memory budget, chunk size, ...) go to the LM-head plan
    (``lm_head``; "fused" with GSPO runs path "fused_tiled").
    """
    if micro_batch_tokens <= 0 or dp_size <= 0:
        raise ValueError(
            f"micro_batch_tokens and dp_size must be positive, got "
            f"{micro_batch_tokens} and {dp_size}"
        )
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    dtype, par = _dtype(model_cfg, params_dtype), parallel_cfg
    pbytes = torch.finfo(dtype).bits // 8
    tp, cp = par.tensor_model_parallel_size, par.context_parallel_size
    edp = par.expert_data_parallel_size(par.model_parallel_size * dp_size)
    shards = (dp_size * cp, edp) if use_distributed_optimizer else (1, 1)
    tokens = micro_batch_tokens / cp
    logprob_path = (lm_head.path if lm_head is not None else None) or "fused"
    head = _head_args(model_cfg, par, tokens, pbytes, loss_cfg=loss_cfg, options=lm_head)
    paths = _loss_paths(logprob_path, par, head)
    stages, pp = [], par.pipeline_model_parallel_size
    for s in range(pp):
        params = stage_params(model_cfg, par, s)
        parts = _static_bytes(params, pbytes, par, shards, optimizer, reference_model)
        parts["activations"], flight = stage_activation_bytes(model_cfg, par, s, tokens, pbytes)
        parts["logprobs"] = paths[logprob_path].total if s == pp - 1 else 0.0
        layers = stage_layers(model_cfg, par, s)
        moe = sum(is_moe_layer(model_cfg, i) for i in layers)
        stages.append(StagePlan(s, len(layers), moe, *params, flight, parts))
    ranks = tp * cp * dp_size
    lm_head = lm_head_plan(logprob_path, **head)
    return MemoryPlan(tuple(stages), logprob_path, paths, micro_batch_tokens, dtype, ranks, lm_head)


_COLUMNS = ("params", "grads", "optimizer", "reference", "activations", "logprobs")


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table: one row per rank role (a pipeline stage: its TP / CP / DP / EP ranks
    hold the same amounts), GiB per component, then the log-prob working sets and assumptions."""
    head = f"{'role':<6}{'ranks':>6}{'layers':>7}{'params(M)':>10}"
    head += "".join(f"{c:>12}" for c in _COLUMNS)
    lines = [
        f"memory plan per rank (GiB): {plan.micro_batch_tokens} tokens per micro-batch, "
        f"{str(plan.params_dtype).removeprefix('torch.')} parameters, "
        f"log-prob path {plan.logprob_path!r}",
        head + f"{'total':>10}",
    ]
    for s in plan.stages:
        role = f"pp{s.stage}"
        layers = f"{s.layers}" + (f"/{s.moe_layers}m" if s.moe_layers else "")
        row = f"{role:<6}{plan.ranks_per_stage:>6}{layers:>7}{s.params / 1e6:>10.1f}"
        row += "".join(f"{s.bytes[c] / GIB:>12.2f}" for c in _COLUMNS)
        lines.append(row + f"{s.total_bytes / GIB:>10.2f}")
    lines.append(
        f"peak {plan.peak_bytes / GIB:.2f} GiB ({plan.peak_bytes / 1e9:.1f} GB); "
        "'layers' counts decoder layers (/ MoE layers)"
    )
    ours = plan.loss_paths["fused"]
    lines.append("log-prob/loss working set per micro-batch on the last stage:")
    for p in plan.loss_paths.values():
        ratio = p.logits / ours.logits if ours.logits else float("nan")
        lines.append(
            f"  {p.path:<9} logits {p.logits / GIB:8.3f} GiB + other "
            f"{p.other / GIB:7.3f} GiB  (logits {ratio:.1f}x fused)"
        )
    if plan.lm_head is not None:
        lines.append(f"LM-head plan ({plan.logprob_path!r}): {plan.lm_head}")
    lines.append("assumptions: " + "; ".join(ASSUMPTIONS))
    return "\n".join(lines)
