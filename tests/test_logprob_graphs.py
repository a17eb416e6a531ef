"""CUDA graphs of the no-grad log-prob passes (megatron/step/logprob_graphs.py): micro-batches
padded to graph shapes keep their real tokens' log-probs (CPU, TP 2 + SP); a captured forward's
static bounds are read on the device only; the decision and its errors; and on a GPU the
replayed passes equal the eager ones (dense, and MoE with routing replay), replaying each shape
with new inputs.

    python -m pytest -q -m gpu tests/test_logprob_graphs.py   # 1 GPU
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron import GRPOStep, ParallelConfig, unwrap
from megatron_grpo.megatron.attention import choice
from megatron_grpo.megatron.attention import packed as pa
from megatron_grpo.megatron.attention import varlen as va
from megatron_grpo.megatron.attention.rope import cu_positions, packed_positions
from megatron_grpo.megatron.batch import graph_shape as gs
from megatron_grpo.megatron.cuda_graphs import GraphCache
from megatron_grpo.megatron.step import graph_plan as gp
from megatron_grpo.megatron.step import graph_store
from megatron_grpo.megatron.step import logprob_graphs as lg
from tests.dist_utils import run_distributed
from tests.graph_utils import RerunCache, count_dispatches, mixed_batches, rerun_model
from tests.megatron_utils import build_layout, make_sequences, pack, tiny_model


def _batches(multiple: int = 1, n: int = 12, seed: int = 3):
    seqs = make_sequences(n, seed=seed)
    cuts = [(0, 3), (3, 1), (4, 5), (9, 3)]
    return [pack(seqs[i : i + k], multiple) for i, k in cuts]


def _lens(cu: torch.Tensor) -> list[int]:
    return (cu[1:] - cu[:-1]).tolist()


@pytest.mark.parametrize("multiple", [1, 2, 4])
def test_padding_fills_the_shape_with_nonempty_masked_documents(multiple):
    routes = torch.randint(0, 4, (1, 3, 2))
    for batch in _batches(multiple):
        batch = dataclasses.replace(batch, routes=routes.expand(batch.num_tokens, 3, 2).clone())
        (shape,) = gs.graph_shapes([batch], multiple)
        t, s = batch.num_tokens, batch.cu_seqlens.numel() - 1
        assert shape.tokens % multiple == 0 and shape.tokens >= t + shape.docs - s
        assert shape.tokens <= max(gs.MIN_TOKENS, t + shape.docs) * 17 // 16 + multiple
        padded = gs.pad_to_shape(batch, shape)
        padded.validate()
        assert padded.num_tokens == shape.tokens and padded.cu_seqlens.numel() == shape.docs + 1
        assert min(_lens(padded.cu_seqlens)) >= 1 and max(_lens(padded.cu_seqlens)) <= shape.max_len
        for f in dataclasses.fields(batch):
            x, y = getattr(batch, f.name), getattr(padded, f.name)
            if f.name != "cu_seqlens" and x is not None:
                assert torch.equal(y[:t], x), f.name
        assert torch.equal(padded.cu_seqlens[: s + 1], batch.cu_seqlens)
        assert not padded.loss_mask[t:].any() and bool((padded.routes[t:] == -1).all())
        # positions restart in every padding document
        starts = padded.cu_seqlens[s:-1].long()
        assert torch.equal(padded.position_ids[starts], torch.zeros_like(starts))


def test_larger_agreed_shapes_fit_and_too_small_ones_are_refused():
    batch = _batches(2)[2]
    (shape,) = gs.graph_shapes([batch], 2)
    big = gs.GraphShape(shape.tokens * 2, shape.docs * 4, shape.tokens * 2)
    padded = gs.pad_to_shape(batch, big)
    assert padded.num_tokens == big.tokens and min(_lens(padded.cu_seqlens)) >= 1
    with pytest.raises(ValueError, match="does not fit the graph shape"):
        gs.pad_to_shape(batch, gs.GraphShape(batch.num_tokens, shape.docs, shape.max_len))
    with pytest.raises(ValueError, match="longer than the graph shape"):
        gs.pad_to_shape(batch, gs.GraphShape(shape.tokens, shape.docs, 2))


def test_token_buckets_waste_at_most_a_sixteenth():
    for n in [1, 127, 128, 129, 1000, 4095, 4097, 30001, 32768, 65537]:
        for m in (1, 2, 8):
            r = gs.round_tokens(n, m)
            assert r >= n and r % m == 0 and r <= max(n, gs.MIN_TOKENS) * 17 // 16 + m, (n, m)


def test_mixed_lengths_take_at_most_max_shapes_and_each_batch_fits():
    """Micro-batches of mixed lengths whose own buckets give many shapes: at most ``most``
    (more documents, coarser token buckets, one shape at the end), each at least the batch's
    own bucket and fitting it; within the budget, the batches' own buckets unchanged."""
    batches = mixed_batches(24, 600, seed=0, multiple=2)
    own = gs.graph_shapes(batches, 2, most=len(batches))
    assert len(set(own)) > gs.MAX_SHAPES
    for most in (gs.MAX_SHAPES, 2, 1):
        shapes = gs.graph_shapes(batches, 2, most=most)
        assert len(set(shapes)) <= most, (most, set(shapes))
        for b, s, o in zip(batches, shapes, own, strict=True):
            assert s.tokens >= o.tokens and s.docs >= o.docs and s.tokens % 2 == 0
            padded = gs.pad_to_shape(b, s)
            assert padded.num_tokens == s.tokens and max(_lens(padded.cu_seqlens)) <= s.max_len
    assert len(set(shapes)) == 1 and shapes[0].tokens == max(s.tokens for s in shapes)
    few = batches[:2]
    assert gs.graph_shapes(few, 2) == own[:2]  # within the budget: each batch's own


