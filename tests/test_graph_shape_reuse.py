"""New graph shapes give way to captured ones (megatron/batch/graph_shape.py ``ShapeReuse``): a
micro-batch whose own shape has no graph takes the captured (or the call's other new) shape that
adds the fewest padding tokens, within the budget a capture is worth
(``graph_plan.capture_padding_tokens``); never one it does not fit; agreed over the ranks whose
forwards are collectives with each other; and through GRPOStep's graphed passes (CPU stand-ins
for the graphs) a micro-batch padded to a reused larger shape gives the eager log-probs and
gradients.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.loss.metrics import reduce_metrics
from megatron_grpo.megatron import GRPOStep
from megatron_grpo.megatron.batch import graph_shape as gs
from megatron_grpo.megatron.step import graph_plan as gp
from tests.dist_utils import run_distributed
from tests.graph_utils import RerunCache, mixed_batches, rerun_model
from tests.megatron_utils import (
    assert_close,
    gather_full_grads,
    make_sequences,
    pack,
    train_grads,
)

BIG = gs.GraphShape(4096, 64, 4096)


def _own(batches, multiple: int = 2) -> list[gs.GraphShape]:
    return gs.graph_shapes(batches, multiple, most=len(batches))


def _check_fit(batches, shapes) -> None:
    for b, s in zip(batches, shapes, strict=True):
        padded = gs.pad_to_shape(b, s)  # raises if it does not fit
        assert padded.num_tokens == s.tokens


def test_without_reuse_or_budget_each_batch_keeps_its_own_shape():
    batches = mixed_batches(6, 200, seed=2, multiple=2)
    own = _own(batches)
    for reuse in (None, gs.ShapeReuse((BIG,), 0), gs.ShapeReuse((), 0)):
        assert gs.graph_shapes(batches, 2, most=6, reuse=reuse) == own


def test_a_new_shape_takes_a_captured_one_exactly_within_the_budget():
    (batch,) = mixed_batches(1, 200, seed=4, multiple=2)
    (own,) = _own([batch])
    near = gs.GraphShape(own.tokens + 64, own.docs * 2, own.tokens + 64)
    far = gs.GraphShape(own.tokens + 512, own.docs * 2, own.tokens + 512)
    assert gs.fits(batch, near) and gs.fits(batch, far)
    for captured in ((near, far), (far, near)):  # the fewest padding tokens, in any order
        got = gs.graph_shapes([batch], 2, reuse=gs.ShapeReuse(captured, 64))
        assert got == [near]
    assert gs.graph_shapes([batch], 2, reuse=gs.ShapeReuse((near,), 63)) == [own]
    assert gs.graph_shapes([batch], 2, reuse=gs.ShapeReuse((far,), 511)) == [own]
    assert gs.graph_shapes([batch], 2, reuse=gs.ShapeReuse((far,), 512)) == [far]
    _check_fit([batch], [near])


def test_shapes_a_batch_does_not_fit_are_never_taken():
    (batch,) = mixed_batches(1, 200, seed=4, multiple=2)
    (own,) = _own([batch])
    s = batch.cu_seqlens.numel() - 1
    longest = int((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).max())
    misfits = (
        gs.GraphShape(own.tokens * 4, s, own.tokens * 4),  # no room for a padding document
        gs.GraphShape(own.tokens * 4, own.docs, longest - 1),  # its longest document
        gs.GraphShape(own.tokens * 4, s + 1, own.tokens),  # one padding document too long
        gs.GraphShape(batch.num_tokens + 1, s + 4, own.tokens),  # fewer tokens than padding
    )
    for shape in misfits:
        assert not gs.fits(batch, shape), shape
        assert gs.graph_shapes([batch], 2, reuse=gs.ShapeReuse((shape,), 10**9)) == [own]
        with pytest.raises(ValueError):
            gs.pad_to_shape(batch, shape)


def test_new_shapes_merge_into_the_calls_larger_ones_and_captured_ones():
    batches = mixed_batches(8, 300, seed=5, multiple=2)
    own = _own(batches)
    assert len(set(own)) > 2
    # no graph yet: every smaller new shape gives way to a larger one of the call
    merged = gs.graph_shapes(batches, 2, most=8, reuse=gs.ShapeReuse((), 10**9))
    assert len(set(merged)) == 1 and merged[0] in own
    _check_fit(batches, merged)
    # a captured shape that fits them all: every batch takes it
    everyone = gs.graph_shapes(batches, 2, most=8, reuse=gs.ShapeReuse((BIG,), 10**9))
    assert everyone == [BIG] * 8
    # a budget that pays for none of the moves: the shapes of the call as without reuse
    assert gs.graph_shapes(batches, 2, most=8, reuse=gs.ShapeReuse((BIG,), 1)) == own


def _decoder(layers: int, width: int, ffn: int) -> torch.nn.Module:
    """A stand-in GPT: what the estimate reads (config, decoder layers and their weights),
    built in this process without megatron-core's parallel state (no env changes)."""
    gpt, decoder = torch.nn.Module(), torch.nn.Module()
    decoder.layers = torch.nn.ModuleList(
        torch.nn.Linear(width, ffn, bias=False) for _ in range(layers)
    )
    gpt.decoder = decoder
    gpt.config = SimpleNamespace(num_moe_experts=None, expert_model_parallel_size=1)
    return gpt


