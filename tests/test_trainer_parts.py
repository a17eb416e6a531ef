"""The trainer's parts outside its class: the non-finite skip policy (``train/nonfinite.py``),
old / reference log-probs attached as new micro-batches (``batching.attach_logprobs``) and
``generate``'s one result type (``rollout.Generation``)."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.megatron.batch.packing import pack_sequences
from megatron_grpo.rollout import Generation
from megatron_grpo.train.batching import PER_TOKEN_INPUTS, attach_logprobs, nonfinite_inputs
from megatron_grpo.train.nonfinite import NonFiniteError, NonFiniteGuard


def _batch(n: int):
    seqs = [torch.arange(n), torch.arange(2)]
    masks = [torch.tensor([False] + [True] * (n - 1)), torch.tensor([False, True])]
    return pack_sequences(seqs, masks, advantages=torch.ones(2))


def test_guard_skips_then_aborts_and_a_step_resets_the_run():
    messages = []
    guard = NonFiniteGuard(2, messages.append, skipped=5)  # 5: restored from a checkpoint
    guard.skip("non-finite gradients")
    guard.stepped()
    guard.skip("non-finite gradients")
    assert (guard.skipped, guard.consecutive) == (7, 1)
    assert (
        messages[-1] == "skipped an optimizer step: non-finite gradients (1 in a row, 7 in total)"
    )
    with pytest.raises(NonFiniteError, match="2 consecutive optimizer steps skipped"):
        guard.skip("non-finite loss")


def test_guard_names_the_nonfinite_inputs_loss_and_grads():
    good, bad = _batch(4), _batch(3)
    assert NonFiniteGuard.inputs([good]) is None
    bad.advantages[1] = float("nan")
    assert NonFiniteGuard.inputs([good, bad]) == "non-finite input(s): advantages"
    layer = torch.nn.Linear(2, 2)
    layer.weight.grad = torch.zeros(2, 2)
    report = {"loss/loss": type("Sum", (), {"sum": torch.tensor(1.0)})()}
    assert NonFiniteGuard.loss_or_grads([report], [layer]) is None
    layer.weight.grad[0, 0] = float("inf")
    assert NonFiniteGuard.loss_or_grads([report], [layer]) == "non-finite gradients"
    report["loss/loss"].sum = torch.tensor(float("nan"))
    assert NonFiniteGuard.loss_or_grads([report], [layer]).startswith("non-finite loss")


def test_gradients_are_checked_per_ddp_buffer_in_pieces(monkeypatch):
    """With megatron-core DDP's contiguous gradient buffers (dense and expert) the check reads
    them, in pieces of CHECK_ELEMENTS, not each parameter; without them, each gradient."""
    from types import SimpleNamespace

    from megatron_grpo.train import nonfinite as nf

    dense, expert = torch.zeros(10), torch.zeros(7)
    chunk = torch.nn.Linear(2, 2)
    chunk.weight.grad = torch.full((2, 2), float("nan"))  # not read while buffers exist
    chunk.buffers = [SimpleNamespace(grad_data=dense)]  # DDP's attribute shadows Module.buffers
    chunk.expert_parallel_buffers = [SimpleNamespace(grad_data=expert)]
    monkeypatch.setattr(nf, "CHECK_ELEMENTS", 3)
    found = nf._grad_tensors(chunk)
    assert len(found) == 2 and found[0] is dense and found[1] is expert
    assert not nf._grads_bad([chunk])
    expert[6] = float("inf")  # the last, one-element piece of the expert buffer
    assert nf._grads_bad([chunk])
    plain = torch.nn.Linear(2, 2)
    plain.weight.grad = torch.zeros(2, 2)  # no DDP: each parameter's gradient (bias has none)
    assert len(nf._grad_tensors(plain)) == 1 and not nf._grads_bad([plain])


def test_nonfinite_inputs_flags_each_field_at_loss_mask_positions_only():
    """One flag per field over all micro-batches; a non-finite value outside ``loss_mask`` (the
    last position of every sequence) is not one; a field absent from some micro-batches is
    checked where present."""
    a, b, c = _batch(4), _batch(3), _batch(5)
    a.advantages[3] = float("nan")  # loss_mask False there
    b.ref_logprobs = torch.zeros(b.num_tokens)
    b.ref_logprobs[1] = -float("inf")
    c.old_logprobs = torch.zeros(c.num_tokens)
    c.old_logprobs[4] = float("inf")  # loss_mask False
    flags = dict(zip(PER_TOKEN_INPUTS, nonfinite_inputs([a, b, c]), strict=True))
    assert flags == {
        "advantages": False,
        "old_logprobs": False,
        "ref_logprobs": True,
        "rollout_logprobs": False,
    }
    c.old_logprobs[1] = float("nan")
    a.advantages[0] = float("inf")  # the first micro-batch: later finite ones keep the flag
    flags = dict(zip(PER_TOKEN_INPUTS, nonfinite_inputs([a, b, c]), strict=True))
    assert [n for n, bad in flags.items() if bad] == ["advantages", "old_logprobs", "ref_logprobs"]
    assert nonfinite_inputs([]) == [False] * len(PER_TOKEN_INPUTS)


def test_logprobs_are_attached_to_new_micro_batches():
    minis = [[_batch(3), _batch(4)], [_batch(5)]]
    old = [torch.full((mb.num_tokens,), -float(i)) for i, mb in enumerate(sum(minis, []))]
    ref = [x - 1 for x in old]
    out = attach_logprobs(minis, old, ref)
    assert [len(m) for m in out] == [2, 1]
    flat = sum(out, [])
    for mb, o, r in zip(flat, old, ref, strict=True):
        assert mb.old_logprobs is o and mb.ref_logprobs is r
    assert all(mb.old_logprobs is None for mb in sum(minis, []))  # the packed ones unchanged
    on_policy = sum(attach_logprobs(minis, None, ref), [])  # no old pass
    assert all(mb.old_logprobs is None for mb in on_policy)
    assert torch.equal(on_policy[2].tokens, minis[1][0].tokens)


def test_generation_routes_are_optional():
    out = Generation.of([[1, 2]], [[-0.5, -0.25]], None)
    assert (out.responses, out.logprobs, out.routes) == ([[1, 2]], [[-0.5, -0.25]], None)


def _ddp_grads_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig
    from megatron_grpo.train import nonfinite as nf
    from tests.megatron_utils import build_layout, tiny_model

    chunks = build_layout(ParallelConfig(), tiny_model(num_moe_experts=4, moe_router_topk=2))
    found = nf._grad_tensors(chunks[0])  # megatron-core's buffers (at EP 1 one holds experts)
    params = [p for p in chunks[0].parameters() if p.requires_grad]
    assert 1 <= len(found) < len(params)
    assert sum(g.numel() for g in found) >= sum(p.numel() for p in params)
    assert not nf._grads_bad(chunks)
    expert = next(p for n, p in chunks[0].named_parameters() if ".experts." in n)
    expert.main_grad.view(-1)[-1] = float("nan")  # a view into the expert buffer
    assert nf._grads_bad(chunks)
    expert.main_grad.zero_()
    bias = next(p for n, p in chunks[0].named_parameters() if n.endswith("bias"))
    bias.main_grad = torch.full_like(bias.main_grad, float("inf"))  # 0.19: a promoted main_grad
    assert len(nf._grad_tensors(chunks[0])) == len(found) + 1 and nf._grads_bad(chunks)


def test_gradient_check_reads_megatron_ddp_buffers():
    from tests.dist_utils import run_distributed

    run_distributed(_ddp_grads_body, 1)