def _static_params(bounds: list[int], max_len: int) -> PackedSeqParams:
    cu = torch.tensor(bounds, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    pa.mark_static(params, max_len)
    return params


def test_static_bounds_are_read_on_the_device_only():
    bounds = [0, 5, 6, 17, 20]
    params = _static_params(bounds, 16)
    layout = va.varlen_layout(params, 20, torch.device("cpu"))
    assert layout.cu is params.cu_seqlens_q and (layout.max_len, layout.end) == (16, 20)
    with pytest.raises(ValueError, match="reads them on the host"):
        pa.document_layout(params, torch.device("cpu"))
    q = torch.empty(20, 4, 8)
    with pytest.raises(ValueError, match="runs 'varlen' only"):
        choice.choose_packed_impl("auto", q, q[:, :2], 0.0, params)
    with pytest.raises(ValueError, match="runs 'varlen' only; 'blocked'"):
        choice.choose_packed_impl("blocked", q, q[:, :2], 0.0, params)
    params.__dict__["_grpo_roped"] = "a forward's cache"
    pa.forget_forward_caches(params)  # before a capture: caches go, the static mark stays
    assert "_grpo_roped" not in params.__dict__ and pa.static_max_len(params) == 16
    for tokens in (20, 23):
        want = packed_positions(bounds, tokens)
        assert torch.equal(cu_positions(params.cu_seqlens_q, tokens), want)


def _padded_body(rank: int, world: int) -> None:
    parallel = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    chunks = build_layout(parallel, tiny_model())
    step = GRPOStep(GRPOLossConfig(), vocab_size=tiny_model().vocab_size)
    batches = _batches(multiple=2)
    shapes = gs.graph_shapes(batches, 2)
    want = step.compute_logprobs(chunks, batches)
    padded = [gs.pad_to_shape(b, s) for b, s in zip(batches, shapes, strict=True)]
    got = step.compute_logprobs(chunks, padded)
    for i, (g, w, b) in enumerate(zip(got, want, batches, strict=True)):
        torch.testing.assert_close(g[: b.num_tokens], w, rtol=0, atol=1e-6, msg=f"batch {i}")
    assert step.plan_logprob_graphs(chunks) == "off: a model on the CPU"
    with pytest.raises(ValueError, match="training.logprob_cuda_graphs=true cannot apply"):
        step.plan_logprob_graphs(chunks, True)
    assert step.plan_logprob_graphs(chunks, False) == "off (training.logprob_cuda_graphs=false)"
    graphs = lg.LogprobGraphs()  # a moved parameter is seen (on the DDP-wrapped chunk)
    graphs.check_model(chunks[0], [None])
    before = graphs.addresses[id(chunks[0])]
    w = next(chunks[0].parameters())
    w.data = w.data.clone()
    assert graph_store.model_addresses(chunks[0]) != before
    gpt = unwrap(chunks[0])  # the auto estimate: the decoder's matmul weights against the host
    weights = sum(p.numel() for p in gpt.decoder.parameters() if p.dim() == 2)
    assert gp.active_matmul_params(gpt) == weights
    assert gp.host_bound(gpt, 4096)[0] and not gp.host_bound(gpt, 10**9)[0]
    why = gp._attention_unsupported(unwrap(chunks[0]), torch.bfloat16)  # the layers' checks
    assert why == "layer 0: varlen_attn runs on CUDA only (tensors on cpu)", why
    assert not step.logprob_graphs
    gpt.config.hidden_dropout = 0.1  # the trainer's captures skip the RNG tracker's forks
    try:
        assert gp.graphs_unsupported(chunks, SimpleNamespace(pp_size=1, cp_size=1)) == (
            "hidden_dropout=0.1 (megatron-core's RNG tracker)"
        )
    finally:
        gpt.config.hidden_dropout = 0.0


def test_captures_skip_the_rng_trackers_forks():
    """Inside a capture megatron-core's (not graph-safe) RNG tracker forks to nothing; a fork
    outside, or a graph-safe tracker's, is the tracker's own (here: an unknown state's error)."""
    from megatron.core import tensor_parallel

    from megatron_grpo.megatron.cuda_graphs import rng_forks_skipped

    tracker = tensor_parallel.get_cuda_rng_tracker()
    with pytest.raises(Exception, match="rng state no-such-state is not added"):
        with tracker.fork("no-such-state"):
            pass
    with rng_forks_skipped():
        with tracker.fork("no-such-state"):  # skipped: no state swapped, none needed
            pass
    assert "fork" not in vars(tracker)  # the class's method again
    tracker.use_cudagraphable_rng = True
    try:
        with rng_forks_skipped(), pytest.raises(Exception, match="is not added"):
            with tracker.fork("no-such-state"):
                pass
    finally:
        tracker.use_cudagraphable_rng = False


def test_padded_micro_batches_keep_their_logprobs_tp2_sp():
    """The padding documents attend to themselves only: the real tokens' log-probs of a padded
    micro-batch are the unpadded one's (fp32, eager, TP 2 + SP)."""
    run_distributed(_padded_body, 2)


def _rerun_body(rank: int, world: int, layout: str) -> None:
    import torch.distributed as dist

    cfg, chunks = rerun_model(layout)
    step = GRPOStep(GRPOLossConfig(), vocab_size=cfg.vocab_size)
    ep = layout == "ep2"
    # EP ranks bring their own micro-batches, rank 1 two more (its peer runs a spare forward)
    batches = _batches(multiple=1 if ep else 2, seed=rank if ep else 0)
    batches += _batches(seed=7)[:2] if ep and rank else []
    group = dist.group.WORLD if ep else None
    chosen = count_dispatches()
    for max_tokens in (None, 48):
        want = step.compute_logprobs(chunks, batches, max_tokens, group)
        assert set(chosen) == ({"megatron"} if ep else set()), set(chosen)
        step.logprob_graphs, step.graphs.cache = True, RerunCache(chunks[0])
        chosen.clear()
        got = step.compute_logprobs(chunks, batches, max_tokens, group)
        assert set(chosen) == ({"gathered"} if ep else set()), set(chosen)
        assert step.graphs.cache.captures == len(step.graphs.cache.graphs) > 0
        # the step's captures, counted across the store's clears; the update graphs' are off
        captured = float(step.graphs.cache.captures)
        metrics = step.graph_metrics()
        assert 0 < metrics.pop("perf/logprob_graph_padding") < 1  # batches padded to shapes
        assert metrics == {"perf/logprob_graph_captures": captured}
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5, msg=f"{layout} {max_tokens} {i}")
        step.logprob_graphs = False
        step.graphs.clear()
        chosen.clear()


