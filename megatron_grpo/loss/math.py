"""The GRPO loss math: the one place that computes ratios, clips, KL, IS weights, coefficients.

THE SEAM (used by ``grpo_loss`` and by the fused log-prob path ``ops/lm_head/fused_grpo.py``)
------------------------------------------------------------------------------------
The loss is split into two calls:

1. ``ctx = build_context(cfg, old_logprobs=..., advantages=..., loss_mask=..., cu_seqlens=...,
   ref_logprobs=None, rollout_logprobs=None, denominator=None, cp_group=None)``

   Everything that does not depend on the current policy, computed once, in float32, on the
   N valid rows only (``ctx.index`` ``[N]`` int64 indexes the packed ``[T]`` inputs): old / ref
   log-probs, advantages, the detached IS weights (``ctx.is_weight``, MIS and non-finite
   drops folded into the coefficients), and the aggregation coefficients ``ctx.coef`` ``[N]`` that
   already include ``1 / denominator`` and ``1 / |y_i|`` or ``1 / max_response_length``.
   ``ctx.metrics`` holds the policy-independent metrics (IS weights, train-vs-rollout mismatch).
   ``ctx.rows(sel)`` returns the context of a row subset (``sel``: slice or index tensor into
   ``[N]``) with empty ``metrics``, so chunk metrics never double count.

2. ``loss, metrics = objective(cfg, ctx_or_slice, logprobs_valid, entropy_valid=None)``

   ``logprobs_valid`` / ``entropy_valid`` ``[n]`` are the current policy's values at
   ``ctx.index`` (of the slice). Returns ``sum(coef * (is_weight * pg + kl_coef * kl -
   entropy_coef * entropy))`` (a float32 scalar, differentiable w.r.t. both inputs) and the
   policy-dependent metric pieces.

   * ``ratio_level="token"``: exactly separable over rows. Summing ``objective`` over a
     partition of the rows gives ``grpo_loss`` (value and gradient), and
     ``merge_metrics([ctx.metrics, *chunk_metrics])`` gives its metrics.
   * ``ratio_level="sequence"`` (GSPO): the ratio is ``exp`` of the sequence's mean log-ratio, a
     segment sum over all of its rows (all-reduced over ``cp_group``, differentiably), so it
     needs the full context; a slice raises ``ValueError``.

``grpo_loss`` = ``build_context`` + ``objective`` over all rows; nothing is scattered back.

ON-POLICY (``old_logprobs=None``)
---------------------------------
When an update is the only optimizer step on its rollouts, the old policy *is* the current one,
so ``old_logprobs=None`` means "the current log-probs, detached" (verl's on-policy shortcut): no
separate no-grad pass is needed. ``build_context`` leaves ``ctx.old`` None and keeps the rollout
log-probs in ``ctx.rollout``; ``objective`` fills ``old = sg(logp)`` (ratio exactly 1 in value,
``d ratio / d logp = 1``: the gradient of a run whose old pass gave the same log-probs) and only
then computes what depends on ``old``: the IS weights ``exp(old - rollout)`` (MIS drops included)
and the mismatch metrics. Token-level IS works on any row slice; the sequence levels need the
full context (a slice raises, as for GSPO), since the weight sums a sequence's current log-probs.

THE KL TERM: value and gradient (``cfg.kl_gradient``)
-----------------------------------------------------
With ``x = clamp(ref - logp, +-kl_input_clamp)`` and ``kl = clamp(k(x), +-kl_output_clamp)``,
the loss adds ``coef * kl_coef * kl`` per row (the same value under both conventions); its
derivative w.r.t. ``logp`` per row, before ``coef * kl_coef``, is (no clamp active)::

    estimator        pathwise: d kl / d logp    unbiased: pathwise + kl
    k1 = -x          1                          1 + (logp - ref)
    k2 = x^2 / 2     -x = logp - ref            (logp - ref) + (logp - ref)^2 / 2
    k3 = e^x - 1 - x 1 - e^x                    -x = logp - ref

An active clamp (``x`` or the estimate outside its bound) zeroes the pathwise part; the unbiased
gradient is then the clamped ``kl`` alone.
"unbiased" is ``kl * exp(logp - sg(logp))`` (value ``kl * 1``, bit-identical): its extra
``kl * d logp`` makes the expected gradient over tokens sampled from the current policy that of
``E_pi[kl]`` (for k1 / k3, of KL(pi || pi_ref)); it is unbiased on-policy only (the tokens come
from the old / rollout policy). In expectation the pathwise k1 gradient is 0, pathwise k2 is
already the gradient of KL(pi || pi_ref), and pathwise k3 is that of KL(pi_ref || pi).
The IS weight multiplies the policy-gradient term only, never the KL term.

``cfg.is_mask_scope``: an MIS drop zeroes the row's coefficient ("all": its PG, KL and entropy
terms leave the loss) or only its IS weight ("pg": KL and entropy stay). Either way the row stays
in the ``denominator=None`` count.

NaN safety: rows are selected by index before any arithmetic, so masked positions never enter
the math and get exactly zero gradient. Every log-ratio is clamped before ``exp`` (None in the
config disables a clamp only when asked). Non-finite inputs at valid rows raise (naming the
tensor) or, with ``cfg.nonfinite="count"``, are dropped and counted in ``loss/nonfinite_count``.
A row whose current log-prob / entropy is non-finite is neutralised in ``objective`` (weight 0)
but stays in a ``denominator=None`` count, which is fixed before the policy forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.loss import checks
from megatron_grpo.loss.config import SEQUENCE_IS_LEVELS, GRPOLossConfig
from megatron_grpo.loss.inputs import LossInputs
from megatron_grpo.loss.metrics import MaxMetric, MeanMetric, MetricDict, MinMetric, SumMetric
from megatron_grpo.loss.segments import (
    cu_seqlens_checks,
    host_to_device,
    segment_ids,
    segment_sum,
)


@dataclass
class LossContext:
    """Policy-independent loss inputs on the N valid rows (all ``[N]``, float32 unless noted)."""

    index: Tensor  # [N] int64: positions in the packed [T] inputs
    seg: Tensor  # [N] int64: sequence slot in [0, num_seqs)
    num_seqs: int
    old: Tensor | None  # None: on-policy, objective() uses the current log-probs detached
    adv: Tensor
    coef: Tensor  # aggregation coefficient incl. 1/denominator; 0 = dropped row
    inv_len: Tensor  # 1 / |y_i| of the row's sequence (CP-global)
    ref: Tensor | None = None
    is_weight: Tensor | None = None  # detached, truncated
    rollout: Tensor | None = None  # on-policy only: IS weights / mismatch wait for objective()
    cp_group: dist.ProcessGroup | None = None
    complete: bool = True  # holds every valid row (GSPO needs that)
    metrics: MetricDict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.index.numel()

    def rows(self, sel: slice | Tensor) -> LossContext:
        """Context of a row subset ``sel`` (slice or index tensor into ``[N]``)."""

        def take(x: Tensor | None) -> Tensor | None:
            return None if x is None else x[sel]

        return replace(
            self,
            index=self.index[sel],
            seg=self.seg[sel],
            old=take(self.old),
            adv=self.adv[sel],
            coef=self.coef[sel],
            inv_len=self.inv_len[sel],
            ref=take(self.ref),
            is_weight=take(self.is_weight),
            rollout=take(self.rollout),
            complete=False,
            metrics={},
        )


def clamp_opt(x: Tensor, bound: float | None) -> Tensor:
    """Clamp to ``+-bound``; ``None`` = no clamp."""
    return x if bound is None else x.clamp(-bound, bound)


def kl_estimate(
    x: Tensor, estimator: str, input_clamp: float | None, output_clamp: float | None
) -> Tensor:
    """KL estimator of ``x = log q - log p`` for samples of p (k1 = -x, k2 = x^2/2,
    k3 = e^x - 1 - x), with ``x`` clamped before ``exp`` and the estimate clamped after."""
    x = clamp_opt(x, input_clamp)
    if estimator == "k1":
        k = -x
    elif estimator == "k2":
        k = 0.5 * x * x
    else:
        k = torch.expm1(x) - x
    return clamp_opt(k, output_clamp)


def kl_with_gradient(kl: Tensor, logprobs: Tensor, convention: str) -> Tensor:
    """The KL term ``kl`` (a function of ``logprobs``) with the gradient of ``convention``:
    "pathwise" as is, "unbiased" times ``exp(logp - sg(logp))`` (same value; module doc)."""
    if convention == "pathwise":
        return kl
    return kl * torch.exp(logprobs - logprobs.detach())


def pg_term(cfg: GRPOLossConfig, ratio: Tensor, adv: Tensor) -> tuple[Tensor, MetricDict]:
    """Clipped (and optionally dual-clipped) policy-gradient term per row, with clip metrics."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg = torch.maximum(unclipped, clipped)
    metrics: MetricDict = {
        "loss/pg_clipfrac_low": MeanMetric.of((adv < 0) & (ratio < 1.0 - cfg.clip_eps_low)),
        "loss/pg_clipfrac_high": MeanMetric.of((adv > 0) & (ratio > 1.0 + cfg.clip_eps_high)),
    }
    if cfg.dual_clip_c is not None:
        bound = -cfg.dual_clip_c * adv
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)
        metrics["loss/pg_clipfrac_dual"] = MeanMetric.of(dual)
    return pg, metrics


