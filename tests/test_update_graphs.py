"""CUDA graphs of the update's forward and backward (megatron/step/update_graphs.py): micro-batches
padded to graph shapes train as the unpadded ones (gradients, loss and metrics: CPU, dense
TP 2 + SP with token and GSPO losses, MoE with routing replay), through GRPOStep's graphed path
with each replay replaced by the eager forward of its padded micro-batch; UpdateGraphs' own
capture, replay and hand-off to DDP with CPU stand-ins for the graphs (DP 2, overlapped
reduction, tied embedding); the decision and its errors; and on a GPU the replayed passes'
gradients equal the eager ones, replaying each shape with new inputs and capturing again after
a parameter moved.

    python -m pytest -q -m gpu tests/test_update_graphs.py   # 1 GPU
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.loss.metrics import reduce_metrics
from megatron_grpo.megatron import GRPOStep, ParallelConfig, unwrap
from megatron_grpo.megatron.batch import graph_shape as gs
from megatron_grpo.megatron.batch.transport import prepare_batch, run_model
from megatron_grpo.megatron.moe.routing_replay import replay_routes, set_replay_routes
from megatron_grpo.megatron.step import graph_plan as gp
from megatron_grpo.megatron.step import graph_store as gstore
from megatron_grpo.megatron.step import update_graphs as ug
from megatron_grpo.train.config import TrainConfig
from tests.dist_utils import run_distributed
from tests.graph_utils import (
    LAYOUTS,
    MOE,
    RerunCache,
    count_dispatches,
    mixed_batches,
    rerun_graphs,
    rerun_model,
)
from tests.megatron_utils import (
    assert_close,
    build_layout,
    gather_full_grads,
    make_sequences,
    pack,
    tiny_model,
    train_grads,
)

GSPO = GRPOLossConfig(
    ratio_level="sequence", loss_agg="seq_mean_token_mean", clip_eps_low=3e-4, clip_eps_high=4e-4
)


def _batches(multiple: int = 1, n: int = 12, seed: int = 3, routes: bool = False):
    seqs = make_sequences(n, seed=seed)
    cuts = [(0, 3), (3, 1), (4, 5), (9, 3)]
    out = [pack(seqs[i : i + k], multiple) for i, k in cuts]
    if routes:  # half the tokens replay routes (-1 rows: live routing)
        g = torch.Generator().manual_seed(seed)
        for i, b in enumerate(out):
            r = torch.randint(0, 8, (b.num_tokens, 2, 2), generator=g)
            r[::2] = -1
            out[i] = dataclasses.replace(b, routes=r)
    return out


def _eager_graphs(step: GRPOStep, shapes: list) -> None:
    """Turn GRPOStep's graphed path on with each replay replaced by the eager forward of the
    padded micro-batch (what a graph of its shape replays), recording the shapes."""

    def forward(chunk, padded, shape, routes):
        assert padded.num_tokens == shape.tokens and padded.cu_seqlens.numel() == shape.docs + 1
        shapes.append(shape)
        gpt = unwrap(chunk)
        if padded.routes is not None:
            set_replay_routes(chunk, padded.routes)
        return run_model(chunk, *prepare_batch(padded, step.layout_of(gpt)))

    step.update_store.forward = forward
    step.update_graphs = True


def _train_both(chunks, cfg, step, batches, replay: bool = False):
    """(gradients, metrics) of the eager step, then of the padded (graphed) path."""
    out = []
    for graphed in (False, True):
        if graphed:
            shapes = []
            _eager_graphs(step, shapes)
            step.prepare_update(chunks, batches)
        with replay_routes(chunks) if replay else contextlib.nullcontext():
            reports = train_grads(chunks, step, batches)
        out.append((gather_full_grads(chunks, cfg), reduce_metrics(reports)))
    assert len(shapes) == len(batches) and not step._shapes
    assert any(s.tokens > b.num_tokens for s, b in zip(shapes, batches, strict=True))
    step.update_graphs = False
    return out


def _check_equal(tag: str, eager, graphed) -> None:
    (want, want_m), (got, got_m) = eager, graphed
    assert got.keys() == want.keys()
    for name in want:
        assert_close(f"{tag} {name}", got[name], want[name], tol=1e-5)
    assert got_m.keys() == want_m.keys(), (tag, got_m.keys() ^ want_m.keys())
    for k in want_m:
        assert abs(got_m[k] - want_m[k]) <= 1e-5 * max(1.0, abs(want_m[k])), (tag, k)


def _dense_body(rank: int, world: int) -> None:
    parallel = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    cfg = tiny_model()
    chunks = build_layout(parallel, cfg)
    for tag, loss in (("token", GRPOLossConfig()), ("gspo", GSPO)):
        step = GRPOStep(loss, vocab_size=cfg.vocab_size)
        _check_equal(tag, *_train_both(chunks, cfg, step, _batches(multiple=2)))
    step.update_graphs = True  # no shapes prepared: a clear error, not a silent eager pass
    with pytest.raises(RuntimeError, match="call prepare_update"):
        train_grads(chunks, step, _batches(multiple=2))


def test_padded_micro_batches_train_as_unpadded_tp2_sp():
    """The padding documents carry no loss and attend to themselves only: a step over padded
    micro-batches has the unpadded step's gradients, loss and metrics (fp32, TP 2 + SP; token
    ratios and GSPO's sequence ratios)."""
    run_distributed(_dense_body, 2)


