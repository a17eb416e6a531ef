"""MoE Rollout Routing Replay (R3) at EP=2 and TP=2 (sequence parallel): routes recorded in one
forward and replayed after the router weights were perturbed give the recorded log-probs, in the
no-grad pass and in the training forward (also with activation recompute), and the router still
gets gradients; rollout files whose routes do not fit the model are errors naming file:line."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_grpo.loss import GRPOLossConfig, reduce_metrics
from megatron_grpo.megatron import GRPOStep, ParallelConfig, unwrap
from megatron_grpo.megatron.batch.packing import PackedBatch
from megatron_grpo.megatron.moe import routing_replay
from megatron_grpo.megatron.moe.routing_replay import (
    NoRoutingReplay,
    RoutingReplay,
    check_routes,
    record_routes,
    replay_mismatch,
    replay_routes,
)
from megatron_grpo.ops.kernels import LayerKernels
from megatron_grpo.rollout.files import read_rollouts, write_rollouts
from tests.dist_utils import run_distributed
from tests.megatron_utils import build_layout, make_sequences, pack, tiny_model, train_grads

LAYERS, TOPK, EXPERTS = 2, 2, 4


def _moe(**kw):
    return tiny_model(
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=32,
        moe_enable_routing_replay=True, **kw,
    )  # fmt: skip


def _twin_routers(chunks) -> None:
    """Give expert 3 the router row of expert 2 in every layer: their logits tie, so top-k picks
    by index (the "generator's" routes), and a tiny perturbation of row 3 flips the selection of
    many tokens while moving no gating weight at the recorded ids by more than ~1e-6."""
    with torch.no_grad():
        for name, p in unwrap(chunks[0]).named_parameters():
            if name.endswith("router.weight"):
                p[3] = p[2]


def _perturb_routers(chunks) -> None:
    # The gating weights are recomputed from the live router, so an exact log-prob match after
    # a perturbation needs one that changes the selection only: break the twins' tie.
    g = torch.Generator().manual_seed(3)  # same draw on every rank: routers are replicated
    with torch.no_grad():
        for name, p in unwrap(chunks[0]).named_parameters():
            if name.endswith("router.weight"):
                p[3] += torch.randn(p.shape[1], generator=g) * p.abs().mean() * 1e-5


def _router_grad(chunks) -> float:
    grads = [p.main_grad for n, p in unwrap(chunks[0]).named_parameters() if "router" in n]
    return float(sum(g.abs().sum() for g in grads))


def _train(chunks, step, batches) -> tuple[float, float]:
    """Training forward/backward with replay: (min, max) of the policy ratio new / old."""
    with replay_routes(chunks):
        reports = train_grads(chunks, step, batches)
    m = reduce_metrics(reports)
    return m["loss/ratio_min"], m["loss/ratio_max"]


def _record(step, chunks, batches) -> list[torch.Tensor]:
    """Record routes of ``batches``; sets their old log-probs to the recorded forward's."""
    with record_routes(chunks) as rec:
        logps = step.compute_logprobs(chunks, batches)
        routes = rec.take().split([b.num_tokens for b in batches])
    for b, lp, r in zip(batches, logps, routes, strict=True):
        assert r.shape == (b.num_tokens, LAYERS, TOPK), r.shape
        assert int(r.min()) >= 0 and int(r.max()) < EXPERTS
        b.old_logprobs = lp
    return routes


def _cpu_checkpointing() -> None:
    """megatron's CheckpointFunction saves the CUDA RNG state: none on a CPU-only host (this
    test's model has no dropout, so there is nothing to restore)."""
    from megatron.core.tensor_parallel import random

    if not torch.cuda.is_available():
        random._get_cuda_rng_state = lambda *a, **k: None
        random._set_cuda_rng_state = lambda *a, **k: None