def is_log_weights(cfg: GRPOLossConfig, ctx: LossContext, rollout: Tensor) -> Tensor:
    """Log IS weights ``[N]`` (before the clamp) at ``cfg.is_correction_level``."""
    log_w = ctx.old - rollout
    if cfg.is_correction_level == "token":
        return log_w
    seq_sum = segment_sum(log_w, ctx.seg, ctx.num_seqs, ctx.cp_group)[ctx.seg]
    return seq_sum if cfg.is_correction_level == "sequence" else seq_sum * ctx.inv_len


def apply_is_correction(cfg: GRPOLossConfig, ctx: LossContext, rollout: Tensor) -> None:
    """Set ``ctx.is_weight`` (detached), drop MIS-masked rows from ``ctx.coef``; IS metrics."""
    w = torch.exp(clamp_opt(is_log_weights(cfg, ctx, rollout), cfg.log_ratio_clamp))
    ctx.metrics["is/weight_mean"] = MeanMetric.of(w)
    ctx.metrics["is/weight_min"] = MinMetric.of(w)
    ctx.metrics["is/weight_max"] = MaxMetric.of(w)
    keep = None
    if cfg.is_mask is not None:
        keep = (w >= cfg.is_mask[0]) & (w <= cfg.is_mask[1])
        ctx.metrics["is/frac_masked"] = MeanMetric.of(~keep)
        if cfg.is_mask_scope == "all":
            ctx.coef = torch.where(keep, ctx.coef, torch.zeros_like(ctx.coef))
    if cfg.is_truncate is not None:
        ctx.metrics["is/frac_truncated"] = MeanMetric.of(w > cfg.is_truncate)
        w = w.clamp(max=cfg.is_truncate)
    if keep is not None and cfg.is_mask_scope == "pg":  # only the PG term is dropped
        w = torch.where(keep, w, torch.zeros_like(w))
    ctx.is_weight = w


