"""Activation recompute: ``model.recompute_modules`` checks, the plan's selective estimate, the
``recompute_granularity: auto`` choice (none -> selective -> full as memory shrinks), and a tiny
model trained with selective recompute (mlp, core_attn) giving the same loss and
gradients as without (gloo: DP 2, then TP 2 + SP)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from megatron_grpo.config import ConfigError, from_dict
from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron import GRPOStep, ModelConfig, ParallelConfig, unwrap
from megatron_grpo.megatron.config import to_transformer_config
from megatron_grpo.megatron.plan.activations import layer_activations
from megatron_grpo.megatron.plan.memory import memory_plan
from megatron_grpo.megatron.plan.recompute import HEADROOM, choose_recompute
from megatron_grpo.ops.kernels import LayerKernels
from tests.dist_utils import run_distributed
from tests.megatron_utils import VOCAB, build_layout, make_sequences, pack, tiny_model

QWEN3_8B = ModelConfig(
    vocab_size=151936, num_layers=36, hidden_size=4096, num_attention_heads=32,
    num_query_groups=8, ffn_hidden_size=12288, qk_layernorm=True, max_sequence_length=40960,
    transformer_impl="local",
)  # fmt: skip
TP4_SP = ParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True)
GB80 = 80e9


def _args(tokens: int) -> dict:
    return dict(
        micro_batch_tokens=tokens, dp_size=1, use_distributed_optimizer=True, reference_model=True
    )


def test_unknown_recompute_module_names_the_field():
    with pytest.raises(ConfigError, match=r"recompute_modules.*'mpl'.*did you mean 'mlp'"):
        from_dict(
            ModelConfig,
            {"vocab_size": 8, "recompute_granularity": "selective", "recompute_modules": ["mpl"]},
        )
    with pytest.raises(ValueError, match="needs recompute_granularity='selective'"):
        ModelConfig(vocab_size=8, recompute_modules=["mlp"])
    with pytest.raises(ValueError, match="needs recompute_method"):
        ModelConfig(vocab_size=8, recompute_granularity="full")


def test_auto_is_resolved_before_the_model_is_built():
    auto = tiny_model(recompute_granularity="auto")
    with pytest.raises(ValueError, match="resolved by the memory plan"):
        to_transformer_config(auto, ParallelConfig())
    with pytest.raises(ValueError, match="no GPU here.*--device-memory-gib"):
        choose_recompute(auto, ParallelConfig(), device_bytes=None, **_args(64))
    explicit = choose_recompute(tiny_model(), ParallelConfig(), device_bytes=None, **_args(64))
    assert explicit.label == "none" and explicit.reason == ""


def test_selective_estimate_drops_each_module():
    """Selective recompute keeps everything but the named modules' tensors, plus one layer's
    recomputed modules; the MLP is over half of Qwen3-8B's saved bytes per layer."""
    tokens, layer = 32768, layer_activations(QWEN3_8B, TP4_SP, False, 32768, 2)
    assert layer.mlp == tokens * 3 * 12288 / 4 * 2
    assert layer.layernorm == tokens * 2 * 4096 / 4 * 2
    assert layer.mlp > layer.total / 2
    none = memory_plan(QWEN3_8B, TP4_SP, **_args(tokens)).stages[0].bytes["activations"]
    sel = replace(QWEN3_8B, recompute_granularity="selective", recompute_modules=["mlp"])
    got = memory_plan(sel, TP4_SP, **_args(tokens)).stages[0].bytes["activations"]
    assert got == pytest.approx(none - 35 * layer.mlp)  # 36 layers drop it, one rebuilds it
    te = replace(QWEN3_8B, transformer_impl="transformer_engine")
    assert layer_activations(te, TP4_SP, False, tokens, 2).layernorm == 0  # fused norms
    if importlib.util.find_spec("transformer_engine") is None:  # CheckpointWithoutOutput
        norms = tiny_model(recompute_granularity="selective", recompute_modules=["layernorm"])
        with pytest.raises(ValueError, match=r"\['layernorm'\].*needs Transformer Engine"):
            to_transformer_config(norms, ParallelConfig())


