"""MoE with expert parallelism across DP ranks: equal micro-batch counts and token counts over the
expert group (batching helpers), and the trainer end to end under torchrun (EP = 2, allgather
dispatcher on CPU), where the sampler's decode loop must keep finished ranks in step."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_grpo.megatron.batch.packing import pack_sequences, padded_layout
from megatron_grpo.train.batching import pad_micro_batch, split_to_count

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny.yaml"
MOE = [
    "parallel.tensor_model_parallel_size=1",
    "parallel.expert_model_parallel_size=2",
    "model.num_moe_experts=4",
    "model.moe_router_topk=2",
    "model.moe_ffn_hidden_size=128",
    "training.steps=3",
    "checkpoint.dir=null",
]


def test_split_to_count_halves_the_largest_and_keeps_order():
    groups = split_to_count([[0, 1, 2, 3], [4], [5, 6]], 5)
    assert groups == [[0], [1], [2, 3], [4], [5, 6]]
    assert split_to_count([[0, 1]], 1) == [[0, 1]]
    with pytest.raises(ValueError, match="cannot split"):
        split_to_count([[0], [1]], 3)


def _packed(multiple: int = 1):
    seqs = [torch.tensor([3, 4, 5, 6]), torch.tensor([7, 8, 9])]
    masks = [torch.tensor([False, False, True, True]), torch.tensor([False, True, True])]
    logp = [torch.tensor([0.0, 0.0, -1.0, -2.0]), torch.tensor([0.0, -3.0, -4.0])]
    return pack_sequences(
        seqs, masks, advantages=[1.0, -1.0], rollout_logprobs=logp, pad_to_multiple_of=multiple
    )


def test_pad_micro_batch_appends_masked_documents_only():
    mb = _packed()
    out = pad_micro_batch(mb, 9)
    out.validate(vocab_size=16)
    assert out.num_tokens == mb.num_tokens + 9
    # padding documents no longer than the longest real one (4): 4 + 4 + 1
    assert out.cu_seqlens.tolist() == [0, 4, 7, 11, 15, 16]
    assert int(out.position_ids[mb.num_tokens :].max()) < 4
    assert not out.loss_mask[mb.num_tokens :].any()
    for name in ("tokens", "position_ids", "targets", "loss_mask", "advantages"):
        assert torch.equal(getattr(out, name)[: mb.num_tokens], getattr(mb, name)), name
    assert torch.equal(out.rollout_logprobs[: mb.num_tokens], mb.rollout_logprobs)
    assert float(out.advantages[mb.num_tokens :].abs().sum()) == 0.0
    assert pad_micro_batch(mb, 0) is mb
    with pytest.raises(ValueError, match="multiple of 4"):
        pad_micro_batch(mb, 6, step=4)


def test_pad_micro_batch_keeps_context_parallel_layout_exact():
    """Under CP the padding documents are multiples of 2 * CP * multiple, so the padded layout
    grows by exactly the requested amount (equal local lengths on every CP rank)."""
    mb = _packed(multiple=2)
    step = 2 * 2 * 2
    before = int(padded_layout(mb, 2, 2)[0][-1])
    out = pad_micro_batch(mb, 3 * step, step)
    assert int(padded_layout(out, 2, 2)[0][-1]) == before + 3 * step


def _train(tmp: Path, extra: list[str], timeout: float = 300) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["-m", "megatron_grpo.train", "--config", str(RECIPE)]
    for o in [*MOE, f"logging.dir={tmp}", "logging.progress_bar=false", *extra]:
        cmd += ["--set", o]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        [],
        # token-budget packing (micro-batch counts differ per rank before equalizing) and the
        # router's aux loss active in the training forwards
        [
            "training.micro_batch_size=null",
            "training.max_tokens_per_micro_batch=150",
            "model.moe_aux_loss_coeff=0.01",
            "rollout.engine.kind=recompute",
        ],
        # routing replay of the KV-cached engine's own routes, and the live-routing twin pass
        ["model.moe_enable_routing_replay=true", "training.log_mismatch_without_replay=true"],
    ],
    ids=["contract_command", "token_budget_aux_loss", "routing_replay"],
)
def test_moe_expert_parallel_training_runs(tmp_path, extra):
    metrics = _train(tmp_path, extra)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert math.isfinite(m["loss/loss"]) and math.isfinite(m["optim/grad_norm"]), m
        assert m["optim/skipped_steps"] == 0.0
        # The recorded log-probs equal the training pass's old log-probs: padding and dummy
        # forwards do not leak into the real tokens. The recompute engine runs the training
        # pass's packed forward, so routing agrees exactly; KV-cached decode rounds
        # differently (other GEMM shapes), which can flip a near-tied top-k choice of a token
        # (the generator/trainer routing mismatch that routing replay removes: exact again).
        replay = "model.moe_enable_routing_replay=true" in extra
        bound = 1e-5 if "rollout.engine.kind=recompute" in extra or replay else 2e-3
        assert abs(m["mismatch/k1"]) < bound, m
        if replay:  # the generation's routes reached the trainer; the live-routed pass ran
            assert 0 <= m["moe/replay_mismatch_frac"] < 0.05, m
            assert m["mismatch/k3_no_replay"] >= 0 and "mismatch/k1_no_replay" in m, m
    assert metrics[-1]["optim/grad_norm"] > 0.0
    aux = [m.get("moe/load_balancing_loss") for m in metrics]
    if "model.moe_aux_loss_coeff=0.01" in extra:
        # Switch-style aux loss E * sum_e f_e P_e: 1 when balanced, E / topk = 2 at worst
        assert all(a is not None and 0.9 < a <= 2.0 + 1e-6 for a in aux), aux
    else:  # coefficient 0: the router computes no aux loss, so none is reported
        assert aux == [None] * 3


def test_mismatch_without_replay_needs_replay():
    from megatron_grpo.train.config import TrainConfig, TrainingConfig

    with pytest.raises(ValueError, match="log_mismatch_without_replay needs model.moe_enable"):
        TrainConfig(training=TrainingConfig(log_mismatch_without_replay=True))


def test_tracked_losses_follow_the_router_config():
    from megatron_grpo.megatron.config import (
        ModelConfig,
        ParallelConfig,
        to_transformer_config,
    )
    from megatron_grpo.megatron.moe.metrics import tracked_losses

    def names(**kw):
        model = ModelConfig(vocab_size=16, num_moe_experts=4, **kw)
        return tracked_losses(to_transformer_config(model, ParallelConfig()))

    assert names() == []  # coefficient 0: the router computes nothing
    assert names(moe_aux_loss_coeff=0.01) == ["load_balancing_loss"]
    assert names(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01) == [
        "seq_load_balancing_loss"
    ]
    assert names(moe_z_loss_coeff=0.001) == ["z_loss"]
    dense = to_transformer_config(ModelConfig(vocab_size=16), ParallelConfig())
    assert tracked_losses(dense) == []


@pytest.mark.slow
def test_grouped_experts_train_like_sequential_mlp(tmp_path):
    """The MoE twin's first steps (tiny shapes, DP 2 at EP 1: the local dispatch) give the same
    rewards, losses and gradient norms with grouped experts as with megatron-core's
    SequentialMLP (fp32 on CPU: the same tokens are sampled)."""
    base = ["parallel.expert_model_parallel_size=1", "training.steps=2"]
    grouped = _train(tmp_path / "grouped", base)
    looped = _train(tmp_path / "sequential", [*base, "model.moe_grouped_gemm=false"])
    for a, b in zip(grouped, looped, strict=True):
        assert a["reward/mean"] == b["reward/mean"], (a, b)
        for key in ("loss/loss", "optim/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a[key], b[key])


# The gathered dispatch in every forward at DP 2 (TP 1, EP 2): documents of 2-4 digits, so the
# ranks' micro-batches differ in tokens; its all-gather takes equal shares, so the trainer pads
# each rank's i-th micro-batch to the group's longest (before: the ranks hung in the first update)
GATHERED_DP2 = [
    "model.moe_token_dispatcher_type=alltoall",
    "model.layer_kernels.moe_dispatch=gathered",
    "training.micro_batch_size=null",
    "training.max_tokens_per_micro_batch=150",
    "rollout.reverse_digits.num_digits=[1, 3]",
]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_gpu_gathered_dispatch_trains_at_dp2(tmp_path):
    """2 GPUs: megatron-core's all-to-all dispatcher configured, the gathered dispatch chosen
    for every forward, ranks with different micro-batch token counts: three finite steps."""
    metrics = _train(tmp_path, GATHERED_DP2, timeout=150)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(math.isfinite(m["loss/loss"]) for m in metrics), metrics


def _gathered_body(rank: int, world: int, tmp: Path) -> None:
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import Trainer
    from tests.ep_utils import cpu_alltoall

    cpu_alltoall()  # megatron-core's all-to-all dispatcher configured, as on GPU
    sets = [*MOE, *GATHERED_DP2, f"logging.dir={tmp}", "training.steps=2"]
    Trainer(load_train_config(RECIPE, sets)).train()


def test_gathered_dispatch_trains_at_dp2_with_the_alltoall_dispatcher_configured(tmp_path):
    """CPU (gloo, 2 ranks) of the GPU test above: the ranks' micro-batches differ in tokens and
    the gathered dispatch's all-gather takes equal shares, so the trainer pads them (before,
    the first update failed or hung)."""
    from tests.dist_utils import run_distributed

    run_distributed(_gathered_body, 2, tmp_path, timeout=240)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(math.isfinite(m["loss/loss"]) for m in metrics), metrics


def _tp2_sp_body(rank: int, world: int, tmp: Path) -> None:
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import Trainer
    from tests.ep_utils import cpu_alltoall

    cpu_alltoall()
    sets = [*MOE, *TP2_SP_EP2, f"logging.dir={tmp}", "training.steps=2"]
    cfg = load_train_config(RECIPE, sets)
    assert cfg.logprob_merge_tokens == 32768 and not cfg.moe_forwards_need_equal_tokens("alltoall")
    trainer = Trainer(cfg)
    assert trainer._moe_groups()[1] is None  # no token padding over the expert group
    step, merged = trainer.step_fn, []
    original = step.compute_logprobs

    def counted(model, batches, max_tokens=None, count_group=None):
        merged.append((len(batches), max_tokens))
        return original(model, batches, max_tokens, count_group)

    step.compute_logprobs = counted
    trainer.train()
    assert merged and all(n > 1 and m == 32768 for n, m in merged), merged


TP2_SP_EP2 = [
    "parallel.tensor_model_parallel_size=2",
    "parallel.sequence_parallel=true",
    "parallel.expert_tensor_parallel_size=1",
    "model.moe_token_dispatcher_type=alltoall",
    "model.layer_kernels.moe_dispatch=gathered",
    "training.micro_batch_size=null",
    "training.max_tokens_per_micro_batch=60",
    "rollout.engine.kind=recompute",
]


def test_gathered_dispatch_trains_at_tp2_sp_ep2_with_merged_logprob_passes(tmp_path):
    """CPU (gloo, 2 ranks): the MoE recipes' layout (TP 2 + SP, EP 2 inside the TP group) with
    the gathered dispatch in every forward: the ranks share micro-batches, so the old and the
    reference log-prob passes merge them (before, "auto" fell back to the update's micro-batches
    and an explicit size was a config error) and the rollout's log-probs, from the recompute
    engine's packed forward, equal the merged pass's."""
    from tests.dist_utils import run_distributed

    run_distributed(_tp2_sp_body, 2, tmp_path, timeout=240)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert math.isfinite(m["loss/loss"]) and abs(m["mismatch/k1"]) < 1e-5, m


def _shares_body(rank: int, world: int) -> None:
    """megatron-core's own groups at 4 ranks against ``expert_group_shares_batches``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_grpo.megatron import destroy_parallel, initialize_parallel
    from megatron_grpo.train.config import load_train_config

    for tp, ep, sp in ((2, 2, True), (4, 2, True), (4, 4, True), (2, 4, True), (1, 2, False)):
        sets = [*MOE, f"parallel.tensor_model_parallel_size={tp}",
                f"parallel.expert_model_parallel_size={ep}", f"parallel.sequence_parallel={sp}",
                "parallel.expert_tensor_parallel_size=1"]  # fmt: skip
        cfg = load_train_config(RECIPE, sets)
        initialize_parallel(cfg.parallel, seed=0)
        ranks = [set(dist.get_process_group_ranks(g)) for g in (
            ps.get_expert_model_parallel_group(), ps.get_tensor_model_parallel_group())]  # fmt: skip
        assert cfg.expert_group_shares_batches() == (ranks[0] <= ranks[1]), (tp, ep, ranks)
        destroy_parallel()


def test_expert_group_shares_batches_matches_megatron_cores_groups():
    """The rule (expert-TP 1, EP dividing TP) against the process groups megatron-core builds
    at 4 gloo ranks: EP 2 in TP 2 (x DP 2) and in TP 4, EP 4 in TP 4 share; EP 4 over TP 2 and
    EP 2 over TP 1 do not."""
    from tests.dist_utils import run_distributed

    run_distributed(_shares_body, 4, timeout=240)
