"""compute_advantages: GRPO, Dr.GRPO, RLOO against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_grpo.loss import compute_advantages

# groups (non-contiguous ids, interleaved): 7 -> [1, 0, 2], -3 -> [5, 5] (zero variance),
# 42 -> [4] (singleton)
REWARDS = torch.tensor([1.0, 5.0, 0.0, 4.0, 2.0, 5.0])
GROUPS = torch.tensor([7, -3, 7, 42, 7, -3])


def test_grpo_uses_unbiased_std():
    adv = compute_advantages(REWARDS, GROUPS, "grpo", eps=1e-6)
    std = math.sqrt(((1 - 1) ** 2 + (0 - 1) ** 2 + (2 - 1) ** 2) / 2)  # = 1, as torch.std
    expect = [0 / (std + 1e-6), 0.0, -1 / (std + 1e-6), 0.0, 1 / (std + 1e-6), 0.0]
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx(expect, abs=1e-7)


def test_dr_grpo_is_mean_centred_only():
    adv = compute_advantages(REWARDS * 3, GROUPS, "dr_grpo")
    assert adv.tolist() == pytest.approx([0.0, 0.0, -3.0, 0.0, 3.0, 0.0])


def test_rloo_is_leave_one_out():
    adv = compute_advantages(REWARDS, GROUPS, "rloo")
    # group 7: 1 - (0 + 2) / 2 = 0; 0 - 1.5 = -1.5; 2 - 0.5 = 1.5
    assert adv.tolist() == pytest.approx([0.0, 0.0, -1.5, 0.0, 1.5, 0.0])


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_degenerate_groups_give_exact_zero(estimator):
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7], dtype=torch.bfloat16)
    adv = compute_advantages(rewards, torch.tensor([0, 0, 0, 1], dtype=torch.int32), estimator)
    assert torch.equal(adv, torch.zeros(4))


def test_grpo_matches_torch_std_on_random_groups():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(40, generator=g, dtype=torch.float64)
    groups = torch.arange(40) % 5 * 11
    adv = compute_advantages(rewards.float(), groups)
    for gid in groups.unique():
        r = rewards[groups == gid]
        expect = (r - r.mean()) / (r.std() + 1e-6)
        torch.testing.assert_close(adv[groups == gid].double(), expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "args,message",
    [
        ((torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long)), "rewards must be a float"),
        ((torch.ones(3), torch.zeros(2, dtype=torch.long)), r"group_ids must have shape \[B\]"),
        ((torch.ones(2), torch.zeros(2)), "group_ids must be an integer"),
        ((torch.ones(2), torch.zeros(2, dtype=torch.long), "ppo"), "estimator must be one of"),
        ((torch.tensor([1.0, math.nan]), torch.zeros(2, dtype=torch.long)), "rewards has non"),
    ],
)
def test_bad_inputs(args, message):
    with pytest.raises(ValueError, match=message):
        compute_advantages(*args)
