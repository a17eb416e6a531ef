"""The next token at tensor parallelism: sample from the vocabulary shards, or gather them first.

At TP > 1 each rank holds the logits of its vocabulary shard ``[b, V_local]``. The "gathered"
path all-gathers them into fp32 ``[b, V_padded]`` on every rank (at TP 4, 256 rows and a 152k
vocabulary: 156 MB a decode step, as much as all the layers' all-reduces of an 8B model), samples
(:func:`~megatron_grpo.rollout.engine.sampling.sample`) and broadcasts TP rank 0's tokens. The
"vocab_parallel" path draws the same inverse-CDF sample from the shards with two small
collectives (Megatron's vocab-parallel cross entropy, turned into a sampler)::

    stats = all_gather([local max, sum exp(x - local max), ties at the local max])  # [TP, b, 3]
    mass  = each shard's probability mass; the shard whose cumulative range holds u * total
            draws locally (its own cumulative sum), the others bring -1
    token, logp = all_reduce_max([token, logp])                                     # [b, 2]

Every rank computes the owner from the same gathered numbers, so exactly one rank draws each
row and every rank ends with the same token; the recorded log-prob is over the whole real
vocabulary (``logsumexp`` from the stats), as :func:`sample` records it. It covers untruncated
sampling (RL's default) and greedy (``top_k: 1``, ties drawn by ``u`` as :func:`sample` does);
top-k > 1 and top-p need the sorted whole vocabulary and gather.

:func:`sampling_path` is the one decision (``rollout.engine.tp_sampling``); :func:`next_tokens`
is what every engine calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.megatron.gpt import output_weight
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.ops.kernels import CHOICES, check_choice
from megatron_grpo.ops.lm_head.gemm import mm_f32
from megatron_grpo.rollout.engine import model_io as io
from megatron_grpo.rollout.engine.params import SamplingParams
from megatron_grpo.rollout.engine.sampling import sample

TP_SAMPLING = CHOICES["tp_sampling"]


def vocab_parallel_covers(params: SamplingParams) -> bool:
    """Whether ``params`` draw from a set the shards decide alone: all tokens, or the ties at
    the maximum (greedy)."""
    return params.top_k in (0, 1) and params.top_p == 1.0


def sampling_path(choice: str, params: SamplingParams, tp_size: int) -> str:
    """The one decision: "gathered" or "vocab_parallel". "auto": vocab-parallel at TP > 1
    wherever it covers ``params``; an explicit "vocab_parallel" it cannot serve is an error."""
    check_choice("tp_sampling", choice, "rollout.engine.tp_sampling")
    covered = vocab_parallel_covers(params)
    if choice == "vocab_parallel" and not covered:
        raise ValueError(
            "rollout.engine.tp_sampling 'vocab_parallel' samples untruncated or greedy only; "
            f"rollout.sampling has top_k={params.top_k}, top_p={params.top_p} (use 'gathered' "
            "or 'auto')"
        )
    if tp_size > 1 and (choice == "vocab_parallel" or (choice == "auto" and covered)):
        return "vocab_parallel"
    return "gathered"


def next_tokens(
    model: torch.nn.Module,
    hidden: Tensor,
    uniforms: Tensor,
    params: SamplingParams,
    layout: ParallelLayout,
    choice: str = "auto",
    rows_kernel: Callable | None = None,
) -> tuple[Tensor, Tensor]:
    """``hidden [b, H]`` (the same on every TP rank) -> ``(tokens [b] int64, logprobs [b]
    fp32)``, the same on every TP rank; ``uniforms [b]`` in [0, 1), the same on every rank."""
    if sampling_path(choice, params, layout.tp_size) == "gathered":
        logits = io.head_logits(model, hidden, layout)
        tokens, logp = sample(logits, uniforms, params, rows_kernel)
        io.broadcast_from_tp_src(layout, tokens, logp)
        return tokens, logp
    weight = output_weight(model)
    local = mm_f32(hidden.to(weight.dtype), weight.t())  # [b, V_local]
    start = layout.tp_rank * local.size(-1)
    return sample_vocab_parallel(local, start, uniforms, params, layout.tp_group)


def sample_vocab_parallel(
    local: Tensor,
    start: int,
    uniforms: Tensor,
    params: SamplingParams,
    group: dist.ProcessGroup | None,
) -> tuple[Tensor, Tensor]:
    """Inverse-CDF sample from vocabulary shards (module docstring): ``local [b, V_local]``
    fp32 logits of tokens ``start ..``, ``uniforms [b]``; ``(tokens [b] int64, logprobs [b]
    fp32)`` on every rank of ``group`` (None: one shard holds the whole vocabulary)."""
    if not vocab_parallel_covers(params):
        raise ValueError(f"vocab-parallel sampling: top_k={params.top_k} top_p={params.top_p}")
    real = max(0, min(local.size(-1), params.vocab_size - start))  # padding rows: no token
    scaled = local.float() / params.temperature
    scaled[:, real:] = float("-inf")
    top = scaled.amax(-1, keepdim=True)  # [b, 1]; -inf for a shard of padding only
    safe_top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    sums = (scaled - safe_top).exp().sum(-1, keepdim=True)
    at_top = (scaled == top).sum(-1, keepdim=True).float()
    stats = torch.cat([top, sums, at_top], dim=-1)  # [b, 3]
    gathered = _all_gather(stats, group)  # [P, b, 3]
    m, s, ties = gathered.unbind(-1)  # [P, b] each
    big = m.amax(0)  # [b] the global maximum
    scale = torch.where(torch.isfinite(m), (m - big).exp(), torch.zeros_like(m))
    log_z = big + (s * scale).sum(0).log()  # [b]
    greedy = params.top_k == 1
    mass = torch.where(m == big, ties, torch.zeros_like(ties)) if greedy else s * scale
    ends = mass.cumsum(0)  # [P, b] each shard's cumulative end
    total = ends[-1]
    target = torch.minimum(uniforms.to(total.dtype) * total, torch.nextafter(total, 0 * total))
    owner = (ends <= target).sum(0)  # [b] the shard whose range holds the target
    rank = 0 if group is None else dist.get_rank(group)
    rows = torch.arange(owner.numel(), device=owner.device)
    before = (ends - mass)[owner.clamp(max=mass.size(0) - 1), rows]
    weights = (scaled == big[:, None]).float() if greedy else (scaled - big[:, None]).exp()
    idx = _draw(weights, (target - before)[:, None])
    logp = scaled.gather(-1, idx[:, None]).squeeze(-1) - log_z
    mine = owner == rank
    out = torch.stack(
        [torch.where(mine, idx + start, -1).double(), torch.where(mine, logp, -torch.inf).double()],
        dim=-1,
    )  # [b, 2]
    if group is not None:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out[:, 0].long(), out[:, 1].float()


def _draw(weights: Tensor, target: Tensor) -> Tensor:
    """``[b]`` the first column whose cumulative weight exceeds ``target [b, 1]``, at most the
    last column with weight (the shard's own sum can round below the gathered one)."""
    cdf = weights.cumsum(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    cols = torch.arange(weights.size(-1), device=weights.device)
    last = torch.where(weights > 0, cols, 0).amax(-1)
    return torch.minimum(idx, last)


def _all_gather(stats: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    if group is None:
        return stats[None]
    out = stats.new_empty(dist.get_world_size(group) * stats.size(0), *stats.shape[1:])
    dist.all_gather_into_tensor(out, stats.contiguous(), group=group)
    return out.view(-1, *stats.shape)