def mismatch_metrics(cfg: GRPOLossConfig, old: Tensor, rollout: Tensor) -> MetricDict:
    """Train-vs-rollout mismatch: mean k1 and k3 of ``x = old - rollout`` (rollout samples)."""
    x = old - rollout
    k1 = kl_estimate(x, "k1", None, None)
    k3 = kl_estimate(x, "k3", cfg.log_ratio_clamp, None)
    return {"mismatch/k1": MeanMetric.of(k1), "mismatch/k3": MeanMetric.of(k3)}


def apply_rollout_terms(cfg: GRPOLossConfig, ctx: LossContext, rollout: Tensor) -> None:
    """What ``ctx.old`` against the rollout log-probs gives: the mismatch metrics and, with
    ``cfg.is_correction_level``, the IS weights (:func:`apply_is_correction`)."""
    ctx.metrics.update(mismatch_metrics(cfg, ctx.old, rollout))
    if cfg.is_correction_level is not None:
        apply_is_correction(cfg, ctx, rollout)


def on_policy_context(cfg: GRPOLossConfig, ctx: LossContext, logprobs: Tensor) -> LossContext:
    """An on-policy context (``ctx.old`` None) completed with ``old = sg(logprobs)`` ``[n]``:
    a new context (``ctx`` is left as it is) whose ``metrics`` hold only the rollout terms
    computed here (mismatch, IS weights)."""
    if ctx.rollout is not None and cfg.is_correction_level in SEQUENCE_IS_LEVELS:
        if not ctx.complete:
            raise ValueError(
                f"is_correction_level={cfg.is_correction_level!r} with old_logprobs=None "
                "(on-policy) weighs each sequence by its current log-probs, so it needs every "
                "row of each sequence: call objective() on the full context, not on ctx.rows(...)"
            )
    out = replace(ctx, old=logprobs.detach(), rollout=None, metrics={})
    if ctx.rollout is not None:
        apply_rollout_terms(cfg, out, ctx.rollout)
    return out


