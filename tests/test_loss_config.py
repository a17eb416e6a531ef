"""GRPOLossConfig validation and input validation errors name the field / tensor."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.config import ConfigError, from_dict
from megatron_grpo.loss import GRPOLossConfig, grpo_loss


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(clip_eps_low=1.0), "clip_eps_low"),
        (dict(clip_eps_high=-0.1), "clip_eps_high"),
        (dict(dual_clip_c=1.0), "dual_clip_c"),
        (dict(ratio_level="seq"), "ratio_level"),
        (dict(log_ratio_clamp=0.0), "log_ratio_clamp"),
        (dict(kl_coef=-1.0), "kl_coef"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(kl_input_clamp=-1.0), "kl_input_clamp"),
        (dict(kl_output_clamp=float("inf")), "kl_output_clamp"),
        (dict(kl_gradient="score"), "kl_gradient"),
        (dict(is_mask_scope="kl"), "is_mask_scope"),
        (dict(is_correction_level="token", is_mask_scope="pg"), "is_mask_scope"),
        (dict(is_correction_level="geometric"), "is_correction_level"),
        (dict(is_truncate=2.0), "is_truncate"),
        (dict(is_mask=(0.5, 2.0)), "is_mask"),
        (dict(is_correction_level="token", is_truncate=0.0), "is_truncate"),
        (dict(is_correction_level="token", is_mask=(2.0, 0.5)), "is_mask"),
        (dict(is_correction_level="token", is_mask=(-1.0, 0.5)), "is_mask"),
        (dict(loss_agg="token_sum"), "loss_agg"),
        (dict(loss_agg="seq_mean_token_sum_norm"), "max_response_length"),
        (dict(loss_agg="seq_mean_token_sum_norm", max_response_length=0), "max_response_length"),
        (dict(max_response_length=100), "max_response_length"),
        (dict(entropy_coef=float("nan")), "entropy_coef"),
        (dict(nonfinite="ignore"), "nonfinite"),
    ],
)
def test_invalid_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GRPOLossConfig(**kwargs)


def test_from_dict_loads_and_rejects_unknown_keys():
    cfg = from_dict(
        GRPOLossConfig,
        {"is_correction_level": "sequence_mean", "is_mask": [0.5, 2], "kl_coef": 0,
         "kl_gradient": "unbiased", "is_mask_scope": "pg"},
    )  # fmt: skip
    assert cfg.is_mask == (0.5, 2.0) and cfg.kl_coef == 0.0
    assert (cfg.kl_gradient, cfg.is_mask_scope) == ("unbiased", "pg")
    with pytest.raises(ConfigError, match="clip_eps_high"):
        from_dict(GRPOLossConfig, {"clip_eps_hi": 0.3})
    with pytest.raises(ConfigError, match="dual_clip_c"):
        from_dict(GRPOLossConfig, {"dual_clip_c": 0.5})


def _inputs(n: int = 4) -> dict:
    return dict(
        logprobs=torch.zeros(n),
        old_logprobs=torch.zeros(n),
        advantages=torch.zeros(n),
        loss_mask=torch.ones(n, dtype=torch.bool),
        cu_seqlens=torch.tensor([0, n]),
    )


@pytest.mark.parametrize(
    "change,message",
    [
        (
            dict(advantages=torch.zeros(2, 2)),
            r"advantages must have shape \[T\]=\[4\], got \[2, 2\]",
        ),
        (dict(old_logprobs=torch.zeros(4, dtype=torch.int64)), "old_logprobs must be"),
        (dict(loss_mask=torch.ones(4)), "loss_mask must be a bool"),
        (dict(cu_seqlens=torch.tensor([0.0, 4.0])), "cu_seqlens must be int32 or int64"),
        (dict(cu_seqlens=torch.tensor([1, 4])), "cu_seqlens must start at 0"),
        (dict(cu_seqlens=torch.tensor([0, 3, 2, 4])), "cu_seqlens must be non-decreasing"),
        (dict(cu_seqlens=torch.tensor([0, 3])), r"cu_seqlens must end at T=4"),
        (dict(denominator=0.0), "denominator must be a finite count > 0"),
        (dict(denominator=torch.ones(2)), "denominator must be a scalar"),
        (dict(entropy=torch.zeros(3)), r"entropy must have shape \[T\]=\[4\]"),
        (dict(ref_logprobs=torch.zeros(5)), r"ref_logprobs must have shape \[T\]=\[4\]"),
    ],
)
def test_bad_inputs_name_the_tensor(change, message):
    with pytest.raises(ValueError, match=message):
        grpo_loss(GRPOLossConfig(), **(_inputs() | change))


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(kl_coef=0.1), "ref_logprobs is required"),
        (dict(is_correction_level="token"), "rollout_logprobs is required"),
        (dict(entropy_coef=0.1), "entropy is required"),
    ],
)
def test_enabled_options_require_their_inputs(options, message):
    with pytest.raises(ValueError, match=message):
        grpo_loss(GRPOLossConfig(**options), **_inputs())


def test_cfg_must_be_a_config():
    with pytest.raises(TypeError, match="GRPOLossConfig"):
        grpo_loss({"kl_coef": 0.1}, **_inputs())
