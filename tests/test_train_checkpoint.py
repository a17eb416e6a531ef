"""Checkpoints: --resume replays an uninterrupted run exactly; an interrupted save never damages
the previous checkpoint. Two gloo ranks, TP=2, the tiny recipe shrunk to seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"
SMALL = [
    "rollout.num_prompts=4",
    "rollout.group_size=4",
    "training.micro_batch_size=4",
    "logging.progress_bar=false",
]


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(tmp: Path, name: str, steps: int, extra: list[str], resume: bool = False):
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import Trainer

    overrides = SMALL + [
        f"training.steps={steps}",
        f"logging.dir={tmp / name}",
        *extra,
    ]
    trainer = Trainer(load_train_config(RECIPE, overrides), resume=resume)
    trainer.train()
    return trainer


def _resume_body(rank: int, world: int, tmp: Path, dist_opt: bool) -> None:
    from megatron_grpo.train import checkpoint as ckpt

    opt = [f"optimizer.use_distributed_optimizer={str(dist_opt).lower()}"]
    ck = tmp / "ckpt"
    _run(tmp, "full", 4, ["checkpoint.dir=null", *opt])
    _run(tmp, "part", 2, [f"checkpoint.dir={ck}", "checkpoint.save_interval=1", *opt])
    assert ckpt.latest_checkpoint(ck).name == "step_00000002"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000001", "step_00000002"]
    resumed = _run(tmp, "part", 4, [f"checkpoint.dir={ck}", *opt], resume=True)
    assert resumed.start_step == 2
    if rank == 0:
        full, part = (
            _metrics(tmp / "full" / "metrics.jsonl"),
            _metrics(tmp / "part" / "metrics.jsonl"),
        )
        assert [m["step"] for m in part] == [1, 2, 3, 4]
        for a, b in zip(full, part, strict=True):
            a.pop("perf/step_seconds"), b.pop("perf/step_seconds")
            a.pop("perf/tokens_per_s"), b.pop("perf/tokens_per_s")
            assert a == b, (a, b)
    _interrupted_save(resumed, ck)


def _interrupted_save(trainer, ck: Path) -> None:
    """Crash between writing step 6 and switching the pointer: step 4 stays intact."""
    import torch

    from megatron_grpo.megatron.model import unwrap
    from megatron_grpo.train import checkpoint as ckpt

    before = {
        k: v.clone()
        for k, v in unwrap(trainer.model[0]).state_dict().items()
        if v is not None and torch.is_tensor(v)
    }
    state = {"world_size": 2}
    tmp = ckpt.write_checkpoint(ck, 6, trainer.model, trainer.optimizer, trainer.scheduler, state)
    assert tmp.is_dir() and ckpt.latest_checkpoint(ck).name == "step_00000004"
    with torch.no_grad():
        for p in trainer.model[0].parameters():
            p.add_(1.0)
    loaded = ckpt.load_checkpoint(
        ckpt.latest_checkpoint(ck), trainer.model, trainer.optimizer, trainer.scheduler
    )
    assert loaded["step"] == 4
    after = unwrap(trainer.model[0]).state_dict()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0)
    ckpt.save_checkpoint(ck, 6, trainer.model, trainer.optimizer, trainer.scheduler, state, 2)
    assert ckpt.latest_checkpoint(ck).name == "step_00000006"
    assert not list(ck.glob(".tmp_*"))
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000004", "step_00000006"]


_DIST_OPT_XFAIL = pytest.mark.xfail(
    strict=True,
    reason="known gap: DistributedOptimizer (torch-Adam fallback, no Apex/TE) resumes and "
    "reproduces the rollout exactly, but the first update after resume differs slightly",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "dist_opt",
    [False, pytest.param(True, marks=_DIST_OPT_XFAIL)],
    ids=["fp32_optimizer", "distributed_optimizer"],
)
def test_resume_equals_uninterrupted_and_interrupted_save_is_harmless(tmp_path, dist_opt):
    run_distributed(_resume_body, 2, tmp_path, dist_opt)