def _moe_body(rank: int, world: int) -> None:
    cfg = tiny_model(**MOE, moe_enable_routing_replay=True)
    chunks = build_layout(ParallelConfig(), cfg)
    step = GRPOStep(GSPO, vocab_size=cfg.vocab_size)
    both = _train_both(chunks, cfg, step, _batches(routes=True), replay=True)
    _check_equal("moe", *both)


def test_padded_moe_micro_batches_train_as_unpadded_with_routing_replay():
    """MoE (dropless, live routing for the padding tokens, replayed routes for half the real
    ones): the real tokens keep their experts, so the step is the unpadded one's."""
    run_distributed(_moe_body, 1)


def _plan_body(rank: int, world: int) -> None:
    cfg = tiny_model(**MOE)
    chunks = build_layout(ParallelConfig(), cfg)
    step = GRPOStep(GRPOLossConfig(), vocab_size=cfg.vocab_size)
    assert step.plan_update_graphs(chunks) == "off: a model on the CPU"
    with pytest.raises(ValueError, match="training.update_cuda_graphs=true cannot apply"):
        step.plan_update_graphs(chunks, True)
    assert step.plan_update_graphs(chunks, False) == "off (training.update_cuda_graphs=false)"
    assert not step.update_graphs
    step.prepare_update(chunks, _batches())  # off: nothing to prepare
    assert not step._shapes
    _shape_budget(step, chunks)
    config = unwrap(chunks[0]).config
    assert gp.backward_unsupported(chunks[0]) is None
    changes = {
        "recompute_granularity": ("full", "activation recompute"),
        "hidden_dropout": (0.1, "dropout"),
        "moe_aux_loss_coeff": (0.01, "MoE aux / z losses"),
        "moe_z_loss_coeff": (0.001, "MoE aux / z losses"),
    }
    for name, (value, why) in changes.items():
        before = getattr(config, name)
        setattr(config, name, value)
        try:
            assert gp.backward_unsupported(chunks[0]).startswith(why), name
        finally:
            setattr(config, name, before)
    ddp = chunks[0].ddp_config
    try:
        for grad, param in ((True, False), (False, True), (True, True)):
            chunks[0].ddp_config = SimpleNamespace(
                overlap_grad_reduce=grad, overlap_param_gather=param
            )
            assert gp.backward_unsupported(chunks[0]) is None, (grad, param)
    finally:
        chunks[0].ddp_config = ddp
    no_ddp = "a model without megatron-core's DDP gradient buffers"
    assert gp.backward_unsupported(unwrap(chunks[0])).startswith(no_ddp)
    assert len(ug.trained_params(chunks[0])) == len(list(unwrap(chunks[0]).parameters()))
    # auto's estimate, the GPU-only checks patched
    layout = step.layout_of(unwrap(chunks[0]))
    unsupported = gp.update_graphs_unsupported
    try:
        gp.update_graphs_unsupported = lambda chunks, layout: None
        on, line = gp.plan_update_graphs(chunks, layout, None, 128)
        assert on and line.startswith("on: a forward and backward of 128 tokens"), line
        on, line = gp.plan_update_graphs(chunks, layout, None, 10**9)
        assert not on and "GPU-bound" in line, line
        # offload moves the gradient buffers: auto off, true on and said
        on, line = gp.plan_update_graphs(chunks, layout, None, 128, grads_move=True)
        assert not on and line == f"off under auto: {gp.MOVING_GRADS}", line
        on, line = gp.plan_update_graphs(chunks, layout, True, 128, grads_move=True)
        assert on and line.endswith(f"; {gp.MOVING_GRADS}"), line
        assert gp.plan_update_graphs(chunks, layout, False, 128, True)[0] is False
    finally:
        gp.update_graphs_unsupported = unsupported
    # the backward graphs write main_grad: a gradient buffer that moved (offload) is seen
    store = ug.UpdateGraphs()
    before = store.addresses_of(chunks[0])
    first = ug.trained_params(chunks[0])[0]
    first.main_grad = first.main_grad.clone()
    assert store.addresses_of(chunks[0]) != before