@pytest.mark.parametrize(
    ("tokens", "label"),
    [
        (8192, "none"),
        (32768, "selective [mlp]"),
        (131072, "full (uniform, 1 layer)"),
    ],
)
def test_auto_picks_the_least_recompute_that_fits(tokens, label):
    auto = replace(QWEN3_8B, recompute_granularity="auto")
    choice = choose_recompute(auto, TP4_SP, device_bytes=GB80, **_args(tokens))
    assert choice.label == label and label in choice.reason
    assert choice.budget == pytest.approx((1 - HEADROOM) * GB80)
    peaks = [p for _, p in choice.peaks]
    assert peaks == sorted(peaks, reverse=True)  # each candidate shrinks the peak
    assert peaks[-1] <= choice.budget < min(peaks[:-1], default=float("inf"))
    again = memory_plan(choice.model, TP4_SP, **_args(tokens)).peak_bytes
    assert again == pytest.approx(peaks[-1])  # the model carries the chosen setting


def test_auto_says_when_nothing_fits():
    auto = replace(QWEN3_8B, recompute_granularity="auto")
    choice = choose_recompute(auto, TP4_SP, device_bytes=20e9, **_args(32768))
    assert choice.model.recompute_granularity == "full" and "nothing fits" in choice.reason


def _cpu_checkpointing() -> None:
    """megatron's CheckpointFunction saves the CUDA RNG state: none on a CPU-only host (the
    model has no dropout, so there is nothing to restore)."""
    from megatron.core.tensor_parallel import random

    if not torch.cuda.is_available():
        random._get_cuda_rng_state = lambda *a, **k: None
        random._set_cuda_rng_state = lambda *a, **k: None


def _run(parallel: ParallelConfig, cfg: ModelConfig, state: dict | None, batches):
    """(state dict, losses, grads by name, fc1 / core attention forward calls) of one
    forward/backward."""
    from tests.megatron_utils import train_grads

    chunks = build_layout(parallel, cfg)
    gpt = unwrap(chunks[0])
    if state is not None:
        gpt.load_state_dict(state)
    calls = [0, 0]
    for layer in gpt.decoder.layers:
        layer.mlp.linear_fc1.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        layer.self_attention.core_attention.register_forward_hook(
            lambda *a: calls.__setitem__(1, calls[1] + 1)
        )
    step = GRPOStep(GRPOLossConfig(), vocab_size=VOCAB)
    reports = train_grads(chunks, step, batches)
    losses = [float(r["loss"]) if "loss" in r else r for r in reports]
    grads = {n: p.main_grad.clone() for n, p in gpt.named_parameters()}
    return gpt.state_dict(), losses, grads, calls


def _body(rank: int, world: int) -> None:
    _cpu_checkpointing()
    mods = ["mlp", "core_attn"]
    for parallel in (
        ParallelConfig(),
        ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    ):
        multiple = 2 if parallel.sequence_parallel else 1
        seqs = make_sequences(6, seed=3)  # TP ranks must see the same data
        batches = [pack(seqs[:3], multiple), pack(seqs[3:], multiple)]
        state, losses, grads, calls = _run(parallel, tiny_model(), None, batches)
        # the q / k norms fused into RoPE (the core attention then recomputes on rotated q, k)
        fused = LayerKernels(qk_norm_rope="fused")
        sel = tiny_model(
            recompute_granularity="selective", recompute_modules=mods, layer_kernels=fused
        )
        _, losses2, grads2, calls2 = _run(parallel, sel, state, batches)
        assert calls2 == [2 * c for c in calls], (calls, calls2)  # recomputed in backward
        assert losses2 == losses
        for n, g in grads.items():
            assert g.abs().sum() > 0 or "bias" in n, n
            torch.testing.assert_close(grads2[n], g, rtol=1e-5, atol=1e-7, msg=n)


def test_selective_recompute_same_loss_and_grads_dp2_then_tp2_sp():
    run_distributed(_body, 2)