@pytest.mark.parametrize("layout", ["tp2_sp", "ep2"])
def test_replayed_logprob_passes_equal_eager_on_cpu_stand_ins(layout):
    """The graphed log-prob passes' own Python (shapes agreed over the EP ranks, static inputs,
    capture and replay) with CPU stand-ins for the graphs (each replay reruns the captured
    forward) equal the eager passes, unmerged and merged: TP 2 + SP, and EP 2 with the
    gathered dispatch against the eager all-to-all, the ranks bringing different numbers of
    micro-batches (2 gloo ranks)."""
    run_distributed(_rerun_body, 2, layout)


# ---------------------------------------------------------------- GPU: replayed == eager

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_cfg(moe: bool):
    extra = dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64) if moe else {}
    if moe:
        extra.update(moe_grouped_gemm=True, moe_enable_routing_replay=True)
    return tiny_model(params_dtype="bfloat16", max_sequence_length=256, **extra)


def _gpu_body(rank: int, world: int, moe: bool) -> None:
    cfg = _gpu_cfg(moe)
    chunks = build_layout(ParallelConfig(), cfg)
    step = GRPOStep(GRPOLossConfig(), vocab_size=cfg.vocab_size)
    batches = _batches(n=40, seed=5) + _batches(n=40, seed=6)  # shapes repeat, inputs differ
    if moe:  # half the tokens replay routes (-1 rows: live routing)
        for i, b in enumerate(batches):
            r = torch.randint(0, 8, (b.num_tokens, 2, 2))
            r[::2] = -1
            batches[i] = dataclasses.replace(b, routes=r)
    eager = step.compute_logprobs(chunks, batches)
    shapes = gs.graph_shapes(batches)
    padded = [gs.pad_to_shape(b, s) for b, s in zip(batches, shapes, strict=True)]
    eager_padded = step.compute_logprobs(chunks, padded)
    auto = step.plan_logprob_graphs(chunks, None, 4096)
    assert auto.startswith("on: a forward of 4096 tokens is host-bound"), auto
    runs = []
    real_run = GraphCache.run

    def counted(self, key, *args, **kw):
        runs.append(key in self.graphs)
        return real_run(self, key, *args, **kw)

    def check(tag: str) -> None:
        got = step.compute_logprobs(chunks, batches)
        diffs = [
            (float((g - p[: g.numel()]).abs().max()), float((g - w).abs().max()))
            for g, w, p in zip(got, eager, eager_padded, strict=True)
        ]
        print(tag, "max |graph - eager padded|, |graph - eager|:", diffs, flush=True)
        for i, (g, w, p) in enumerate(zip(got, eager, eager_padded, strict=True)):
            # the eager pass's kernels at the padded size; the unpadded pass's GEMMs may round
            # differently
            torch.testing.assert_close(
                g, p[: g.numel()], rtol=0, atol=1e-5, msg=f"{tag} {i}: {diffs[i]}"
            )
            torch.testing.assert_close(g, w, rtol=0, atol=3e-2, msg=f"{tag} {i}: {diffs[i]}")

    GraphCache.run = counted
    try:
        check("first call")
        first = list(runs)
        assert 0 < first.count(False) < len(first), first  # shapes shared: some replay at once
        runs.clear()
        check("second call")
        assert all(runs), runs  # kept across calls: nothing captured again
        runs.clear()
        w = next(chunks[0].parameters())
        w.data = w.data.clone()  # moved: its graphs read the old address
        check("after a parameter moved")
        assert runs.count(False) == first.count(False), runs
    finally:
        GraphCache.run = real_run


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe_replay"])
def test_gpu_replayed_logprob_passes_equal_eager(moe):
    """1 GPU: each forward replayed from its shape's graph gives the eager pass's log-probs
    (bf16 rounding at the padded size), with new inputs at every replay."""
    run_distributed(_gpu_body, 1, moe, backend="nccl", timeout=300)


