"""``tools/memory_probe.py``: the phases it samples (CPU: the wiring, with a fake measure) and,
on a GPU, what issue 42 asks: memory in use before rollout at step 2 equals step 1's plus the
optimizer state the first update created (the engine's freed KV cache is not pinned)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["before_rollout", "after_rollout", "after_logprob", "after_update"]


def _probe():
    spec = importlib.util.spec_from_file_location("memory_probe", ROOT / "tools/memory_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _phases_body(rank: int, world: int, tmp: Path) -> None:
    for partial in (False, True):
        _phases(tmp, partial)


def _phases(tmp: Path, partial: bool) -> None:
    from megatron_grpo.train.config import load_train_config

    probe = _probe()
    sets = [
        "parallel.tensor_model_parallel_size=1",
        "rollout.num_prompts=4",
        "training.micro_batch_size=16",
        "training.steps=2",
        "checkpoint.dir=null",
        f"logging.dir={tmp / str(partial)}",
    ]
    if partial:
        sets += ["rollout.partial.enabled=true", "loss.is_correction_level=token"]
    rows: list[dict] = []

    def measure(step, phase, engine):
        assert engine is not None
        return {"step": step, "phase": phase, "slots": engine.stats.get("slots")}

    probe.probe_trainer(load_train_config(ROOT / "recipes/tiny.yaml", sets), rows, measure).train()
    assert [(r["step"], r["phase"]) for r in rows] == [(s, p) for s in (1, 2) for p in PHASES]
    assert all(r["slots"] for r in rows if r["phase"] == "after_rollout")


@pytest.mark.slow
def test_probe_samples_every_phase_of_every_step(tmp_path):
    """The tiny recipe, 2 steps, partial rollouts off and on."""
    run_distributed(_phases_body, 1, tmp_path)


def _state_bytes(trainer) -> int:
    from megatron_grpo.train import optimizer_memory as om

    seen, total = set(), 0
    for t in om.state_tensors(trainer.optimizer):
        if t.is_cuda and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _gpu_body(rank: int, world: int, tmp: Path) -> None:
    from megatron_grpo.rollout.engine import memory_release
    from megatron_grpo.train.config import load_train_config

    probe = _probe()
    recipe, sets = probe.PRESETS["twin"]
    sets = [*sets, "rollout.num_prompts=16", "training.steps=2", "checkpoint.dir=null"]
    sets += ["training.offload_during_rollout=false", f"logging.dir={tmp}"]
    # the update on CUDA graphs (4k micro-batches): their pools stay held across steps
    sets += ["training.max_tokens_per_micro_batch=4096", "training.update_cuda_graphs=true"]
    rows: list[dict] = []
    holder: dict = {}

    def measure(step, phase, engine):
        if phase != "before_rollout":
            return {"step": step, "phase": phase}
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what the engine does before sizing its cache
        free, total = torch.cuda.mem_get_info()
        pools = sum(
            s["total_size"]
            for s in probe.segments()
            if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)
        )
        state = _state_bytes(holder["trainer"]) if "trainer" in holder else 0
        return {
            "step": step,
            "phase": phase,
            "in_use": total - free,
            "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
            "pools": pools,
            "state": state,
        }

    trainer = probe.probe_trainer(load_train_config(ROOT / recipe, sets), rows, measure)
    holder["trainer"] = trainer
    trainer.train()
    first, second = (r for r in rows if r["phase"] == "before_rollout")
    assert first["state"] == 0 and second["state"] > 0  # Adam's state: created by step 1
    # PyTorch's memory grows by the optimizer state alone; outside the allocator (CUDA context:
    # lazily loaded kernels, library workspaces) the driver sees a one-time growth after the
    # first update (~2 GiB on an H100, torch 2.11), which no release can return.
    grown = second["allocated"] - first["allocated"]
    assert abs(grown - second["state"]) < 512 * 2**20, (grown / 2**30, second["state"] / 2**30)
    # and the allocator holds no freed blocks of step 1 (the old cache's segment) at sizing
    held = second["reserved"] - second["allocated"] - (second["pools"] - first["pools"])
    assert held < 512 * 2**20, held / 2**30
    # what the graphs' pools hold goes back to the driver once they are dropped (the trainer
    # drops them before a rollout whose cache lacks room); the engine's decode graphs stay
    pools = second["pools"] - first["pools"]
    assert pools > 2**30, pools / 2**30  # 9.28 GiB in one H200 run
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    assert trainer.step_fn.drop_graphs() > 0
    memory_release.release(torch.device("cuda"))
    freed = torch.cuda.mem_get_info()[0] - before
    assert freed > pools - 256 * 2**20, (freed / 2**30, pools / 2**30)


@pytest.mark.gpu
def test_memory_before_rollout_grows_by_the_optimizer_state_only(tmp_path):
    """One GPU: the dense twin (TP 1), 128 samples of up to 1027 tokens, 2 steps, the update
    on CUDA graphs."""
    if torch.cuda.device_count() < 1:
        pytest.skip("needs 1 GPU")
    run_distributed(_gpu_body, 1, tmp_path, backend="nccl")
