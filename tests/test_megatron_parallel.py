"""TP / SP / PP / CP / DP / micro-batch equivalences of the Megatron integration (2 gloo ranks).

One spawned world runs every layout in turn (re-initializing parallel_state), each starting from
the same TP=1 weights copied into the layout, and compares log-probs and gradients with the
TP=1, PP=1 reference; then packing, padded-vocab and optimizer-update invariances.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron import GRPOStep, ParallelConfig, cuda_compat, pack_sequences, unwrap
from tests.dist_utils import run_distributed
from tests.megatron_utils import (
    VOCAB,
    assert_close,
    build_layout,
    full_params,
    gather_full_grads,
    load_full,
    make_sequences,
    pack,
    tiny_model,
    train_grads,
)

pytestmark = pytest.mark.slow


def _reference(model_cfg, step, seqs):
    """TP=1 PP=1 (DP=2 with both ranks seeing every batch, which equals DP=1)."""
    chunks = build_layout(ParallelConfig(), model_cfg)
    weights = full_params(chunks)
    batches = [pack(seqs[:3]), pack(seqs[3:])]
    logp = step.compute_logprobs(chunks, batches)
    train_grads(chunks, step, batches)
    grads = gather_full_grads(chunks, model_cfg)
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "layers.1" in n), "zero grads"
    return weights, logp, grads


def _check_layout(parallel, model_cfg, step, seqs, ref, label):
    weights, ref_logp, ref_grads = ref
    chunks = build_layout(parallel, model_cfg)
    load_full(chunks, weights, model_cfg)
    multiple = parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1
    batches = [pack(seqs[:3], multiple), pack(seqs[3:], multiple)]
    logp = step.compute_logprobs(chunks, batches)
    for i, (got, want) in enumerate(zip(logp, ref_logp, strict=True)):
        assert_close(f"{label} logprobs[{i}]", got[: want.numel()], want)
    train_grads(chunks, step, batches)
    for name, g in gather_full_grads(chunks, model_cfg).items():
        assert_close(f"{label} grad {name}", g, ref_grads[name], tol=5e-5)
    return chunks


def _check_packing(chunks, step, seqs):
    """A packed batch equals the same sequences run one by one (no cross-document attention)."""
    packed = step.compute_logprobs(chunks, [pack(seqs)])[0]
    singles = step.compute_logprobs(chunks, [pack([s]) for s in seqs])
    start = 0
    for i, one in enumerate(singles):
        assert_close(f"packed vs single sequence {i}", packed[start : start + one.numel()], one)
        start += one.numel()


def _check_padded_vocab(chunks, step):
    """Padded vocab rows (set to huge logits here) get zero probability: the real ids' probs
    at one position sum to 1."""
    gpt = unwrap(chunks[0])
    weight = gpt.output_layer.weight
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        rows = torch.arange(weight.shape[0]) + tp_rank * weight.shape[0]
        weight[rows >= VOCAB] = 3.0  # would dominate the softmax if it were not excluded
    seqs = [torch.tensor([7, v]) for v in range(VOCAB)]
    masks = [torch.tensor([False, True])] * VOCAB
    batch = pack_sequences(seqs, masks, pad_to_multiple_of=2)
    logp = step.compute_logprobs(chunks, [batch])[0][batch.loss_mask]
    total = torch.logsumexp(logp.double(), 0).item()
    assert abs(total) < 1e-5, f"real-vocab probabilities sum to exp({total})"


def _body(rank: int, world: int) -> None:
    seqs = make_sequences(6)
    model_cfg = tiny_model(share_embeddings_and_output_weights=True)
    step = GRPOStep(GRPOLossConfig(), vocab_size=model_cfg.vocab_size)
    ref = _reference(model_cfg, step, seqs)
    tp2 = ParallelConfig(tensor_model_parallel_size=2)
    _check_layout(tp2, model_cfg, step, seqs, ref, "TP2")
    sp = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    _check_layout(sp, model_cfg, step, seqs, ref, "TP2+SP")
    pp2 = ParallelConfig(pipeline_model_parallel_size=2)
    _check_layout(pp2, model_cfg, step, seqs, ref, "PP2")
    # the portable spec's all-gather CP attention on Megatron's THD CP layout
    cp2 = ParallelConfig(context_parallel_size=2)
    _check_layout(cp2, model_cfg, step, seqs, ref, "CP2")
    # Untied output layer at TP=2: packing and padded-vocab checks.
    untied = tiny_model()
    chunks = build_layout(ParallelConfig(tensor_model_parallel_size=2), untied)
    _check_packing(chunks, step, seqs)
    _check_padded_vocab(chunks, step)


def test_tp_sp_pp_match_single_rank_and_packing():
    run_distributed(_body, 2)


def _sgd_update(chunks, step, batches) -> dict[str, torch.Tensor]:
    """Parameter change of one Megatron SGD step (lr=1) over ``batches``."""
    gpt = unwrap(chunks[0])
    before = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    with cuda_compat():
        opt = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0
            ),
            chunks,
        )
    opt.zero_grad()
    train_grads(chunks, step, batches)
    with cuda_compat():
        ok, _, _ = opt.step()
    assert ok
    delta = {n: p.detach() - before[n] for n, p in gpt.named_parameters()}
    with torch.no_grad():  # restore for the next layout
        for n, p in gpt.named_parameters():
            p.copy_(before[n])
    return delta


def _split_body(rank: int, world: int) -> None:
    seqs = make_sequences(6, seed=3)
    model_cfg = tiny_model()
    chunks = build_layout(ParallelConfig(), model_cfg)  # DP = 2
    for loss_agg in ("token_mean", "seq_mean_token_mean"):
        step = GRPOStep(GRPOLossConfig(loss_agg=loss_agg), vocab_size=model_cfg.vocab_size)
        # Reference: every rank sees all sequences in one micro-batch (= DP 1, no split).
        ref = _sgd_update(chunks, step, [pack(seqs)])
        assert sum(d.abs().sum() for d in ref.values()) > 0
        # Micro-batch split: 3 micro-batches of unequal token counts, same on both ranks.
        micro = _sgd_update(chunks, step, [pack(seqs[:1]), pack(seqs[1:4]), pack(seqs[4:])])
        # DP split: each rank gets a different share of the sequences (2 vs 4 sequences).
        mine = seqs[:2] if rank == 0 else seqs[2:]
        dp = _sgd_update(chunks, step, [pack(mine[:1]), pack(mine[1:])])
        for name, want in ref.items():
            assert_close(f"{loss_agg} micro-batch split {name}", micro[name], want)
            assert_close(f"{loss_agg} DP split {name}", dp[name], want)


def test_update_invariant_to_microbatch_and_dp_split():
    """token_mean and seq_mean_token_mean: one SGD update is the same however it is split."""
    run_distributed(_split_body, 2)


def _cp_tp_body(rank: int, world: int) -> None:
    seqs = make_sequences(6, seed=5)
    model_cfg = tiny_model()
    step = GRPOStep(GRPOLossConfig(), vocab_size=model_cfg.vocab_size)
    ref = _reference(model_cfg, step, seqs)
    layout = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                            context_parallel_size=2)  # fmt: skip
    _check_layout(layout, model_cfg, step, seqs, ref, "TP2+SP+CP2")


def test_cp_with_tp_and_sp_matches_single_rank():
    """CP = 2 inside TP = 2 + SP (4 ranks): documents padded to multiples of 2 * CP * TP."""
    run_distributed(_cp_tp_body, 4)
