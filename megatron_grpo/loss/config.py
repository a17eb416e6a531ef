"""GRPOLossConfig: every option of the GRPO loss family, validated on construction.

Load it from YAML/dicts with :func:`megatron_grpo.config.from_dict`; cross-field checks live in
``__post_init__`` and raise ``ValueError`` naming the offending field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

RatioLevel = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k2", "k3"]
KLGradient = Literal["pathwise", "unbiased"]
ISLevel = Literal["token", "sequence", "sequence_mean"]
ISMaskScope = Literal["all", "pg"]
LossAgg = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
NonFinitePolicy = Literal["raise", "count"]

SEQUENCE_IS_LEVELS = ("sequence", "sequence_mean")  # IS weights of whole sequences
SEQUENCE_AGGS = ("seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


@dataclass
class GRPOLossConfig:
    """Options of :func:`megatron_grpo.loss.grpo_loss`.

    Per-token objective (then aggregated by ``loss_agg``)::

        is_weight * pg_t + kl_coef * kl_t - entropy_coef * entropy_t
        pg_t = max(-A r, -A clip(r, 1 - clip_eps_low, 1 + clip_eps_high)), dual-clipped at -c A
        when A < 0 and ``dual_clip_c`` is set.

    Attributes:
        clip_eps_low / clip_eps_high: PPO clip range ``[1 - low, 1 + high]``.
        dual_clip_c: dual-clip bound ``c > 1`` for negative advantages; None disables it.
        ratio_level: "token" (PPO/GRPO) or "sequence" (GSPO: ``exp(mean_t(logp - old))`` of the
            sequence's valid tokens, broadcast to them).
        log_ratio_clamp: every log-ratio (policy ratio and IS log-weights) is clamped to
            ``+-log_ratio_clamp`` before ``exp``. None disables the clamp: only when you ask.
        kl_coef / kl_estimator: KL penalty to ``ref_logprobs`` with x = ref - logp:
            k1 = -x, k2 = x^2 / 2, k3 = exp(x) - 1 - x.
        kl_input_clamp / kl_output_clamp: clamp x before exp, and the estimate; None disables.
        kl_gradient: the gradient of the KL term (its value is the same under both):
            "pathwise" differentiates the estimate, ``d kl_t / d logp_t`` (verl / TRL "k3 as
            loss"; k3: ``1 - exp(x)``); "unbiased" multiplies it by ``exp(logp - sg(logp))``
            (NeMo-RL), adding the score term ``kl_t``, so the gradient per token is
            ``d kl_t / d logp_t + kl_t`` (k3: ``logp - ref``), an unbiased on-policy estimate
            of the gradient of ``E_pi[kl_t]`` (for k1 and k3, of KL(pi || pi_ref)). Closed forms
            with clamps: :mod:`megatron_grpo.loss.math`.
        is_correction_level: detached rollout-correction weights ``exp(old - rollout)`` per token,
            per sequence (exp of the sum) or per sequence mean (exp of the mean); None disables.
        is_truncate: upper cap of the weight (TIS).
        is_mask: ``(low, high)``: tokens (or whole sequences, for sequence levels) whose weight is
            outside ``[low, high]`` are dropped (MIS). Checked before truncation.
        is_mask_scope: what an ``is_mask`` drop removes: "all" (the token's policy-gradient,
            KL and entropy terms) or "pg" (only the policy-gradient term: the KL and entropy
            terms stay, as in NeMo-RL's ICE-POP). Either way the token stays in the count.
        loss_agg: "token_mean", "seq_mean_token_mean", "seq_mean_token_sum" or
            "seq_mean_token_sum_norm" (Dr.GRPO: token sum / ``max_response_length``).
        max_response_length: the constant of "seq_mean_token_sum_norm" (required there only).
        entropy_coef: entropy bonus coefficient (needs the ``entropy`` input when non-zero).
        nonfinite: what to do with a non-finite input at an unmasked position: "raise" (error
            naming the tensor) or "count" (the token is neutralised, left out of the loss and
            counted in the metric ``loss/nonfinite_count``).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None
    ratio_level: RatioLevel = "token"
    log_ratio_clamp: float | None = 20.0
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_input_clamp: float | None = 20.0
    kl_output_clamp: float | None = 10.0
    kl_gradient: KLGradient = "pathwise"
    is_correction_level: ISLevel | None = None
    is_truncate: float | None = None
    is_mask: tuple[float, float] | None = None
    is_mask_scope: ISMaskScope = "all"
    loss_agg: LossAgg = "token_mean"
    max_response_length: int | None = None
    entropy_coef: float = 0.0
    nonfinite: NonFinitePolicy = "raise"

    def __post_init__(self) -> None:
        _choice("ratio_level", self.ratio_level, RatioLevel)
        _choice("kl_estimator", self.kl_estimator, KLEstimator)
        _choice("kl_gradient", self.kl_gradient, KLGradient)
        _choice("is_mask_scope", self.is_mask_scope, ISMaskScope)
        _choice("loss_agg", self.loss_agg, LossAgg)
        _choice("nonfinite", self.nonfinite, NonFinitePolicy)
        if self.is_correction_level is not None:
            _choice("is_correction_level", self.is_correction_level, ISLevel)
        if not 0.0 <= _finite("clip_eps_low", self.clip_eps_low) < 1.0:
            raise ValueError(f"clip_eps_low must be in [0, 1), got {self.clip_eps_low}")
        if _finite("clip_eps_high", self.clip_eps_high) < 0.0:
            raise ValueError(f"clip_eps_high must be >= 0, got {self.clip_eps_high}")
        if self.dual_clip_c is not None and not _finite("dual_clip_c", self.dual_clip_c) > 1.0:
            raise ValueError(f"dual_clip_c must be > 1 when set, got {self.dual_clip_c}")
        for name in ("log_ratio_clamp", "kl_input_clamp", "kl_output_clamp", "is_truncate"):
            value = getattr(self, name)
            if value is not None and not _finite(name, value) > 0.0:
                raise ValueError(f"{name} must be > 0 (or None to disable), got {value}")
        if _finite("kl_coef", self.kl_coef) < 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        _finite("entropy_coef", self.entropy_coef)
        self._check_is()
        self._check_agg()

    def _check_is(self) -> None:
        if self.is_mask_scope != "all" and self.is_mask is None:
            raise ValueError(f"is_mask_scope={self.is_mask_scope!r} needs is_mask to be set")
        if self.is_correction_level is None:
            for name in ("is_truncate", "is_mask"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs is_correction_level to be set")
            return
        if self.is_mask is not None:
            if len(self.is_mask) != 2:
                raise ValueError(f"is_mask must be a (low, high) pair, got {self.is_mask}")
            low, high = (_finite("is_mask", float(v)) for v in self.is_mask)
            if not 0.0 <= low < high:
                raise ValueError(f"is_mask must satisfy 0 <= low < high, got {self.is_mask}")
            self.is_mask = (low, high)

    def _check_agg(self) -> None:
        if self.loss_agg == "seq_mean_token_sum_norm":
            n = self.max_response_length
            if n is None or isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(
                    "max_response_length must be a positive int when "
                    f"loss_agg='seq_mean_token_sum_norm', got {n!r}"
                )
        elif self.max_response_length is not None:
            raise ValueError(
                "max_response_length is only used by loss_agg='seq_mean_token_sum_norm'; "
                f"got loss_agg={self.loss_agg!r}"
            )

    def needs_whole_sequences(self, on_policy: bool = False) -> bool:
        """Whether the loss needs all of a sequence's current log-probs before any gradient, so
        that it cannot run chunk by chunk (the LM head's single pass): GSPO's sequence ratio
        always; a sequence-level IS correction when on-policy (its weight then comes from the
        current log-probs, not the old pass's). The one place of this decision: the LM-head
        plan (GSPO) and the step's log-prob path (on-policy) read it; the loss checks that its
        context is complete where either holds."""
        if self.ratio_level == "sequence":
            return True
        return on_policy and self.is_correction_level in SEQUENCE_IS_LEVELS

    @property
    def agg_counts_sequences(self) -> bool:
        """True when ``loss_agg`` divides by a sequence count (else by a token count)."""
        return self.loss_agg in SEQUENCE_AGGS


def _choice(name: str, value: object, literal: object) -> None:
    choices = get_args(literal)
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)
