"""pack_padded / unpack_to_padded round trip, and packed inputs feed grpo_loss."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.loss import GRPOLossConfig, grpo_loss, pack_padded, unpack_to_padded

# row 0 right-padded, row 1 left-padded, row 2 empty
ATTN = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)


def test_pack_and_unpack_round_trip():
    values = torch.arange(12.0).reshape(3, 4)
    response = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    packed, cu = pack_padded(
        ATTN, {"logprobs": values, "loss_mask": response, "adv": torch.tensor([2.0, -1.0, 9.0])}
    )
    assert cu.tolist() == [0, 3, 6, 6] and cu.dtype == torch.int32
    assert packed["logprobs"].tolist() == [0.0, 1.0, 2.0, 5.0, 6.0, 7.0]
    assert packed["loss_mask"].dtype == torch.bool
    assert packed["loss_mask"].tolist() == [False, True, True, False, True, True]
    assert packed["adv"].tolist() == [2.0, 2.0, 2.0, -1.0, -1.0, -1.0]
    back = unpack_to_padded(packed["logprobs"], ATTN, fill_value=-1.0)
    expect = torch.where(ATTN, values, torch.full_like(values, -1.0))
    assert torch.equal(back, expect)


def test_packed_loss_equals_padded_reference_and_grads_flow_back():
    g = torch.Generator().manual_seed(0)
    lp_pad = torch.randn(3, 4, generator=g).requires_grad_(True)
    old_pad = torch.randn(3, 4, generator=g)
    adv = torch.tensor([1.0, -0.5, 3.0])
    packed, cu = pack_padded(ATTN, {"logprobs": lp_pad, "old": old_pad, "adv": adv})
    loss, _ = grpo_loss(
        GRPOLossConfig(),
        logprobs=packed["logprobs"],
        old_logprobs=packed["old"],
        advantages=packed["adv"],
        loss_mask=torch.ones(6, dtype=torch.bool),
        cu_seqlens=cu,
    )
    loss.backward()
    ratio = (lp_pad - old_pad).exp()
    a = adv[:, None].expand(3, 4)
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    ref = pg[ATTN].mean()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert (lp_pad.grad[~ATTN] == 0).all()
    unpacked = unpack_to_padded(packed["logprobs"], ATTN)
    assert unpacked.requires_grad


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: pack_padded(ATTN.float(), {}), "attention_mask must be a bool"),
        (lambda: pack_padded(ATTN, {"x": torch.zeros(3, 5)}), r"x must have shape \[B, L\]"),
        (lambda: unpack_to_padded(torch.zeros(5), ATTN), r"packed must have shape \[T\]=\[6\]"),
    ],
)
def test_bad_shapes(call, message):
    with pytest.raises(ValueError, match=message):
        call()
