"""float64 inputs run forward and backward (the op computes in fp32: gradients match a float64
full-logits reference to fp32 accuracy); they used to crash in backward, where the fp32 logits
tile cannot hold a float64 gradient in place."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.ops import vocab_parallel_logprobs


@pytest.mark.parametrize("vocab", [11, 12])  # odd and even widths failed differently
def test_float64_backward_matches_a_float64_reference(vocab):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(vocab, 8, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, vocab, (6,), generator=g)
    logp, ent = vocab_parallel_logprobs(h, w, t, impl="torch", return_entropy=True)
    (logp.sum() + 0.5 * ent.sum()).backward()
    got = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    ref = torch.log_softmax(h @ w.t(), dim=-1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    (ref.gather(1, t[:, None]).sum() + 0.5 * ref_ent.sum()).backward()
    assert got[0].dtype == got[1].dtype == torch.float64
    torch.testing.assert_close(got[0], h.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], w.grad, rtol=1e-5, atol=1e-5)