def agg_coefficients(
    cfg: GRPOLossConfig,
    inv_len: Tensor,
    seq_len: Tensor,
    denominator: float | Tensor | None,
    cp_group: dist.ProcessGroup | None,
) -> Tensor:
    """Per-row aggregation coefficient ``[N]`` including ``1 / denominator``.

    ``denominator=None`` uses the micro-batch's own count (summed over ``cp_group``): tokens for
    token_mean, sequences with >= 1 valid token for the seq_mean_* modes.
    """
    if denominator is None:
        if cfg.agg_counts_sequences:
            count = (seq_len > 0).sum().float()
        else:
            count = seq_len.sum()  # CP-global per-sequence counts sum to the token count
        denominator = count.clamp(min=1.0)
    if isinstance(denominator, Tensor) and denominator.device == inv_len.device:
        denom = denominator.to(torch.float32)
    else:  # a host number: filled on the device (a host-to-device copy would sync the stream)
        denom = torch.full((), float(denominator), dtype=torch.float32, device=inv_len.device)
    if cfg.loss_agg == "seq_mean_token_mean":
        return inv_len / denom
    if cfg.loss_agg == "seq_mean_token_sum_norm":
        return torch.ones_like(inv_len) / (denom * cfg.max_response_length)
    return torch.ones_like(inv_len) / denom


def _input_checks(
    cfg: GRPOLossConfig,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    named: dict[str, Tensor],
    denominator: float | Tensor | None,
) -> list[checks.DeviceCheck]:
    """Checks what the host sees now (types, shapes, devices, options); the value checks that
    would read the device are returned, for the one fetch."""
    checks.check_mask(loss_mask)
    total, device = loss_mask.numel(), loss_mask.device
    for name, x in named.items():
        checks.check_float(name, x, total, device)
    found = cu_seqlens_checks(cu_seqlens, total, device)
    checks.check_required(cfg, named.get("ref_logprobs"), named.get("rollout_logprobs"))
    return found + checks.denominator_checks(denominator, device)


def _valid_rows(cfg: GRPOLossConfig, loss_mask: Tensor, named: dict[str, Tensor]):
    """Valid positions after the non-finite policy: (valid [T], metrics, its deferred checks)."""
    if cfg.nonfinite == "raise":
        return loss_mask, {}, [checks.nonfinite_check(named, loss_mask)]
    bad = checks.nonfinite_rows(named, loss_mask, raise_=False)
    return loss_mask & ~bad, {"loss/nonfinite_count": SumMetric(bad.sum().float())}, []


def true_positions(mask: Tensor, n: int) -> Tensor:
    """``mask.nonzero().squeeze(1)`` of a bool ``[T]`` mask with ``n`` True entries, without its
    host sync (the output size is known): the k-th True is where the running count reaches k."""
    want = torch.arange(1, n + 1, device=mask.device)
    return torch.searchsorted(mask.cumsum(0), want)