def _body(rank: int, world: int, parallel: ParallelConfig) -> None:
    multiple = parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1
    seqs = make_sequences(5, seed=11)
    batches = [pack(seqs[:3], multiple), pack(seqs[3:], multiple)]
    step = GRPOStep(GRPOLossConfig(), vocab_size=_moe().vocab_size)
    chunks = build_layout(parallel, _moe())
    _twin_routers(chunks)
    routes = _record(step, chunks, batches)
    _perturb_routers(chunks)
    b, rows = batches[0], batches[0].loss_mask
    live = step.compute_logprobs(chunks, [b])[0]
    assert (live - b.old_logprobs)[rows].abs().max() > 1e-3, "perturbing changed nothing"
    for mb, r in zip(batches, routes, strict=True):
        mb.routes = r
    for mb, lp in zip(batches, step.compute_logprobs(chunks, batches), strict=True):
        m = mb.loss_mask
        torch.testing.assert_close(lp[m], mb.old_logprobs[m], rtol=0, atol=1e-5)
    mismatched, total = replay_mismatch(chunks).tolist()
    shard = sum(mb.num_tokens for mb in batches) // multiple  # the router's SP shard
    assert total == shard * LAYERS and 0 < mismatched < total, (mismatched, total)
    # Training forward (old = recorded): ratio 1 everywhere; the router still learns.
    low, high = _train(chunks, step, batches)
    assert abs(low - 1) < 1e-5 and abs(high - 1) < 1e-5, (low, high)
    assert _router_grad(chunks) > 1e-6, "no gradient reached the router"
    grads = {n: p.main_grad.clone() for n, p in unwrap(chunks[0]).named_parameters()}
    # Activation recompute: the recomputed routers replay each micro-batch's ids in backward.
    _cpu_checkpointing()
    recompute = _moe(  # with the q / k norms fused into RoPE: re-run by the recompute too
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        layer_kernels=LayerKernels(qk_norm_rope="fused"),
    )  # fmt: skip
    chunks = build_layout(parallel, recompute)
    _twin_routers(chunks)
    _perturb_routers(chunks)
    low, high = _train(chunks, step, batches)
    assert abs(low - 1) < 1e-5 and abs(high - 1) < 1e-5, (low, high)
    for n, p in unwrap(chunks[0]).named_parameters():
        torch.testing.assert_close(p.main_grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)
    _trainer_replay(step, chunks, batches, routes)


def _trainer_replay(step, chunks, batches, routes) -> None:
    """The trainer's RoutingReplay over the perturbed routers: the old pass's and the update's
    mismatch fractions, and the live-routed pass's mismatch against the recorded log-probs."""
    from megatron.core import parallel_state

    replay = RoutingReplay.of(
        True, chunks, on_policy=False, log_without_replay=True, log_ratio_clamp=None,
        dp_group=parallel_state.get_data_parallel_group(),
    )  # fmt: skip
    replay.check(routes, lambda i: f"micro-batch {i}")
    with pytest.raises(
        ValueError, match="micro-batch 0: routed_experts has top-3, the model top-2"
    ):
        replay.check(
            [r[..., :1].expand(-1, -1, TOPK + 1) for r in routes], lambda i: f"micro-batch {i}"
        )
    for mb in batches:
        mb.rollout_logprobs = mb.old_logprobs  # the recorded forward's, as a rollout's
    step.compute_logprobs(chunks, batches)  # the old-log-prob pass (the batches carry routes)
    replay.after_logprob_pass(batches, step.compute_logprobs)
    with replay.scope():
        train_grads(chunks, step, batches)
    m = replay.metrics()
    assert 0 < m["moe/replay_mismatch_frac"] < 1, m
    assert 0 < m["moe/replay_mismatch_frac_update"] < 1, m
    assert m["mismatch/k3_no_replay"] > 0 and "mismatch/k1_no_replay" in m, m
    assert set(replay.metrics()) == {"moe/replay_mismatch_frac_update"}  # no old pass since


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel",
    [
        ParallelConfig(expert_model_parallel_size=2),
        ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    ],
    ids=["ep2", "tp2_sp"],
)
def test_replayed_routes_reproduce_recorded_logprobs(parallel):
    run_distributed(_body, 2, parallel)


def _write(path, routes) -> None:
    row = {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "group_id": 0, "reward": 1.0}
    rows = [row, {**row, "routed_experts": routes}]
    rows[0] = {**row, "routed_experts": [[[0, 1]] * LAYERS] * 5}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize(
    "routes, message",
    [
        ([[[0, 1, 2]] * LAYERS] * 5, "top-2"),  # top-3 ids
        ([[[0, 1]] * 3] * 5, "2 MoE layers"),  # 3 layers
        ([[[0, 9]] * LAYERS] * 5, "expert ids"),  # id 9 >= 4 experts
    ],
    ids=["topk", "layers", "expert_count"],
)
def test_file_routes_must_fit_the_model(tmp_path, routes, message):
    path = tmp_path / "r.jsonl"
    _write(path, routes)
    batch = read_rollouts(path)
    with pytest.raises(ValueError, match=message) as err:
        _check(batch)
    assert f"{path}:2" in str(err.value)
    _check(batch.select([0]))


