"""``rollout.placement: separate`` on CPU (gloo): trainer and generation processes of one world.

``max_staleness: 0`` trains on exactly the colocated run's rollouts, losses and weights (the
generator replica has the trainer's TP, so its forward is the trainer's bit for bit); with
``max_staleness: 1`` every trained token lags exactly min(step, 1) versions; a resume in the
middle of in-flight rollouts equals the uninterrupted run; a resume under a smaller
``max_staleness`` drops (and counts) the saved groups that lag more; config errors name the
field."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny.yaml"
LOSS_KEYS = (
    "loss/loss",
    "loss/ratio_mean",
    "reward/mean",
    "response/length_mean",
    "optim/grad_norm",
)


def _overrides(tmp: Path, name: str, *extra: str) -> list[str]:
    return [
        "parallel.tensor_model_parallel_size=1",
        "rollout.num_prompts=4",
        "rollout.group_size=4",
        "training.micro_batch_size=8",
        "training.use_reference_model=false",
        "loss.is_correction_level=token",
        "logging.progress_bar=false",
        f"logging.dir={tmp / name}",
        f"rollout.output_dir={tmp / name / 'rollouts'}",
        f"checkpoint.dir={tmp / name / 'ckpt'}",
        "checkpoint.save_interval=0",
        *extra,
    ]


def _run(tmp: Path, name: str, *extra: str, resume: bool = False) -> list[dict] | None:
    """One run on this rank: None on a generation rank; the trainer's metrics otherwise (and
    its final weights in ``tmp/name/weights.pt`` from rank 0)."""
    import torch.distributed as dist

    from megatron_grpo.megatron import unwrap
    from megatron_grpo.rollout.separate.launch import run_generation_rank
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import Trainer

    cfg = load_train_config(RECIPE, _overrides(tmp, name, *extra))
    if (end := run_generation_rank(cfg)) is not None:
        assert end == "finished", end
        return None
    trainer = Trainer(cfg, resume=resume, overwrite=not resume)
    history = trainer.train()
    if dist.get_rank() == 0:
        weights = {k: p.detach().clone() for k, p in unwrap(trainer.model[0]).named_parameters()}
        torch.save(weights, tmp / name / "weights.pt")
    return history


SEPARATE = ("rollout.placement=separate", "rollout.separate.generation_ranks=1")


def _colocated(rank: int, world: int, tmp: Path, steps: int, *extra: str) -> None:
    _run(tmp, "colocated", f"training.steps={steps}", *extra)


def _separate(rank: int, world: int, tmp: Path, name: str, steps: int, *extra: str) -> None:
    _run(tmp, name, f"training.steps={steps}", *SEPARATE[:1], *extra)


def _side_by_side(*runs: tuple) -> None:
    """``run_distributed(*run)`` for each of ``runs`` at once: independent runs (each its own
    run directory and port) whose processes share the cores (a colocated run and a separate
    one each keep about one core busy)."""
    with ThreadPoolExecutor(len(runs)) as pool:
        for future in [pool.submit(run_distributed, *run) for run in runs]:
            future.result()


def _rollouts(tmp: Path, name: str) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((tmp / name / "rollouts").iterdir())}


def _metrics(tmp: Path, name: str) -> list[dict]:
    lines = (tmp / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _weights_equal(tmp_a: Path, tmp_b: Path, a: str, b: str) -> None:
    wa, wb = torch.load(tmp_a / a / "weights.pt"), torch.load(tmp_b / b / "weights.pt")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def colocated_run(tmp_path_factory) -> Path:
    """The colocated 3-step run both replica counts are compared with (run once)."""
    tmp = tmp_path_factory.mktemp("colocated")
    run_distributed(_colocated, 1, tmp, 3)
    return tmp


@pytest.mark.parametrize("replicas", [1, 2])
def test_staleness_0_separate_is_the_colocated_run(tmp_path, colocated_run, replicas):
    """One replica generates each step's rollouts in the colocated run's engine call; two
    generate half of its prompt groups each (``separate/parts.py``) from the same uniforms."""
    gen = (f"rollout.separate.generation_ranks={replicas}", "rollout.separate.max_staleness=0")
    run_distributed(_separate, 1 + replicas, tmp_path, "sep0", 3, *gen)
    assert _rollouts(colocated_run, "colocated") == _rollouts(tmp_path, "sep0")
    colocated = _metrics(colocated_run, "colocated")
    for a, b in zip(colocated, _metrics(tmp_path, "sep0"), strict=True):
        for key in LOSS_KEYS:
            assert a[key] == b[key], key
        assert b["rollout/policy_lag_max"] == 0.0 and b["rollout/stale_dropped_groups"] == 0.0
        assert b["rollout/weight_sync_gib"] > 0
        # the generators' rate over their own time (the trainer's rollout stage is its wait)
        made = a["perf/generation_tokens_per_s"] * a["perf/rollout_seconds"]
        rate = b["perf/generation_tokens_per_s"]
        assert rate * b["perf/generation_seconds"] == pytest.approx(made, rel=1e-6)
    _weights_equal(colocated_run, tmp_path, "colocated", "sep0")


FILTER = ("rollout.filter_groups.enabled=true", "rollout.filter_groups.max_extra_rounds=2")
FILTER_KEYS = (
    "rollout/filter_rounds", "rollout/groups_generated", "rollout/groups_kept",
    "rollout/groups_filled", "rollout/generated_tokens", "rollout/reward_mean_generated",
)  # fmt: skip


def test_dynamic_sampling_on_the_generators_is_the_colocated_filter(tmp_path):
    """``rollout.filter_groups`` with separate placement: the generation replica filters its
    units (extra rounds of fresh prompts) exactly as the colocated run filters its batch; the
    trainer reports the same counts."""
    mixed = (*FILTER, "rollout.filter_groups.reward_tolerance=0.5")
    gen = ("rollout.separate.generation_ranks=1", "rollout.separate.max_staleness=0")
    _side_by_side(
        (_colocated, 1, tmp_path, 3, *mixed), (_separate, 2, tmp_path, "sepf", 3, *gen, *mixed)
    )
    assert _rollouts(tmp_path, "colocated") == _rollouts(tmp_path, "sepf")
    colocated, separate = _metrics(tmp_path, "colocated"), _metrics(tmp_path, "sepf")
    assert max(m["rollout/filter_rounds"] for m in colocated) > 1  # the filter did filter
    for a, b in zip(colocated, separate, strict=True):
        for key in (*LOSS_KEYS, *FILTER_KEYS):
            assert a[key] == b[key], key


def test_dynamic_sampling_counts_add_up_over_replicas(tmp_path):
    """Two replicas filter one half of a unit each; the trainer's counts are their sums: with
    every group zero-variance (tolerance 1), each part runs 1 + max_extra_rounds rounds and
    zero-variance groups fill the whole batch."""
    gen = ("rollout.separate.generation_ranks=2", "rollout.separate.max_staleness=1")
    every = (*FILTER, "rollout.filter_groups.reward_tolerance=1.0")
    run_distributed(_separate, 3, tmp_path, "sepf2", 2, *gen, *every)
    for m in _metrics(tmp_path, "sepf2"):
        assert m["rollout/filter_rounds"] == 3.0
        assert m["rollout/groups_generated"] == 3 * 4  # 3 rounds of the step's 4 prompts
        assert m["rollout/groups_kept"] == 0.0 and m["rollout/groups_filled"] == 4.0


def _dataset(tmp: Path) -> tuple[str, ...]:
    """A plain prompt/answer dataset with validation prompts and a word-level tokenizer."""
    pytest.importorskip("transformers")
    from tests.test_task_dataset import _save_tokenizer

    tok = _save_tokenizer(tmp / "tok")
    rows = [{"prompt": f"what is {i} plus {i} ?", "answer": str(2 * i)} for i in range(10)]
    for name, part in (("train", rows[:6]), ("val", rows[6:])):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return (
        "rollout.task=dataset", f"rollout.dataset.train_files=[{tmp / 'train.jsonl'}]",
        f"rollout.dataset.val_files=[{tmp / 'val.jsonl'}]", f"rollout.dataset.tokenizer_dir={tok}",
        "model.vocab_size=32", "rollout.max_prompt_length=12", "rollout.max_response_length=4",
        "evaluation.interval=2", "evaluation.n_samples=2", "evaluation.temperature=1.0",
    )  # fmt: skip


def test_evaluation_runs_on_the_generators_with_the_newest_weights(tmp_path):
    """``evaluation`` with separate placement: the replica evaluates each due version right
    after swapping it in (the last with the final weights); at max_staleness 0, one replica of
    the trainer's TP, the eval metrics are the colocated run's, at the same steps."""
    data = _dataset(tmp_path)
    gen = ("rollout.separate.generation_ranks=1", "rollout.separate.max_staleness=0")
    _side_by_side(
        (_colocated, 1, tmp_path, 3, *data), (_separate, 2, tmp_path, "sepe", 3, *gen, *data)
    )
    colocated, separate = _metrics(tmp_path, "colocated"), _metrics(tmp_path, "sepe")
    assert [m["step"] for m in separate] == [0, 1, 2, 3]  # step 0: the evaluation alone
    for a, b in zip(colocated, separate, strict=True):
        evals = sorted(k for k in a if k.startswith("eval/"))
        assert evals == sorted(k for k in b if k.startswith("eval/")), a["step"]
        assert bool(evals) == (a["step"] in (0, 2, 3))
        for key in evals:
            assert a[key] == b[key], (a["step"], key)


MOE = (
    "model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
    "model.moe_token_dispatcher_type=allgather", "model.moe_enable_routing_replay=true",
)  # fmt: skip


def test_moe_routes_recorded_by_the_generator_are_replayed(tmp_path):
    """MoE with routing replay, max_staleness 0: the generator records each token's routes, they
    travel with the samples, and the trainer replays them: the colocated run exactly."""
    _side_by_side(
        (_colocated, 1, tmp_path, 2, *MOE),
        (_separate, 2, tmp_path, "moe", 2, "rollout.separate.max_staleness=0", *MOE),
    )
    assert _rollouts(tmp_path, "colocated") == _rollouts(tmp_path, "moe")
    for a, b in zip(_metrics(tmp_path, "colocated"), _metrics(tmp_path, "moe"), strict=True):
        for key in (*LOSS_KEYS, "moe/replay_mismatch_frac"):
            if key in a:
                assert a[key] == b[key], key
        assert any(k.startswith("moe/") for k in b), sorted(b)
    _weights_equal(tmp_path, tmp_path, "colocated", "moe")


def _stop_at(at: int):
    """A StopRequest that stops the run before step ``at`` (as a signal would)."""
    from megatron_grpo.train.stop import StopRequest

    class StopAt(StopRequest):
        calls = 0

        def agree(self) -> str | None:
            self.calls += 1
            return "a test stop" if self.calls > at else None

    return StopAt(())


def _receive_when_due() -> None:
    """Generators begin receiving a version only when it is due, as under decode CUDA graphs
    (``GenerationLoop.eager`` False; CPU engines have no graphs)."""
    from megatron_grpo.rollout.separate import generation

    init = generation.GenerationLoop.__init__

    def lazy(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.eager = False

    generation.GenerationLoop.__init__ = lazy


def _lag_resume_body(rank: int, world: int, tmp: Path) -> None:
    """2 trainer ranks (DP 2) + 2 generation replicas (TP 1), max_staleness 1; the generators
    receive each version when it is due (the GPU path with decode graphs)."""
    import shutil

    import torch.distributed as dist

    from megatron_grpo.rollout.separate.launch import run_generation_rank
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import Trainer

    on = (*SEPARATE, "rollout.separate.generation_ranks=2", "rollout.separate.max_staleness=1")
    on = (*on, "training.steps=4")
    _receive_when_due()
    whole = _run(tmp, "whole", *on)
    cfg = load_train_config(RECIPE, _overrides(tmp, "cut", *on))
    end = run_generation_rank(cfg)
    if end is None:  # stopped before step 3: units 3 and 4 in flight
        trainer = Trainer(cfg, overwrite=True, stop=_stop_at(2))
        trainer.train()
        assert trainer.stopped is not None and trainer.stopped.after_step == 2
        if rank == 0:
            shutil.copytree(tmp / "cut", tmp / "cut_k0")
        dist.barrier()  # the trainer ranks' world
    else:  # the generation ranks exit as the stopped trainer does (STOP_EXIT_CODE)
        assert end == "stopped", end
    rest = _run(tmp, "cut", *on, resume=True)
    k0 = (*on[:-2], "rollout.separate.max_staleness=0", "training.steps=4")
    dropped = _run(tmp, "cut_k0", *k0, resume=True)
    if whole is None:  # a generation rank
        return
    for s, m in enumerate(whole):  # every trained token lags min(step, 1) versions
        assert m["rollout/policy_lag_max"] == m["rollout/policy_lag_mean"] == min(s, 1)
        assert m["rollout/stale_dropped_groups"] == 0.0
    for a, b in zip(whole[2:], rest, strict=True):
        for key in (*LOSS_KEYS, "rollout/policy_lag_max"):
            assert a[key] == b[key], key
    assert dropped[0]["rollout/stale_dropped_groups"] > 0  # saved under max_staleness 1
    assert dropped[0]["rollout/policy_lag_max"] == 0.0  # made again from the step-2 weights


def test_staleness_1_lag_and_resume_mid_flight_equals_uninterrupted(tmp_path):
    run_distributed(_lag_resume_body, 4, tmp_path)
    assert _rollouts(tmp_path, "whole") == _rollouts(tmp_path, "cut")
    _weights_equal(tmp_path, tmp_path, "whole", "cut")


@pytest.mark.parametrize(
    "extra, world, match",
    [
        (("rollout.separate.generation_ranks=4",), 4, "leave no trainer rank"),
        (("rollout.separate.generation_ranks=[0]",), 4, r"must be the last 1 ranks"),
        (("parallel.tensor_model_parallel_size=2",), 4, "not a multiple of the 2 ranks"),
        (("rollout.num_prompts=5",), 4, "divisible by the trainer's data-parallel size 3"),
    ],
)
def test_placement_errors_name_the_field(tmp_path, extra, world, match):
    from megatron_grpo.config import ConfigError
    from megatron_grpo.rollout.separate.launch import trainer_world_size
    from megatron_grpo.train.config import load_train_config

    cfg = load_train_config(RECIPE, _overrides(tmp_path, "x", *SEPARATE, *extra))
    with pytest.raises(ConfigError, match=match):
        trainer_world_size(cfg, world)


@pytest.mark.parametrize(
    "extra, match",
    [
        (("loss.is_correction_level=null",), "max_staleness=1 trains on tokens of older"),
        (("rollout.separate.tensor_model_parallel_size=3", "rollout.separate.generation_ranks=3"),
         "must divide model.num_attention"),
        (("rollout.partial.enabled=true",), "partial.enabled is not supported with placement"),
        (("rollout.separate.generation_ranks=3", "rollout.separate.tensor_model_parallel_size=2"),
         "do not divide into replicas"),
    ],
)  # fmt: skip
def test_separate_config_errors(tmp_path, extra, match):
    from megatron_grpo.config import ConfigError
    from megatron_grpo.train.config import load_train_config

    with pytest.raises((ConfigError, ValueError), match=match):
        load_train_config(RECIPE, _overrides(tmp_path, "x", *SEPARATE, *extra))


def _nccl_body(rank: int, world: int, tmp: Path) -> None:
    history = _run(tmp, "nccl", *SEPARATE, "rollout.separate.max_staleness=1", "training.steps=4")
    if history is not None:
        assert [m["rollout/policy_lag_max"] for m in history] == [0.0, 1.0, 1.0, 1.0]
        assert all(m["rollout/weight_sync_gib"] > 0 for m in history)


@pytest.mark.gpu
def test_separate_over_nccl():
    """2 GPUs: a trainer and a generation rank over NCCL (weights) and gloo (rollouts),
    max_staleness 1: every step after the first trains on tokens one version old."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_nccl_body, 2, Path(tmp), backend="nccl")


@pytest.mark.parametrize(
    "version, start, due",
    [(0, 0, True), (0, 2, False), (1, 0, False), (2, 0, True), (2, 2, False), (4, 2, True),
     (5, 0, True), (6, 0, False)],
)  # fmt: skip
def test_eval_due_matches_the_colocated_schedule(version, start, due):
    """Version 0 only in a fresh run, every interval after the start, and the last (5)."""
    from megatron_grpo.rollout.evaluation import eval_due

    assert eval_due(version, steps=5, interval=2, start=start) is due
