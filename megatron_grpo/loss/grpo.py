"""grpo_loss: the public GRPO-family loss over a packed micro-batch."""

from __future__ import annotations

from torch import Tensor

from megatron_grpo.loss import checks
from megatron_grpo.loss.config import GRPOLossConfig
from megatron_grpo.loss.inputs import LossInputs
from megatron_grpo.loss.math import build_context, objective, raise_on_nonfinite
from megatron_grpo.loss.metrics import MetricDict, merge_metrics


def grpo_loss(
    cfg: GRPOLossConfig,
    inputs: LossInputs | None = None,
    *,
    logprobs: Tensor,
    entropy: Tensor | None = None,
    **overrides: object,
) -> tuple[Tensor, MetricDict]:
    """GRPO / PPO / GSPO loss of one packed micro-batch.

    Args:
        cfg: the loss options (:class:`GRPOLossConfig`).
        inputs: the policy-independent inputs (:class:`LossInputs`); or its fields by keyword
            (``overrides``, below; they replace those of ``inputs`` when both are given).
        logprobs: ``[T]`` current policy log-probs of the sampled tokens (differentiable).
        entropy: ``[T]`` per-token policy entropy (needed when ``entropy_coef != 0``).

    The inputs (:class:`LossInputs` fields):
        old_logprobs: ``[T]`` log-probs of the policy that produced the batch, under the
            training engine. None = on-policy (the update is the only optimizer step on these
            rollouts): ``logprobs.detach()`` serves as the old log-probs, so the ratio is exactly
            1 and no old-log-prob pass is needed; IS correction and the mismatch metrics then
            compare the current log-probs with ``rollout_logprobs``.
        advantages: ``[T]`` per-token advantages (a sequence's value broadcast to its tokens).
        loss_mask: ``[T]`` bool, True at tokens that enter the loss.
        cu_seqlens: ``[S+1]`` int32/int64 sequence boundaries (0, ..., T).
        ref_logprobs: ``[T]`` reference-policy log-probs (needed when ``kl_coef > 0``; when given
            otherwise only the KL metric is computed).
        rollout_logprobs: ``[T]`` generation-engine log-probs (needed for IS correction; when
            given the mismatch metrics are computed).
        denominator: the ``cfg.loss_agg`` count over the whole optimizer step (see
            :mod:`megatron_grpo.loss.reduction`); None = this micro-batch's count (over CP).
            Megatron's ``calculate_per_token_loss`` path passes 1.0 and hands Megatron the count.
        cp_group: context-parallel group when sequences are split over CP ranks (each rank holds
            all S sequence slots): sequence-level sums are all-reduced over it.

    Inputs may be bf16 / fp16 / fp32; the math runs in float32. Masked positions never enter the
    arithmetic: any value there (even NaN or inf) leaves the loss and the gradients untouched.

    Returns:
        ``(loss, metrics)``: ``loss`` is a float32 scalar, the sum over local valid tokens of
        ``coef_t * objective_t``; ``metrics`` maps namespaced keys to exactly-aggregating values
        (merge / all-reduce them with :func:`megatron_grpo.loss.reduce_metrics`).
    """
    inp = LossInputs.of(inputs, **overrides)
    checks.check_config(cfg)
    mask = inp.loss_mask
    checks.check_mask(mask)
    checks.check_float("logprobs", logprobs, mask.numel(), mask.device)
    checks.check_float("entropy", entropy, mask.numel(), mask.device)
    checks.check_entropy_needed(cfg, entropy)
    ctx = build_context(cfg, inp)
    lp = logprobs.index_select(0, ctx.index)
    ent = None if entropy is None else entropy.index_select(0, ctx.index)
    # the finiteness check (a host sync) after the loss is queued: the GPU works meanwhile
    loss, metrics = objective(cfg, ctx, lp, ent, check_finite=False)
    raise_on_nonfinite(cfg, lp, ent)
    return loss, merge_metrics([ctx.metrics, metrics])
