"""Sampling (``megatron_grpo.rollout.sample``: inverse CDF, one uniform per row): padded ids never
sampled, top-p / top-k truncation, recorded log-probs before truncation, identical tokens on every
TP rank, and rollout log-probs equal to the training engine's log-probs of the same tokens."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.rollout import SamplingParams, sample
from tests.dist_utils import run_distributed


def _params(**kw) -> SamplingParams:
    base = dict(temperature=1.0, top_p=1.0, max_new_tokens=4, eos_id=0, vocab_size=5)
    return SamplingParams(**{**base, **kw})


def _uniforms(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def test_padded_ids_are_never_sampled_and_logprobs_use_the_real_vocab():
    logits = torch.zeros(2000, 8)
    logits[:, 5:] = 50.0  # padded columns with huge logits must still be excluded
    u = _uniforms(2000, 0)
    u[:2] = torch.tensor([0.0, 1.0 - 2**-24])  # the ends of [0, 1)
    tokens, logp = sample(logits, u, _params(temperature=0.7))
    assert int(tokens.max()) < 5 and int(tokens.min()) >= 0
    assert len(torch.unique(tokens)) == 5  # uniform over the real vocabulary
    torch.testing.assert_close(logp, torch.full((2000,), -torch.log(torch.tensor(5.0)).item()))


def test_sampling_is_the_inverse_cdf_of_the_uniform():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.clamp_min(1e-12).log().expand(5, 5)
    tokens, _ = sample(logits, torch.tensor([0.0, 0.49, 0.51, 0.81, 0.96]), _params())
    assert tokens.tolist() == [0, 0, 1, 2, 3]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.clamp_min(1e-12).log().expand(4000, 5)
    tokens, logp = sample(logits, _uniforms(4000, 1), _params(top_p=0.75))
    counts = torch.bincount(tokens, minlength=5)
    assert counts[2:].sum() == 0 and counts[0] > counts[1] > 0  # {0.5, 0.3} reaches 0.75
    # Recorded: the untruncated tempered distribution (what the training pass scores).
    torch.testing.assert_close(logp, logits[torch.arange(4000), tokens].float())


def test_top_k_keeps_the_k_most_likely_and_top_k_1_is_argmax():
    logits = torch.randn(3000, 5, generator=torch.Generator().manual_seed(2)) * 2
    top2 = logits.topk(2, dim=-1).indices
    tokens, logp = sample(logits, _uniforms(3000, 3), _params(top_k=2, temperature=0.5))
    assert bool((tokens[:, None] == top2).any(-1).all())
    assert len(torch.unique(tokens)) > 2  # rows differ: the kept set is per row
    torch.testing.assert_close(
        logp, torch.log_softmax(logits / 0.5, -1).gather(-1, tokens[:, None])[:, 0]
    )
    greedy, _ = sample(logits, _uniforms(3000, 4), _params(top_k=1))
    assert torch.equal(greedy, logits.argmax(-1))


def test_untruncated_sampling_runs_the_given_row_kernel():
    """The decode plan's row kernel (``kernels.sample_rows``) draws untruncated samples; top-k /
    top-p and no kernel take the torch path."""
    calls = []

    def kernel(logits, uniforms, vocab_size, temperature):
        calls.append((vocab_size, temperature))
        return torch.zeros(len(uniforms), dtype=torch.long), torch.zeros(len(uniforms))

    logits, u = torch.randn(3, 8), _uniforms(3, 5)
    assert sample(logits, u, _params(temperature=0.5), kernel)[0].tolist() == [0, 0, 0]
    assert calls == [(5, 0.5)]
    want = sample(logits, u, _params(top_k=2))
    assert torch.equal(sample(logits, u, _params(top_k=2), kernel)[0], want[0]) and len(calls) == 1


def test_bad_params_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        _params(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        _params(top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        _params(top_k=-1)
    with pytest.raises(ValueError, match="eos_id"):
        _params(eos_id=5)
    with pytest.raises(ValueError, match="stop_ids"):
        _params(stop_ids=(7,))
    with pytest.raises(ValueError, match="max_new_tokens"):
        _params(max_new_tokens=0)
    with pytest.raises(ValueError, match="fewer than vocab_size"):
        sample(torch.zeros(1, 3), torch.zeros(1), _params())


def _tp_body(rank: int, world: int, temperature: float, sequence_parallel: bool) -> None:
    import torch.distributed as dist

    from megatron_grpo.loss import GRPOLossConfig
    from megatron_grpo.megatron.batch.packing import pack_sequences
    from megatron_grpo.megatron.config import ModelConfig, ParallelConfig
    from megatron_grpo.megatron.model.build import build_model, unwrap
    from megatron_grpo.megatron.parallel import initialize_parallel
    from megatron_grpo.megatron.step.forward import GRPOStep
    from megatron_grpo.rollout import generate

    model_cfg = ModelConfig(
        vocab_size=13, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        max_sequence_length=16, make_vocab_size_divisible_by=8, transformer_impl="local",
        init_method_std=0.5,  # a peaked random policy: tokens differ between prompts
    )  # fmt: skip
    parallel = ParallelConfig(tensor_model_parallel_size=world, sequence_parallel=sequence_parallel)
    initialize_parallel(parallel, seed=3)
    model = build_model(model_cfg, parallel)
    prompts = [[11, 1, 2, 3, 10], [11, 4, 5, 10], [11, 9, 10]] * 2
    params = SamplingParams(temperature, 0.9, 5, eos_id=12, vocab_size=13)
    out = generate(unwrap(model[0]), prompts, params, torch.Generator().manual_seed(7))
    responses, logprobs = out.responses, out.logprobs
    assert out.routes is None
    gathered = [None] * world
    dist.all_gather_object(gathered, (responses, logprobs))
    assert all(g == gathered[0] for g in gathered), "TP ranks sampled different tokens"
    assert all(0 <= t < 13 for r in responses for t in r)
    assert all(r[-1] == 12 or len(r) == 5 for r in responses)
    assert len({tuple(r) for r in responses}) > 1
    # The training engine scores the same tokens with the same temperature.
    seqs = [torch.tensor(p + r) for p, r in zip(prompts, responses, strict=True)]
    masks = [
        torch.tensor([False] * len(p) + [True] * len(r))
        for p, r in zip(prompts, responses, strict=True)
    ]
    batch = pack_sequences(seqs, masks, pad_to_multiple_of=world if sequence_parallel else 1)
    step = GRPOStep(GRPOLossConfig(), vocab_size=13, temperature=temperature, impl="torch")
    [train_lp] = step.compute_logprobs(model, [batch])
    recorded = torch.cat(
        [
            torch.tensor([0.0] * (len(p) - 1) + lp + [0.0])
            for p, lp in zip(prompts, logprobs, strict=True)
        ]
    )
    # SP pads the packed stream to a multiple of TP (loss_mask False there).
    recorded = torch.nn.functional.pad(recorded, (0, batch.loss_mask.numel() - recorded.numel()))
    torch.testing.assert_close(
        train_lp[batch.loss_mask], recorded[batch.loss_mask], rtol=1e-4, atol=1e-5
    )


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_sampling_is_consistent_and_matches_training_logprobs(sequence_parallel):
    run_distributed(_tp_body, 2, 0.8, sequence_parallel)