def build_context(
    cfg: GRPOLossConfig,
    inputs: LossInputs | None = None,
    *,
    row_checks: Sequence[checks.RowCheck] = (),
    **overrides: object,
) -> LossContext:
    """Validate the policy-independent inputs (:class:`LossInputs`: ``[T]``; ``cu_seqlens``
    ``[S+1]``; or its fields by keyword, ``overrides``) and build the :class:`LossContext` of
    their valid rows. See the module docstring.
    ``old_logprobs=None``: on-policy, ``objective`` takes the current log-probs, detached (the
    module docstring's ON-POLICY).

    One host sync: the checks of input values (device-side counts) and the number of valid rows
    are fetched together; a failure re-checks on the host, raising its error. ``row_checks``:
    the caller's checks of its own inputs, ``check(valid) -> checks.DeviceCheck`` of the final
    valid-row mask ``[T]``, fetched in the same copy.
    """
    inp = LossInputs.of(inputs, **overrides)
    checks.check_config(cfg)
    named = {"old_logprobs": inp.old_logprobs, "advantages": inp.advantages}
    named |= {"ref_logprobs": inp.ref_logprobs, "rollout_logprobs": inp.rollout_logprobs}
    named = {k: v for k, v in named.items() if v is not None}
    found = _input_checks(cfg, inp.loss_mask, inp.cu_seqlens, named, inp.denominator)
    valid, metrics, nonfinite = _valid_rows(cfg, inp.loss_mask, named)
    found += nonfinite + [check(valid) for check in row_checks]
    (n,) = checks.fetch(found, valid.sum())
    index = true_positions(valid, n)
    sel = {k: v.index_select(0, index).float() for k, v in named.items()}
    num_seqs = inp.cu_seqlens.numel() - 1
    cu = host_to_device(inp.cu_seqlens, index.device)
    seg = segment_ids(cu, inp.loss_mask.numel()).index_select(0, index)
    seq_len = segment_sum(torch.ones_like(sel["advantages"]), seg, num_seqs, inp.cp_group)
    inv_len = 1.0 / seq_len.clamp(min=1.0)[seg]
    ctx = LossContext(
        index=index,
        seg=seg,
        num_seqs=num_seqs,
        old=sel.get("old_logprobs"),
        adv=sel["advantages"],
        coef=agg_coefficients(cfg, inv_len, seq_len, inp.denominator, inp.cp_group),
        inv_len=inv_len,
        ref=sel.get("ref_logprobs"),
        cp_group=inp.cp_group,
        metrics=metrics,
    )
    if inp.rollout_logprobs is not None:
        if ctx.old is None:  # on-policy: old is known in objective()
            ctx.rollout = sel["rollout_logprobs"]
        else:
            apply_rollout_terms(cfg, ctx, sel["rollout_logprobs"])
    return ctx


def policy_log_ratio(cfg: GRPOLossConfig, ctx: LossContext, logprobs: Tensor) -> Tensor:
    """Clamped ``log r`` per row: token ``logp - old``, or GSPO's sequence mean broadcast."""
    log_ratio = logprobs - ctx.old
    if cfg.ratio_level == "sequence":
        if not ctx.complete:
            raise ValueError(
                "ratio_level='sequence' needs every row of each sequence: call objective() on "
                "the full context, not on ctx.rows(...)"
            )
        weighted = log_ratio * ctx.inv_len
        log_ratio = segment_sum(weighted, ctx.seg, ctx.num_seqs, ctx.cp_group)[ctx.seg]
    return clamp_opt(log_ratio, cfg.log_ratio_clamp)


def raise_on_nonfinite(cfg: GRPOLossConfig, logprobs: Tensor, entropy: Tensor | None) -> None:
    """``cfg.nonfinite == "raise"``: raises naming the first non-finite current log-prob /
    entropy row ``[n]`` (one host sync); otherwise nothing. ``objective(check_finite=False)``
    leaves this to its caller, who can then call it once, after the loss is queued on the GPU
    (a host sync per row chunk would idle the GPU)."""
    if cfg.nonfinite != "raise":
        return
    named = {"logprobs": logprobs} | ({} if entropy is None else {"entropy": entropy})
    checks.nonfinite_rows(named, torch.ones_like(logprobs, dtype=torch.bool), raise_=True)


