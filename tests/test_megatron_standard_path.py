"""The three log-prob paths of GRPOStep ("fused", "op", "megatron") give the same log-probs, loss
and gradients: Megatron's output_layer + vocab_parallel_cross_entropy is our semantic baseline.

One spawn of 2 gloo ranks: TP=2 with sequence parallelism, a vocabulary with padded rows on the
second shard, temperature != 1, token-level PPO (KL with the unbiased gradient + token IS) and
GSPO (sequence_mean IS). ``loss.kl_gradient`` reaches the step: same loss, other gradients.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from megatron.core import parallel_state

from megatron_grpo.loss import GRPOLossConfig, reduce_metrics
from megatron_grpo.megatron import GRPOStep, ParallelConfig, unwrap
from tests.dist_utils import run_distributed
from tests.megatron_utils import (
    VOCAB,
    assert_close,
    build_layout,
    make_sequences,
    pack,
    tiny_model,
    train_grads,
)

PATHS = ("fused", "op", "megatron")
CONFIGS = {
    "ppo": GRPOLossConfig(
        clip_eps_high=0.28,
        kl_coef=0.05,
        kl_gradient="unbiased",
        is_correction_level="token",
        is_truncate=2.0,
    ),
    "gspo": GRPOLossConfig(
        ratio_level="sequence",
        clip_eps_low=3e-3,
        clip_eps_high=4e-3,
        loss_agg="seq_mean_token_mean",
        is_correction_level="sequence_mean",
        is_truncate=2.0,
        kl_coef=0.05,
    ),  # fmt: skip
}


def _grads(chunks) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in unwrap(chunks[0]).named_parameters()}


def _with_rollout_data(batches, logp: list[torch.Tensor], seed: int) -> None:
    """old/ref/rollout log-probs near the current policy: ratios near 1, some clipped."""
    g = torch.Generator().manual_seed(seed)
    for b, lp in zip(batches, logp, strict=True):
        noise = [0.3 * torch.randn(lp.shape, generator=g) for _ in range(3)]
        b.old_logprobs, b.ref_logprobs, b.rollout_logprobs = (lp + n for n in noise)


def _run_path(chunks, batches, cfg: GRPOLossConfig, path: str):
    step = GRPOStep(cfg, vocab_size=VOCAB, temperature=0.7, logprob_path=path)
    logp = step.compute_logprobs(chunks, batches)
    reports = train_grads(chunks, step, batches)
    loss = reduce_metrics(reports)["loss/loss"]
    return logp, loss, _grads(chunks)


def _body(rank: int, world: int) -> None:
    cfg = tiny_model()
    chunks = build_layout(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), cfg)
    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    batches = [pack(s, multiple=2) for s in (make_sequences(3, 1), make_sequences(2, 2))]
    start = GRPOStep(CONFIGS["ppo"], vocab_size=VOCAB, temperature=0.7, logprob_path="op")
    _with_rollout_data(batches, start.compute_logprobs(chunks, batches), seed=3)
    runs = {}
    for name, loss_cfg in CONFIGS.items():
        runs[name] = results = {p: _run_path(chunks, batches, loss_cfg, p) for p in PATHS}
        ref_logp, ref_loss, ref_grads = results["op"]
        norm = sum(float(g.norm()) for g in ref_grads.values())
        assert norm > 1e-4, f"{name}: the reference gradients vanish ({norm})"
        for path in ("fused", "megatron"):
            logp, loss, grads = results[path]
            for got, want in zip(logp, ref_logp, strict=True):
                assert_close(f"{name}/{path} logprobs", got, want)
            assert_close(f"{name}/{path} loss", torch.tensor(loss), torch.tensor(ref_loss))
            for param, g in grads.items():
                assert_close(f"{name}/{path} grad {param}", g, ref_grads[param], tol=5e-5)
    pathwise = replace(CONFIGS["ppo"], kl_gradient="pathwise")
    _, loss, grads = _run_path(chunks, batches, pathwise, "fused")
    _, unbiased_loss, unbiased_grads = runs["ppo"]["fused"]
    assert loss == unbiased_loss
    assert any(not torch.allclose(g, unbiased_grads[n], atol=1e-6) for n, g in grads.items())


@pytest.mark.slow
def test_logprob_paths_agree_tp2_sp():
    run_distributed(_body, 2)


def test_megatron_path_rejects_entropy_bonus():
    with pytest.raises(ValueError, match="entropy_coef"):
        GRPOStep(GRPOLossConfig(entropy_coef=0.01), vocab_size=VOCAB, logprob_path="megatron")


def test_logprob_path_is_chosen_once():
    """The step's path object is chosen when it is built; a wrong name fails there."""
    from megatron_grpo.megatron.step.logprob_paths import HeadOpPath, MegatronPath

    cfg = GRPOLossConfig()
    step = GRPOStep(cfg, vocab_size=VOCAB)
    assert step.options.path == "fused" and isinstance(step.path, HeadOpPath)
    assert isinstance(GRPOStep(cfg, vocab_size=VOCAB, logprob_path="op").path, HeadOpPath)
    step = GRPOStep(cfg, vocab_size=VOCAB, logprob_path="megatron", temperature=0.5)
    assert isinstance(step.path, MegatronPath)
    assert (step.options.vocab_size, step.options.temperature) == (VOCAB, 0.5)
    with pytest.raises(ValueError, match="path must be one of"):
        GRPOStep(cfg, vocab_size=VOCAB, logprob_path="standard")
    with pytest.raises(ValueError, match="memory_budget"):
        GRPOStep(cfg, vocab_size=VOCAB, memory_budget=0)
