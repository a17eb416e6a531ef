"""The on-policy shortcut: with one optimizer step per rollout batch the old-log-prob pass is
skipped and the loss uses the update's own log-probs, detached (``old_logprobs=None``).

The loss with ``old_logprobs=None`` equals the loss with ``old_logprobs = logp`` bit for bit
(value, gradients, metrics) on every log-prob path, for token and sequence (GSPO) ratios and every
IS level; the trainer with the shortcut runs no old-log-prob pass and its update equals the
run with the pass exactly (parameters, loss and metrics, CPU); a missing ``old_logprobs`` stays
an error wherever the shortcut was not decided."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_grpo.loss import GRPOLossConfig, grpo_loss
from megatron_grpo.megatron.batch.packing import pack_sequences
from megatron_grpo.megatron.step.forward import GRPOStep
from megatron_grpo.ops import fused_grpo_loss, vocab_parallel_logprobs
from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny.yaml"

T, H, V = 40, 16, 50
CU = torch.tensor([0, 12, 25, 40])

CONFIGS = {
    "token": dict(kl_coef=0.05, entropy_coef=0.01, dual_clip_c=3.0),
    "token_is_token": dict(is_correction_level="token", is_mask=(0.05, 20.0), is_truncate=2.0),
    "token_is_sequence": dict(is_correction_level="sequence", loss_agg="seq_mean_token_mean"),
    "gspo_is_sequence_mean": dict(
        ratio_level="sequence", is_correction_level="sequence_mean", kl_coef=0.05
    ),
    "nonfinite_count_policy": dict(nonfinite="count", is_correction_level="token"),
}


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = dict(
        targets=torch.randint(0, V, (T,), generator=g),
        loss_mask=torch.rand(T, generator=g) > 0.3,
        advantages=torch.randn(T, generator=g),
        hidden=torch.randn(T, H, generator=g) * 0.3,
        weight=torch.randn(V, H, generator=g) * 0.3,
    )
    logp = vocab_parallel_logprobs(x["hidden"], x["weight"], x["targets"], impl="torch")
    # a generation engine that differs a little: IS weights around 1, some masked / truncated
    x["rollout_logprobs"] = logp + 0.3 * torch.randn(T, generator=g)
    x["ref_logprobs"] = logp + 0.5 * torch.randn(T, generator=g)
    return x


def _run(cfg: GRPOLossConfig, path: str, on_policy: bool):
    x = _inputs()
    hidden = x["hidden"].clone().requires_grad_(True)
    weight = x["weight"].clone().requires_grad_(True)
    rows = x["loss_mask"]
    with torch.no_grad():  # the old-log-prob pass: same weights, no grad
        old = vocab_parallel_logprobs(hidden, weight, x["targets"], rows=rows, impl="torch")
    loss_args = dict(
        old_logprobs=None if on_policy else old,
        advantages=x["advantages"], loss_mask=rows, cu_seqlens=CU,
        ref_logprobs=x["ref_logprobs"], rollout_logprobs=x["rollout_logprobs"],
    )  # fmt: skip
    if path == "grpo_loss":  # the public loss on the op's log-probs (the "megatron" path's seam)
        ent_needed = cfg.entropy_coef != 0
        out = vocab_parallel_logprobs(
            hidden, weight, x["targets"], rows=rows, impl="torch", return_entropy=ent_needed
        )
        logp, ent = out if ent_needed else (out, None)
        loss, metrics = grpo_loss(cfg, logprobs=logp, entropy=ent, **loss_args)
    else:
        loss, metrics, _ = fused_grpo_loss(
            hidden, weight, x["targets"], cfg, **loss_args, path=path, impl="torch"
        )
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad, metrics


def _metric_values(metrics) -> dict[str, list[float]]:
    return {k: [float(t) for t in vars(v).values()] for k, v in metrics.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("path", ["grpo_loss", "op", "fused_tiled", "fused_single_pass"])
def test_loss_without_old_logprobs_is_the_on_policy_loss_bit_for_bit(name, path):
    cfg = GRPOLossConfig(**CONFIGS[name])
    if path == "fused_single_pass" and cfg.ratio_level == "sequence":
        pytest.skip("GSPO never runs the single pass")
    if path == "fused_single_pass" and cfg.is_correction_level in ("sequence", "sequence_mean"):
        with pytest.raises(ValueError, match="on-policy.*needs every\\s+row"):
            _run(cfg, path, on_policy=True)
        return
    want = _run(cfg, path, on_policy=False)
    got = _run(cfg, path, on_policy=True)
    for a, b, what in zip(want[:3], got[:3], ("loss", "d_hidden", "d_weight"), strict=True):
        assert torch.equal(a, b), what
    assert _metric_values(got[3]) == _metric_values(want[3])
    values = _metric_values(got[3])
    assert values["loss/ratio_min"] == values["loss/ratio_max"] == [1.0]
    if cfg.is_correction_level is not None:  # the IS weights are not trivially 1
        assert values["is/weight_min"] != values["is/weight_max"]


def test_grpo_step_decides_the_on_policy_semantics_once():
    seq_is = GRPOLossConfig(is_correction_level="sequence")
    # on-policy sequence IS weights need whole sequences: the automatic fused request is tiled
    assert GRPOStep(seq_is, vocab_size=V, on_policy=True).path.request.path == "fused_tiled"
    assert GRPOStep(seq_is, vocab_size=V).path.request.path == "fused"
    assert GRPOStep(GRPOLossConfig(), vocab_size=V, on_policy=True).path.request.path == "fused"
    with pytest.raises(ValueError, match="fused_single_pass.*on-policy"):
        GRPOStep(seq_is, vocab_size=V, logprob_path="fused_single_pass", on_policy=True)


@pytest.mark.parametrize("path", ["fused", "op", "megatron"])
def test_missing_old_logprobs_is_an_error_unless_on_policy(path):
    step = GRPOStep(GRPOLossConfig(), vocab_size=V, logprob_path=path)
    batch = pack_sequences(
        [torch.tensor([1, 2, 3, 4])], [torch.tensor([False, False, True, True])], advantages=[1.0]
    )
    with pytest.raises(ValueError, match="old_logprobs is required.*on_policy=True"):
        step.loss_func(batch, None, torch.randn(4, H))  # raises before it needs the model


# ---------------------------------------------------------------- the trainer, end to end
def _trainer_body(rank: int, world: int, tmp: Path) -> None:
    from megatron_grpo.rollout.batch import RolloutBatch
    from megatron_grpo.rollout.files import write_rollouts
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import Trainer

    prompts = [[11, d, (d + 1) % 10, 10] for d in range(4) for _ in range(2)]
    responses = [[(d + 1) % 10, d, 12][: 1 + (d + i) % 3] for d in range(4) for i in range(2)]
    batch = RolloutBatch(
        prompts, responses, [d for d in range(4) for _ in range(2)],
        [[-2.5 + 0.1 * j for j in range(len(r))] for r in responses],
        [float(i % 3 == 0) for i in range(8)],
    )  # fmt: skip
    write_rollouts(batch, tmp / "rollouts" / "r.jsonl")

    def run(name: str, extra: list[str]):
        overrides = [
            "parallel.tensor_model_parallel_size=1",
            "rollout.num_prompts=2",
            "rollout.group_size=2",
            "training.steps=2",
            "training.mini_batches_per_step=1",
            "training.micro_batch_size=2",  # 2 micro-batches per update
            "loss.kl_coef=0.1",  # the reference pass stays
            "optimizer.optimizer=sgd",  # an exact function of the gradient
            f"rollout.input_path={tmp / 'rollouts'}",
            f"logging.dir={tmp / name}",
            "logging.progress_bar=false",
            "checkpoint.dir=null",
            # the update's own micro-batches: the exact-equality premise (merged passes: below)
            "training.logprob_max_tokens_per_micro_batch=null",
            *extra,
        ]
        trainer = Trainer(load_train_config(RECIPE, overrides))
        calls = []
        compute = trainer.step_fn.compute_logprobs

        def counted(model, batches, *args, **kwargs):
            calls.append("old" if model is trainer.model else "ref")
            return compute(model, batches, *args, **kwargs)

        trainer.step_fn.compute_logprobs = counted
        start = [p.detach().clone() for p in trainer.model[0].parameters()]
        history = trainer.train()
        params = [p.detach().clone() for p in trainer.model[0].parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(start, params, strict=True))
        return history, calls, params

    for loss in (
        ["loss.is_correction_level=token"],
        # GSPO on Megatron's standard log-prob path (forward.py's other loss call)
        [
            "lm_head.path=megatron",
            "loss.ratio_level=sequence",
            "loss.is_correction_level=sequence_mean",
        ],
    ):
        tag = loss[-1].split("=")[1]
        want, want_calls, want_params = run(
            f"pass_{tag}", [*loss, "training.on_policy_shortcut=false"]
        )
        got, got_calls, got_params = run(f"shortcut_{tag}", loss)
        if tag == "token":
            first, first_params = want, want_params
        assert want_calls == ["old", "ref"] * 2 and got_calls == ["ref"] * 2, (
            want_calls,
            got_calls,
        )
        assert [m["perf/old_logprob_pass_skipped"] for m in want] == [0.0, 0.0]
        assert [m["perf/old_logprob_pass_skipped"] for m in got] == [1.0, 1.0]
        for a, b in zip(want_params, got_params, strict=True):
            assert torch.equal(a, b)
        for m_want, m_got in zip(want, got, strict=True):
            keys = {k for k in m_want if not k.startswith("perf/")}
            assert keys == {k for k in m_got if not k.startswith("perf/")}
            for key in keys:  # loss, grad norm, IS weights, mismatch, KL: all exactly equal
                assert m_got[key] == m_want[key], (tag, key, m_want[key], m_got[key])
            assert m_got["loss/ratio_min"] == m_got["loss/ratio_max"] == 1.0
            assert m_got["optim/grad_norm"] > 0 and m_got["is/weight_min"] < m_got["is/weight_max"]
        assert got[0]["loss/kl_mean"] == 0.0 < got[1]["loss/kl_mean"]  # the reference pass ran

    # the no-grad passes over merged micro-batches: the same log-probs, so the same run
    merged, calls, merged_params = run(
        "merged",
        ["loss.is_correction_level=token", "training.on_policy_shortcut=false",
         "training.logprob_max_tokens_per_micro_batch=4096"],
    )  # fmt: skip
    assert calls == ["old", "ref"] * 2
    for a, b in zip(first_params, merged_params, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    for m_want, m_got in zip(first, merged, strict=True):
        for key in ("loss/loss", "loss/kl_mean", "optim/grad_norm", "is/weight_mean"):
            assert m_got[key] == pytest.approx(m_want[key], rel=1e-5, abs=1e-7), key

    # two optimizer steps per rollout batch: the second is off-policy, the pass always runs
    two, calls, _ = run("two_mini_batches", ["training.mini_batches_per_step=2"])
    assert calls == ["old", "ref"] * 2
    assert [m["perf/old_logprob_pass_skipped"] for m in two] == [0.0, 0.0]


def test_trainer_skips_the_old_logprob_pass_with_the_same_update(tmp_path):
    run_distributed(_trainer_body, 1, tmp_path)