def _shape_budget(step: GRPOStep, chunks) -> None:
    """A step's schedules share one store: past MAX_GRAPHS / MAX_SHAPES of them each takes
    fewer shapes, so that a step's shapes fit (else each would be captured again each step)."""
    assert [gstore.shape_budget(n) for n in (1, 4, 5, 8, 16, 40)] == [4, 4, 3, 2, 1, 1]
    mixed = mixed_batches(12, 90, seed=1)
    assert len(set(gs.graph_shapes(mixed, most=len(mixed)))) > 4
    for schedules, most in ((1, 4), (8, 2), (16, 1)):
        step.plan_update_graphs(chunks, False, schedules=schedules)
        step.update_graphs = True  # the shapes only: replays need CUDA
        step.prepare_update(chunks, mixed)
        assert 1 <= len(set(step._shapes)) <= most, (schedules, set(step._shapes))
        step.update_graphs = False
        step._shapes.clear()


def _agree_body(rank: int, world: int) -> None:
    import torch.distributed as dist

    cfg = tiny_model()
    chunks = build_layout(ParallelConfig(), cfg)  # DP 2: each rank its own micro-batches
    step = GRPOStep(GRPOLossConfig(), vocab_size=cfg.vocab_size)
    step.update_graphs = True  # as EP over DP would, without a GPU to capture on
    batches = _batches(n=12 + 20 * rank, seed=rank)
    big = gs.GraphShape(1024, 64, 1024)  # each rank one large micro-batch, at its own index
    batches[rank] = gs.pad_to_shape(batches[rank], big)
    step.prepare_update(chunks, batches, dist.group.WORLD)
    shapes = list(step._shapes)
    theirs = [None] * world
    dist.all_gather_object(theirs, shapes)
    assert all(t == shapes for t in theirs), theirs  # the i-th forwards share one shape
    assert shapes[0].tokens >= 1024 and shapes[1].tokens >= 1024, shapes
    for b, s in zip(batches, shapes, strict=True):
        assert s.tokens >= b.num_tokens and s.docs >= b.cu_seqlens.numel()
    # a rank with another number of micro-batches: a clear error on every rank, not a hang
    with pytest.raises(ValueError, match="bring 4 to 5 micro-batches"):
        step.prepare_update(chunks, batches + batches[:1] * rank, dist.group.WORLD)


def test_ranks_agree_on_each_update_forwards_shape():
    """``prepare_update(count_group=...)``: ranks whose forwards are collectives with each other
    (MoE EP over DP) replay graphs of the same shape for each micro-batch, and ranks with
    different micro-batch counts get an error (gloo, 2 ranks)."""
    run_distributed(_agree_body, 2)


def _shadow_body(rank: int, world: int) -> None:
    cfg = tiny_model()
    chunks = build_layout(ParallelConfig(), cfg)
    gpt, params = unwrap(chunks[0]), ug.trained_params(chunks[0])
    batch = _batches()[0]

    def loss() -> torch.Tensor:
        return run_model(chunks[0], *prepare_batch(batch, step.layout_of(gpt))).square().sum()

    step = GRPOStep(GRPOLossConfig(), vocab_size=cfg.vocab_size)
    want = torch.autograd.grad(loss(), params, allow_unused=True)
    with ug.shadow_params(chunks[0], params) as leaves:
        assert all(m.weight is not p for m in gpt.modules() for p in params if hasattr(m, "weight"))
        out = loss()
    assert [p for p in gpt.parameters()] == params  # restored, the same objects
    for p, leaf in zip(params, leaves, strict=True):
        assert leaf.data_ptr() == p.data_ptr() and leaf is not p and leaf.requires_grad
        assert getattr(leaf, "tensor_model_parallel", None) == getattr(
            p, "tensor_model_parallel", None
        )
    got = torch.autograd.grad(out, leaves, allow_unused=True)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g is None) == (w is None), i
        if w is not None:
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert all(p.grad is None for p in params)  # nothing reached the real parameters


def test_shadow_params_share_storage_and_take_the_gradients():
    """The capture's stand-in leaves: the parameters' storage and attributes, the same
    gradients, the modules' own parameters back afterwards."""
    run_distributed(_shadow_body, 1)


def test_update_graph_plan_and_its_errors():
    run_distributed(_plan_body, 1)