def _neutralise(
    cfg: GRPOLossConfig,
    ctx: LossContext,
    logprobs: Tensor,
    entropy: Tensor | None,
    check_finite: bool,
) -> tuple[Tensor, Tensor | None, Tensor, MetricDict]:
    """Handle non-finite current log-probs / entropy at valid rows (raise, or zero-weight)."""
    if cfg.nonfinite == "raise":
        if check_finite:
            raise_on_nonfinite(cfg, logprobs, entropy)
        return logprobs, entropy, ctx.coef, {}
    everything = torch.ones_like(ctx.coef, dtype=torch.bool)
    named = {"logprobs": logprobs} | ({} if entropy is None else {"entropy": entropy})
    bad = checks.nonfinite_rows(named, everything, raise_=False)
    # on-policy (old None): a finite stand-in, the rollout's value (IS log-weight 0) or 0
    fill = ctx.old if ctx.old is not None else ctx.rollout
    logprobs = torch.where(bad, torch.zeros_like(logprobs) if fill is None else fill, logprobs)
    entropy = None if entropy is None else torch.where(bad, torch.zeros_like(entropy), entropy)
    coef = torch.where(bad, torch.zeros_like(ctx.coef), ctx.coef)
    return logprobs, entropy, coef, {"loss/nonfinite_count": SumMetric(bad.sum().float())}


def _penalties(
    cfg: GRPOLossConfig, ctx: LossContext, lp: Tensor, ent: Tensor | None, metrics: MetricDict
) -> Tensor | float:
    """``kl_coef * kl - entropy_coef * entropy`` per row; adds their metrics to ``metrics``."""
    out: Tensor | float = 0.0
    if ctx.ref is not None:
        # without a penalty the KL is only a metric: keep it out of the graph
        kl_in = ctx.ref - (lp if cfg.kl_coef > 0 else lp.detach())
        kl = kl_estimate(kl_in, cfg.kl_estimator, cfg.kl_input_clamp, cfg.kl_output_clamp)
        metrics["loss/kl_mean"] = MeanMetric.of(kl)
        if cfg.kl_coef > 0:
            out = cfg.kl_coef * kl_with_gradient(kl, lp, cfg.kl_gradient)
    if ent is not None:
        metrics["entropy/mean"] = MeanMetric.of(ent)
        if cfg.entropy_coef != 0:
            out = out - cfg.entropy_coef * ent
    return out


def objective(
    cfg: GRPOLossConfig,
    ctx: LossContext,
    logprobs: Tensor,
    entropy: Tensor | None = None,
    *,
    check_finite: bool = True,
) -> tuple[Tensor, MetricDict]:
    """Weighted loss sum of the rows of ``ctx`` for current ``logprobs`` / ``entropy`` ``[n]``.

    Returns ``(sum(coef * objective_t), metrics)``; see the module docstring. With
    ``check_finite=False`` and ``cfg.nonfinite == "raise"`` the caller must call
    :func:`raise_on_nonfinite` on these rows itself (the loss is NaN where they are not finite).
    """
    n = ctx.num_rows
    checks.check_float("logprobs", logprobs, n, ctx.coef.device)
    checks.check_float("entropy", entropy, n, ctx.coef.device)
    checks.check_entropy_needed(cfg, entropy)
    if cfg.kl_coef > 0 and ctx.ref is None:
        raise ValueError("ref_logprobs is required when kl_coef > 0")
    lp = logprobs.float()
    ent = None if entropy is None else entropy.float()
    lp, ent, coef, metrics = _neutralise(cfg, ctx, lp, ent, check_finite)
    if ctx.old is None:  # on-policy: old = sg(logp), then the terms that need old
        ctx = on_policy_context(cfg, replace(ctx, coef=coef), lp)
        coef, metrics = ctx.coef, metrics | ctx.metrics

    ratio = torch.exp(policy_log_ratio(cfg, ctx, lp))
    per_row, pg_metrics = pg_term(cfg, ratio, ctx.adv)
    metrics |= pg_metrics
    metrics |= {"loss/ratio_mean": MeanMetric.of(ratio), "loss/ratio_min": MinMetric.of(ratio)}
    metrics["loss/ratio_max"] = MaxMetric.of(ratio)
    if ctx.is_weight is not None:
        per_row = ctx.is_weight * per_row
    per_row = per_row + _penalties(cfg, ctx, lp, ent, metrics)
    return (coef * per_row).sum(), metrics