def _agree_body(rank: int, world: int) -> None:
    import torch.distributed as dist

    # each rank its own micro-batches (EP over DP): the i-th forwards get one shape, and each
    # rank's batch still fits it
    batches = _batches(multiple=2, n=12 + 20 * rank, seed=rank)
    batches[rank] = gs.pad_to_shape(batches[rank], gs.GraphShape(1024, 64, 1024))  # a big one
    mine = gs.graph_shapes(batches, 2)
    agreed = gs.graph_shapes(batches, 2, dist.group.WORLD)
    theirs = [None] * world
    dist.all_gather_object(theirs, agreed)
    assert all(t == agreed for t in theirs), theirs
    for b, m, a in zip(batches, mine, agreed, strict=True):
        assert a.tokens >= m.tokens and a.docs >= m.docs
        assert gs.pad_to_shape(b, a).num_tokens == a.tokens  # fits (or raises)
    # beyond the budget the ranks still agree (the coarser choices follow agreed values)
    one = gs.graph_shapes(batches, 2, dist.group.WORLD, most=1)
    dist.all_gather_object(theirs, one)
    assert all(t == one for t in theirs) and len(set(one)) == 1, theirs
    for b, s in zip(batches, one, strict=True):
        assert gs.pad_to_shape(b, s).num_tokens == s.tokens


def test_ranks_agree_on_each_forwards_shape():
    run_distributed(_agree_body, 2)


def test_auto_captures_at_ep_and_leaves_dense_tp_eager(monkeypatch):
    """Auto at EP > 1: on (the expert group's ranks wait on each other's host; measured);
    dense TP > 1: off (not measured); an explicit choice or a reason why not wins either way."""
    moe = SimpleNamespace(config=SimpleNamespace(expert_model_parallel_size=2))
    dense = SimpleNamespace(config=SimpleNamespace(expert_model_parallel_size=1))
    tp2 = SimpleNamespace(tp_size=2)
    monkeypatch.setattr(gp, "unwrap", lambda chunk: chunk)  # stand-ins for the models
    on, line = gp._plan(gp.KNOB, None, [moe], tp2, None, None)
    assert on and line == f"on under auto at EP > 1: {gp.EP_RANKS_WAIT}"
    on, line = gp._plan(gp.UPDATE_KNOB, None, [dense], tp2, None, 4096, backward=True)
    assert not on and line.startswith("off under auto at TP > 1")
    assert gp._plan(gp.KNOB, None, [moe], tp2, False, None) == (
        False,
        "off (training.logprob_cuda_graphs=false)",
    )
    assert gp._plan(gp.KNOB, "why", [moe], tp2, None, None) == (False, "off: why")
