"""Checkpoints: --resume replays an uninterrupted run exactly (with either optimizer); an
interrupted save never damages the previous checkpoint; a step directory carries its
model_config.yaml, so it works as ``checkpoint.load`` without a model section and as the input of
``mcore-to-hf``. Two gloo ranks, TP=2, the tiny recipe shrunk to seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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


def _run(
    tmp: Path,
    name: str,
    steps: int,
    extra: list[str],
    resume: bool = False,
    recipe: Path = RECIPE,
    train: bool = True,
):
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import Trainer

    overrides = SMALL + [
        f"training.steps={steps}",
        f"logging.dir={tmp / name}",
        *extra,
    ]
    trainer = Trainer(load_train_config(recipe, overrides), resume=resume)
    if train:
        trainer.train()
    return trainer


def _adam_steps(optimizer) -> list:
    """The per-parameter ``step`` tensors of torch's Adam under Megatron's optimizer(s) (empty
    for Apex/TE fused Adam, which keeps the step in the param group)."""
    leaves = getattr(optimizer, "chained_optimizers", [optimizer])
    return [s["step"] for o in leaves for s in o.optimizer.state.values() if "step" in s]


def _resume_body(rank: int, world: int, tmp: Path, dist_opt: bool) -> None:
    from megatron_grpo.train import checkpoint as ckpt

    # The DistributedOptimizer case runs at TP=1, DP=2: each rank holds half the Adam state.
    opt = [f"optimizer.use_distributed_optimizer={str(dist_opt).lower()}"]
    if dist_opt:
        opt.append("parallel.tensor_model_parallel_size=1")
    ck = tmp / "ckpt"
    _run(tmp, "full", 4, ["checkpoint.dir=null", *opt])
    _run(tmp, "part", 2, [f"checkpoint.dir={ck}", "checkpoint.save_interval=1", *opt])
    assert ckpt.latest_checkpoint(ck).name == "step_00000002"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000001", "step_00000002"]
    resumed = _run(tmp, "part", 4, [f"checkpoint.dir={ck}", *opt], resume=True)
    assert resumed.start_step == 2
    # 4 steps x 2 mini-batches; one tensor per parameter (a shared one counts n_params per step)
    steps = _adam_steps(resumed.optimizer)
    assert [float(t) for t in steps] == [8.0] * len(steps)
    assert len({id(t) for t in steps}) == len(steps)
    if rank == 0:
        full, part = (
            _metrics(tmp / "full" / "metrics.jsonl"),
            _metrics(tmp / "part" / "metrics.jsonl"),
        )
        assert [m["step"] for m in part] == [1, 2, 3, 4]
        for a, b in zip(full, part, strict=True):
            timeless = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in (a, b)]
            assert timeless[0] == timeless[1], (a, b)
    _interrupted_save(resumed, ck)


def _interrupted_save(trainer, ck: Path) -> None:
    """Crash between writing step 6 and switching the pointer: step 4 stays intact."""
    import torch

    from megatron_grpo.config import to_dict
    from megatron_grpo.convert import MODEL_CONFIG_NAME, read_model_config
    from megatron_grpo.megatron.model.build import unwrap
    from megatron_grpo.train import checkpoint as ckpt

    before = {
        k: v.clone()
        for k, v in unwrap(trainer.model[0]).state_dict().items()
        if v is not None and torch.is_tensor(v)
    }
    with pytest.raises(ValueError, match="model section"):
        ckpt.write_checkpoint(ck, 6, trainer.model, trainer.optimizer, None, {"world_size": 2})
    state = {"world_size": 2, "config": to_dict(trainer.cfg)}
    tmp = ckpt.write_checkpoint(ck, 6, trainer.model, trainer.optimizer, trainer.scheduler, state)
    assert tmp.is_dir() and ckpt.latest_checkpoint(ck).name == "step_00000004"
    assert read_model_config(tmp / MODEL_CONFIG_NAME) == trainer.cfg.model
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "dist_opt",
    [False, True],
    ids=["fp32_optimizer", "distributed_optimizer"],
)
def test_resume_equals_uninterrupted_and_interrupted_save_is_harmless(tmp_path, dist_opt):
    run_distributed(_resume_body, 2, tmp_path, dist_opt)


def _model_files_body(rank: int, world: int, tmp: Path) -> None:
    """A trains 1 step (a Llama-family model) -> a_ckpt/step_1 with model_config.yaml, to which
    an hf/config.json is added (as the converter would have). B starts from it with a recipe
    without a model section, gets A's model config and weights, trains 1 step, and its step_1
    carries model_config.yaml and hf/. B's trained weights go to tmp for the export check."""
    import json

    import torch
    import torch.distributed as dist

    from megatron_grpo.convert import MODEL_CONFIG_NAME, read_model_config
    from megatron_grpo.convert.families import FAMILIES
    from megatron_grpo.convert.hf_config import hf_config_from_model
    from megatron_grpo.megatron.model.build import unwrap

    a = _run(
        tmp, "a", 1, [f"checkpoint.dir={tmp / 'a_ckpt'}", "model.position_embedding_type=rope"]
    )
    a_step = tmp / "a_ckpt" / "step_00000001"
    assert read_model_config(a_step / MODEL_CONFIG_NAME) == a.cfg.model
    if rank == 0:
        (a_step / "hf").mkdir()
        hf_cfg = hf_config_from_model(a.cfg.model, FAMILIES["llama"])
        (a_step / "hf" / "config.json").write_text(json.dumps(hf_cfg))
    dist.barrier()
    b_args = [f"checkpoint.dir={tmp / 'b_ckpt'}", f"checkpoint.load={a_step}"]
    b = _run(tmp, "b", 1, b_args, recipe=tmp / "no_model.yaml", train=False)
    assert b.cfg.model == a.cfg.model
    a_sd, b_sd = unwrap(a.model[0]).state_dict(), unwrap(b.model[0]).state_dict()
    ref_sd = unwrap(b.ref_model[0]).state_dict()
    for k, v in a_sd.items():
        if torch.is_tensor(v):
            torch.testing.assert_close(b_sd[k], v, rtol=0, atol=0)
            torch.testing.assert_close(ref_sd[k], v, rtol=0, atol=0)
    b.train()
    b_step = tmp / "b_ckpt" / "step_00000001"
    assert read_model_config(b_step / MODEL_CONFIG_NAME) == a.cfg.model
    assert (b_step / "hf" / "config.json").read_text() == (
        a_step / "hf" / "config.json"
    ).read_text()
    weights = {
        k: v.clone() for k, v in unwrap(b.model[0]).state_dict().items() if torch.is_tensor(v)
    }
    torch.save(weights, tmp / f"b_weights_rank{rank}.pt")