def test_update_pass_tokens():
    cfg = TrainConfig()
    t = cfg.training
    assert cfg.update_pass_tokens == t.micro_batch_size * (
        cfg.rollout.max_prompt_length + cfg.rollout.max_response_length
    )
    t.micro_batch_size, t.max_tokens_per_micro_batch = None, 4096
    assert cfg.update_pass_tokens == 4096


# ---------------------------------------------------------------- GPU: replayed == eager


def _rerun_body(rank: int, world: int, layout: str) -> None:
    import torch.distributed as dist

    cfg, chunks = rerun_model(layout)
    if "overlap" in layout:  # one bucket: its reduction starts once each parameter is ready
        assert len(chunks[0].bucket_groups) == 1
    tp = layout.startswith("tp")
    eager = GRPOStep(GSPO, vocab_size=cfg.vocab_size)
    graphed = GRPOStep(GSPO, vocab_size=cfg.vocab_size)
    graphed.update_store.cache = RerunCache(chunks[0])
    graphed.update_graphs = True
    chosen = count_dispatches()
    captures = []  # each step's perf/ metrics of the graphs
    # DDP's first step counts each parameter's hooks, later ones start a bucket's reduction
    # when its count is reached: three steps, the graphs captured in the first
    for seed in (3, 4, 3):
        batches = _batches(multiple=2 if tp else 1, seed=seed + (0 if tp else 10 * rank))
        chosen.clear()
        reports = train_grads(chunks, eager, batches)
        assert set(chosen) == ({"megatron"} if layout == "ep2" else set()), set(chosen)
        want = (gather_full_grads(chunks, cfg), reduce_metrics(reports))
        graphed.prepare_update(chunks, batches, dist.group.WORLD)  # EP: one shape per forward
        chosen.clear()
        reports = train_grads(chunks, graphed, batches)
        got = (gather_full_grads(chunks, cfg), reduce_metrics(reports))
        assert set(chosen) == ({"gathered"} if layout == "ep2" else set()), set(chosen)
        _check_equal(f"{layout} seed {seed}", want, got)
        captures.append(graphed.graph_metrics())
    store = graphed.update_store
    assert store.cache.captures == 2 * len(store.statics) > 0
    # the metric counts each step's captures (forward and backward); seed 3 again: none new
    counts = [m.pop("perf/update_graph_captures") for m in captures]
    assert all(0 < m.pop("perf/update_graph_padding") < 1 for m in captures), captures
    assert counts[0] > 0 and counts[2] == 0 and sum(counts) == store.captures, counts
    assert captures == [{}] * 3  # the log-prob graphs are off: no key of theirs
    shared = {len(b.shared) for b in store.backwards.values()}
    assert shared == {1 if "tied" in layout else 0}, shared  # tied: its hook after the replay
    # dropped (for the KV cache): nothing held, the count kept
    assert graphed.drop_graphs() == sum(counts) // 2  # shapes held
    assert not store.statics and store.cache is None and store.captures == sum(counts)