def _check(batch) -> None:
    check_routes(batch.routed_experts, batch.origin, num_moe_layers=LAYERS, topk=TOPK,
                 num_experts=EXPERTS)  # fmt: skip


def test_file_routes_lengths(tmp_path):
    """Routes per prompt+response token (vLLM), without the final token, or per response
    token: stored as [P + R, L, k] with -1 (live routing) where the file has none."""
    path = tmp_path / "r.jsonl"
    base = {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "group_id": 0}
    rows = [{**base, "routed_experts": [[[i, 0]] * LAYERS for i in range(n)]} for n in (5, 4, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch = read_rollouts(path)
    full, no_last, response = batch.routed_experts
    assert full[:, 0, 0].tolist() == [0, 1, 2, 3, 4]
    assert no_last[:, 0, 0].tolist() == [0, 1, 2, 3, -1]
    assert response[:, 0, 0].tolist() == [-1, -1, 0, 1, 2]
    write_rollouts(batch, tmp_path / "again.jsonl")
    again = read_rollouts(tmp_path / "again.jsonl").routed_experts
    assert all(torch.equal(a, b) for a, b in zip(again, batch.routed_experts, strict=True))
    path.write_text(json.dumps({**base, "routed_experts": [[[0, 1]] * LAYERS] * 2}) + "\n")
    with pytest.raises(ValueError, match=f"{path}:1: routed_experts has 2 tokens"):
        read_rollouts(path)


def test_routing_replay_off_is_a_no_op():
    replay = RoutingReplay.of(False, [], on_policy=False, log_without_replay=True,
                              log_ratio_clamp=None, dp_group=None)  # fmt: skip
    assert isinstance(replay, NoRoutingReplay) and not replay.enabled
    replay.check(None, str)  # no routes: nothing to check
    with replay.scope():
        pass
    replay.after_logprob_pass([], lambda *a: pytest.fail("no pass without replay"))
    assert replay.metrics() == {}


@pytest.mark.parametrize("on_policy", [False, True])
def test_routing_replay_metrics(monkeypatch, on_policy):
    """The old pass's counts and the update's (the same on-policy: no old pass runs), and the
    live pass's k1 / k3 over the response tokens with finite rollout log-probs."""
    counts = iter([torch.tensor([1.0, 4.0]), torch.tensor([3.0, 8.0])])
    monkeypatch.setattr(routing_replay, "replay_mismatch", lambda model: next(counts))
    replay = RoutingReplay.of(True, ["policy"], on_policy=on_policy, log_without_replay=True,
                              log_ratio_clamp=None, dp_group=None)  # fmt: skip
    mask = torch.tensor([False, True, True, True])
    mb = PackedBatch(torch.zeros(4, dtype=torch.long), torch.arange(4), torch.zeros(4, dtype=torch.long),
                     mask, torch.tensor([0, 4], dtype=torch.int32),
                     rollout_logprobs=torch.tensor([0.0, -1.0, -2.0, float("nan")]),
                     routes=torch.zeros(4, 1, 1, dtype=torch.long))  # fmt: skip

    def live(model, batches):
        assert model == ["policy"] and all(b.routes is None for b in batches)
        return [torch.tensor([0.0, -1.5, -1.0, 0.0])]

    replay.after_logprob_pass([mb], live)
    m = replay.metrics()
    x = torch.tensor([-0.5, 1.0], dtype=torch.float64)  # live - rollout at the finite rows
    assert m["mismatch/k1_no_replay"] == pytest.approx(float((-x).mean()))
    assert m["mismatch/k3_no_replay"] == pytest.approx(float((x.exp() - 1 - x).mean()))
    update = 0.25 if on_policy else 3 / 8  # on-policy the first counts are the update's
    assert m["moe/replay_mismatch_frac_update"] == update
    assert m["moe/replay_mismatch_frac"] == (update if on_policy else 0.25)