@pytest.mark.slow
def test_trainer_checkpoint_carries_model_config(tmp_path):
    import torch
    import yaml
    from safetensors.torch import load_file

    from megatron_grpo.convert import mcore_to_hf

    recipe = yaml.safe_load(RECIPE.read_text())
    del recipe["model"]
    (tmp_path / "no_model.yaml").write_text(yaml.safe_dump(recipe))
    run_distributed(_model_files_body, 2, tmp_path)

    # `mcore-to-hf --ckpt step_N` with no other flags: model_config.yaml + hf/ come with it.
    out = mcore_to_hf(tmp_path / "b_ckpt" / "step_00000001", tmp_path / "hf_out")
    hf = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    shards = [torch.load(tmp_path / f"b_weights_rank{r}.pt") for r in range(2)]
    vocab = 13  # TP-sharded rows, padded 13 -> 16
    for mcore, name in [
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        ("output_layer.weight", "lm_head.weight"),
    ]:
        full = torch.cat([s[mcore] for s in shards])[:vocab]
        torch.testing.assert_close(hf[name], full, rtol=0, atol=0)
    norm = shards[0]["decoder.final_layernorm.weight"]
    torch.testing.assert_close(hf["model.norm.weight"], norm, rtol=0, atol=0)


def _saved_layout(tmp_path: Path, **parallel) -> Path:
    """A directory whose common.pt holds a trainer config with ``parallel`` (what
    check_resume_layout reads; no tensors needed)."""
    from megatron_grpo.config import to_dict
    from megatron_grpo.megatron.config import ParallelConfig

    config = {"parallel": to_dict(ParallelConfig(**parallel))}
    torch.save({"trainer_state": {"config": config}}, tmp_path / "common.pt")
    (tmp_path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    return tmp_path


def test_resume_refuses_another_model_parallel_layout_naming_both(tmp_path):
    from megatron_grpo.config import ConfigError
    from megatron_grpo.megatron.config import ParallelConfig
    from megatron_grpo.train.checkpoint import check_resume_layout

    saved = _saved_layout(tmp_path, tensor_model_parallel_size=2)
    check_resume_layout(saved, ParallelConfig(tensor_model_parallel_size=2))  # the same: fine
    with pytest.raises(ConfigError) as e:
        check_resume_layout(saved, ParallelConfig(tensor_model_parallel_size=1))
    assert str(e.value) == (
        f"--resume: {saved} was saved with parallel tensor_model_parallel_size=2; this run has "
        "tensor_model_parallel_size=1. Resume with the saved layout "
        "(--set parallel.tensor_model_parallel_size=2)"
    )


def _finished_resume_body(rank: int, world: int, tmp: Path) -> None:
    ck = [f"checkpoint.dir={tmp / 'ckpt'}", "parallel.tensor_model_parallel_size=1"]
    _run(tmp, "run", 1, ck)
    config = tmp / "run" / "config.yaml"
    before = config.read_text()
    # a no-op resume (the run is finished) with another setting: config.yaml stays the run's
    resumed = _run(tmp, "run", 1, [*ck, "optimizer.lr=0.5"], resume=True)
    assert resumed.start_step == 1 and config.read_text() == before
    _run(tmp, "run", 2, [*ck, "optimizer.lr=0.5"], resume=True)  # steps left: the new config
    assert "lr: 0.5" in config.read_text()


@pytest.mark.slow
def test_a_resume_of_a_finished_run_keeps_its_config(tmp_path):
    run_distributed(_finished_resume_body, 1, tmp_path)