def test_capture_padding_tokens_weighs_a_capture_against_the_padding():
    """The padding whose GEMM time (host_bound's estimate) is a capture's host time:
    ``CAPTURE_PASSES`` eager passes of the layers' host time."""
    small, wide = _decoder(4, 64, 128), _decoder(4, 64, 512)
    for gpt in (small, wide):
        for backward in (False, True):
            tokens = gp.capture_padding_tokens(gpt, backward)
            assert tokens > 0
            # host_bound's crossover (GEMMs = one pass's host time) at 1 / CAPTURE_PASSES of it
            cross = tokens / gp.CAPTURE_PASSES
            assert gp.host_bound(gpt, int(cross * 0.99), backward)[0]
            assert not gp.host_bound(gpt, int(cross * 1.01) + 1, backward)[0]
    # more weights a token: fewer padding tokens pay for a capture
    assert gp.capture_padding_tokens(wide) < gp.capture_padding_tokens(small)


def _agree_body(rank: int, world: int) -> None:
    import torch.distributed as dist

    batches = mixed_batches(4, 200, seed=rank, multiple=2)
    if rank == 1:  # its second batch: a document too long for the captured shape's max_len
        b = batches[1]
        docs = b.cu_seqlens.numel() - 1
        batches[1] = gs.pad_to_shape(b, gs.GraphShape(b.num_tokens + 900, docs + 1, 1024))
    capped = gs.GraphShape(4096, 64, 512)
    reuse = gs.ShapeReuse((capped,), 10**9)
    got = gs.graph_shapes(batches, 2, dist.group.WORLD, most=4, reuse=reuse)
    theirs = [None] * world
    dist.all_gather_object(theirs, got)
    assert all(t == got for t in theirs), theirs
    assert got[1] != capped and got[0] == capped, got  # rank 1's batch 1 does not fit it
    _check_fit(batches, got)


def test_ranks_agree_on_reused_shapes():
    """EP over DP (gloo, 2 ranks): a captured shape is taken for the i-th forwards only if each
    rank's i-th micro-batch fits it; every rank gets the same shapes."""
    run_distributed(_agree_body, 2)


def _passes_body(rank: int, world: int) -> None:
    cfg, chunks = rerun_model("dp2")
    seqs = make_sequences(12, seed=3 + 10 * rank)
    batches = [pack(seqs[i : i + k]) for i, k in [(0, 3), (3, 1), (4, 5), (9, 3)]]
    device = torch.device("cpu")
    eager = GRPOStep(GRPOLossConfig(), vocab_size=cfg.vocab_size)
    step = GRPOStep(GRPOLossConfig(), vocab_size=cfg.vocab_size)
    step.logprob_graphs = step.update_graphs = True
    step.graphs.cache, step.update_store.cache = RerunCache(chunks[0]), RerunCache(chunks[0])
    for store in (step.graphs, step.update_store):  # a larger shape already captured
        store.static(chunks[0], BIG, None, device)
    want = eager.compute_logprobs(chunks, batches)
    got = step.compute_logprobs(chunks, batches)
    assert [k[1] for k in step.graphs.statics] == [BIG]  # no shape of its own: BIG reused
    real = sum(b.num_tokens for b in batches)
    metrics = step.graph_metrics()  # the padding's share of the replayed tokens
    assert metrics["perf/logprob_graph_padding"] == pytest.approx(1 - real / (4 * BIG.tokens))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5, msg=f"log-probs {i}")
    grads = {}
    for name, s in (("eager", eager), ("graphs", step)):
        if name == "graphs":
            s.prepare_update(chunks, batches)
            assert list(s._shapes) == [BIG] * len(batches)
        reports = train_grads(chunks, s, batches)
        grads[name] = (gather_full_grads(chunks, cfg), reduce_metrics(reports))
    (want_g, want_m), (got_g, got_m) = grads["eager"], grads["graphs"]
    for name in want_g:
        assert_close(f"reused {name}", got_g[name], want_g[name], tol=1e-5)
    for k in want_m:
        assert abs(got_m[k] - want_m[k]) <= 1e-5 * max(1.0, abs(want_m[k])), k
    assert [k[1] for k in step.update_store.statics] == [BIG]
    metrics = step.graph_metrics()
    assert metrics["perf/update_graph_padding"] == pytest.approx(1 - real / (4 * BIG.tokens))
    assert "perf/logprob_graph_padding" not in metrics  # none ran since the last read


def test_graphed_passes_on_a_reused_larger_shape_equal_eager():
    """GRPOStep's graphed log-prob and update passes (CPU stand-ins for the graphs, DP 2 gloo)
    with a larger shape already in each store: every micro-batch takes it instead of capturing
    its own, and the log-probs, gradients and metrics are the eager passes'."""
    run_distributed(_passes_body, 2)