def _param_gather_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import build_model
    from megatron_grpo.train.config import OptimizerConfig
    from megatron_grpo.train.optim import build_optimizer, optimizer_step

    rerun_graphs()
    cfg, parallel = tiny_model(), ParallelConfig(overlap_grad_reduce=True)  # DP 2
    runs = {}
    for how in ("eager", "graphs"):
        build_layout(parallel, cfg)  # the same seed: the same initial weights
        chunks = build_model(
            cfg, parallel, use_distributed_optimizer=True, overlap_param_gather=True
        )
        assert chunks[0].use_forward_hook  # the updated shards gathered module by module
        opt_cfg = OptimizerConfig(lr=1e-2, use_distributed_optimizer=True)
        optimizer, scheduler = build_optimizer(opt_cfg, chunks, 10)
        step = GRPOStep(GSPO, vocab_size=cfg.vocab_size)
        if how == "graphs":
            step.logprob_graphs = step.update_graphs = True
            step.graphs.cache, step.update_store.cache = (
                RerunCache(chunks[0]),
                RerunCache(chunks[0]),
            )
        logps = []
        for seed in (3, 4, 5):  # after each optimizer step both kinds of passes read the update
            batches = _batches(seed=seed + 10 * rank)
            logps += step.compute_logprobs(chunks, batches)
            step.prepare_update(chunks, batches)
            train_grads(chunks, step, batches)
            optimizer_step(optimizer, scheduler)
        logps += step.compute_logprobs(chunks, batches)
        runs[how] = logps
    for i, (got, want) in enumerate(zip(runs["graphs"], runs["eager"], strict=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"pass {i}")


def test_graphed_passes_wait_for_overlapped_param_gathers():
    """The distributed optimizer with overlap_param_gather (DP 2, gloo): its updated shards
    are gathered by DDP's forward pre-hooks, which a replayed graph never runs (nor do the CPU
    stand-ins here). Three steps of graphed log-prob and update passes and optimizer steps give
    the eager run's log-probs: each pass waits for every gather first."""
    run_distributed(_param_gather_body, 2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_update_graph_replays_hand_their_gradients_to_ddp(layout):
    """UpdateGraphs' capture and replay with CPU stand-ins for the graphs (each replay reruns the
    captured Python): the gradients the backward graph adds to main_grad, reduced by DDP, equal
    the eager step's for three steps (2 gloo ranks). With overlap_grad_reduce (the replay marks
    its parameters ready in DDP's buckets), a tied embedding (its hook, after the replay, adds
    the LM head's part), TP 2 + SP, and EP 2 (the graphs' gathered dispatch against the eager
    step's all-to-all; the ranks agree on each forward's shape)."""
    run_distributed(_rerun_body, 2, layout)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_body(rank: int, world: int, moe: bool, tied: bool, overlap: bool) -> None:
    extra = dict(MOE, moe_enable_routing_replay=True) if moe else {}
    extra["share_embeddings_and_output_weights"] = tied  # tied: graph and LM head both add
    cfg = tiny_model(params_dtype="bfloat16", max_sequence_length=256, **extra)
    chunks = build_layout(ParallelConfig(overlap_grad_reduce=overlap), cfg)
    steps = {
        how: GRPOStep(GSPO, vocab_size=cfg.vocab_size) for how in ("eager", "padded", "graphs")
    }
    _eager_graphs(steps["padded"], [])  # eager, on the padded micro-batches
    assert (
        steps["graphs"]
        .plan_update_graphs(chunks, None, 4096)
        .startswith("on: a forward and backward of 4096 tokens is host-bound")
    )
    store = steps["graphs"].update_store
    first = _batches(n=40, seed=5, routes=moe)
    second = _batches(n=40, seed=6, routes=moe)  # the same shapes, other inputs

    def run(batches, how: str):
        steps[how].prepare_update(chunks, batches)
        with replay_routes(chunks) if moe else contextlib.nullcontext():
            reports = train_grads(chunks, steps[how], batches)
        return gather_full_grads(chunks, cfg), reduce_metrics(reports)

    def check(tag: str, batches) -> None:
        eager, graphed = run(batches, "eager"), run(batches, "graphs")
        _check_close(tag, run(batches, "padded"), graphed, 1e-3)  # same kernels, same sizes
        _check_close(tag, eager, graphed, 2e-2)  # the unpadded GEMMs may round differently

    captures = []
    for tag, batches in (("first", first), ("second", second), ("first again", first)):
        check(tag, batches)
        captures.append(store.cache.captures)
    print("captures", captures, flush=True)
    # two graphs a shape, captured once: kept across steps
    assert captures[0] > 0 and captures[1] == captures[0] == captures[2], captures
    assert captures[0] == 2 * len(store.statics), (captures, len(store.statics))
    w = next(chunks[0].parameters())
    w.data = w.data.clone()  # moved: its graphs read the old address
    check("after a parameter moved", first)
    assert store.cache.captures == 2 * captures[0], store.cache.captures


def _check_close(tag: str, want_run, got_run, tol: float) -> None:
    """Gradients within ``tol`` of each one's scale, metrics within ``tol`` relative (bf16)."""
    (want, want_m), (got, got_m) = want_run, got_run
    worst = max(float((got[n] - want[n]).abs().max() / (want[n].abs().max() + 1e-12)) for n in want)
    print(tag, f"tol {tol}: worst relative gradient difference {worst:.3e}", flush=True)
    for name in want:
        assert_close(f"{tag} {name}", got[name], want[name], tol=tol)
    for k in want_m:
        assert abs(got_m[k] - want_m[k]) <= tol * max(1.0, abs(want_m[k])), (tag, k)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "moe,tied,overlap",
    [(False, False, False), (True, False, False), (False, True, True)],
    ids=["dense", "moe_replay", "tied_overlap"],
)
def test_gpu_replayed_update_equals_eager(moe, tied, overlap):
    """1 GPU: each micro-batch's forward and backward replayed from its shape's graphs give the
    eager step's gradients and metrics; shapes captured once and replayed with new inputs; a
    moved parameter captures them again. A tied embedding with overlap_grad_reduce: the graph
    and the LM head both add to its main_grad, and DDP's bucket starts after both."""
    run_distributed(_gpu_body, 1, moe, tied, overlap, backend="nccl", timeout=300)
