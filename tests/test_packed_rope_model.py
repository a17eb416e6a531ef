"""The portable spec's packed RoPE inside the model: log-probs and gradients of packed batches
equal megatron-core's per-document path bit for bit (fp32; TP 1/2, SP on/off, CP 2, the last two
with the q / k norms fused into the RoPE op; YaRN, partial and interleaved rotary), and the work
per layer does not grow with the documents."""

from __future__ import annotations

import dataclasses

import torch

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron import GRPOStep, ParallelConfig, pack_sequences
from megatron_grpo.megatron.attention.rope import PackedRopeSelfAttention
from megatron_grpo.ops.kernels import LayerKernels
from tests.dist_utils import run_distributed
from tests.megatron_utils import (
    VOCAB,
    build_layout,
    full_params,
    gather_full_grads,
    load_full,
    make_sequences,
    pack,
    tiny_model,
    train_grads,
)
from tests.op_count import CountOps


def _build(parallel, model_cfg, rope: str, weights=None, qk: str = "auto") -> list:
    """The model with ``layer_kernels.rope = rope`` and ``qk_norm_rope = qk`` (the same seed:
    the same weights)."""
    cfg = dataclasses.replace(model_cfg, layer_kernels=LayerKernels(rope=rope, qk_norm_rope=qk))
    chunks = build_layout(parallel, cfg)
    if weights is not None:
        load_full(chunks, weights, cfg)
    modules = [m for m in chunks[0].modules() if isinstance(m, PackedRopeSelfAttention)]
    assert [m.packed_rope for m in modules] == [rope] * model_cfg.num_layers
    return chunks


def _run(chunks, step, batches, model_cfg):
    logp = step.compute_logprobs(chunks, batches)
    train_grads(chunks, step, batches)
    return logp, gather_full_grads(chunks, model_cfg)


def _compare(parallel, model_cfg, seqs, label, weights=None, qk="auto"):
    step = GRPOStep(GRPOLossConfig(), vocab_size=model_cfg.vocab_size)
    multiple = parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1
    batches = [pack(seqs[:5], multiple), pack(seqs[5:], multiple)]
    # two models of one seed (the same weights; ``weights`` loaded into both when given)
    chunks = _build(parallel, model_cfg, "megatron", weights)
    start = full_params(chunks)
    want = _run(chunks, step, batches, model_cfg)
    chunks = _build(parallel, model_cfg, "auto", weights, qk)
    got = _run(chunks, step, batches, model_cfg)
    for i, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        assert torch.equal(a, b), f"{label} logprobs[{i}]: {(a - b).abs().max()}"
    for name, g in want[1].items():
        assert torch.equal(got[1][name], g), (
            f"{label} grad {name}: {(got[1][name] - g).abs().max()}"
        )
    return start if weights is None else weights


def _body(rank: int, world: int) -> None:
    seqs = make_sequences(9)
    model_cfg = tiny_model()
    weights = _compare(ParallelConfig(), model_cfg, seqs, "TP1")
    layouts = {
        "TP2": ParallelConfig(tensor_model_parallel_size=2),
        "TP2+SP": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
        "CP2": ParallelConfig(context_parallel_size=2),
    }
    for label, parallel in layouts.items():  # SP and CP: the q / k norms fused with RoPE
        _compare(parallel, model_cfg, seqs, label, weights, "auto" if label == "TP2" else "fused")
    variants = {
        "yarn": dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
                     yarn_original_max_position_embeddings=16, yarn_mscale=0.7,
                     yarn_mscale_all_dim=0.3),
        "partial_interleaved": dict(rotary_percent=0.5, rotary_interleaved=True),
    }  # fmt: skip
    for label, kw in variants.items():
        _compare(ParallelConfig(tensor_model_parallel_size=2), tiny_model(**kw), seqs, label)


def test_packed_rope_equals_megatron_path_across_layouts():
    run_distributed(_body, 2)


def _ops_per_pass(chunks, step, docs: int) -> int:
    g = torch.Generator().manual_seed(docs)
    seqs = [torch.randint(0, VOCAB, (96 // docs,), generator=g) for _ in range(docs)]
    batch = pack_sequences(seqs, [torch.arange(s.numel()) > 0 for s in seqs])
    with CountOps() as mode:
        step.compute_logprobs(chunks, [batch])
    return mode.count


def _count_body(rank: int, world: int) -> None:
    model_cfg = tiny_model()
    step = GRPOStep(GRPOLossConfig(), vocab_size=model_cfg.vocab_size)
    chunks = _build(ParallelConfig(), model_cfg, "auto")
    _ops_per_pass(chunks, step, 2)  # warm-up (first-call caches)
    few, many = _ops_per_pass(chunks, step, 3), _ops_per_pass(chunks, step, 48)
    # packed attention adds at most a few length buckets; a per-document loop adds ~10 ops per
    # document and layer (the megatron path below shows it)
    assert many - few < 60, (few, many)
    chunks = _build(ParallelConfig(), model_cfg, "megatron")
    _ops_per_pass(chunks, step, 2)
    looped = _ops_per_pass(chunks, step, 48)
    assert looped - many > 45 * model_cfg.num_layers, (many, looped)


def test_op_count_does_not_grow_with_documents():
    run_distributed(_count_body, 1)
