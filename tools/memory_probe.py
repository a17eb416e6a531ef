"""Device memory per phase and step of a training run: before rollout, after rollout, after the
log-prob passes, after the update (issue 42: what the KV cache finds from step 2 on).

Per phase (rank 0): torch.cuda.memory_allocated / memory_reserved, the driver's view (total -
mem_get_info's free: what the engine's sizing counts as in use once the allocator's unused
segments are released), the allocator's segments split into free bytes inside segments that
hold live tensors ("pinned": never returnable to the driver), whole free segments
("releasable") and CUDA-graph pools, the peak since the previous phase, and after rollout the
engine's KV-cache slots. "before rollout" is sampled inside the rollout stage, after any
``training.offload_during_rollout`` move (what the engine sees).

One GPU, the dense twin on the long-tailed toy task (partial rollouts off, then on):
    python3 tools/memory_probe.py --preset twin
    python3 tools/memory_probe.py --preset twin --partial
The Qwen3-8B shape at TP4 with 4 of its 36 layers (random weights), 256 x (256 + 3840):
    torchrun --nproc-per-node 4 tools/memory_probe.py --preset 8b --layers 4
    torchrun --nproc-per-node 4 tools/memory_probe.py --preset 8b --layers 4 --partial
``--baseline``: the same run without the fix (main 08d422b's allocator behaviour), to compare.
``MEMORY_RUNS="twin_partial twin_partial_baseline" bash tools/gpu_e2e.sh memory`` runs a
selection (``twin``, ``twin_partial``, ``8b``, ``8b_partial``, each with ``_baseline``). Tables
are appended to ``--out``/memory_probe.md, rows to ``--out``/memory_probe.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 2**30
PRESETS = {
    "twin": (
        "recipes/qwen3_8b_long_sp_twin.yaml",
        [
            "parallel.tensor_model_parallel_size=1",
            "parallel.sequence_parallel=false",
            "rollout.reverse_digits.num_digits=[8,512]",
            "rollout.max_prompt_length=514",
            "rollout.max_response_length=513",
            "rollout.sampling.ignore_eos=true",
        ],
    ),
    "8b": (
        "recipes/qwen3_8b_long_sp.yaml",
        [
            "checkpoint.load=null",
            "rollout.input_path=null",
            "rollout.task=reverse_digits",
            "rollout.reverse_digits.num_digits=254",  # prompts of 256 tokens
            "rollout.max_prompt_length=256",
            "rollout.max_response_length=3840",
            "rollout.sampling.ignore_eos=true",
            "rollout.num_prompts=32",  # 256 samples at DP 1
            "training.mini_batches_per_step=1",
            "training.max_tokens_per_micro_batch=16384",
        ],
    ),
}
PARTIAL = ["rollout.partial.enabled=true", "rollout.partial.kv=recompute"]
COLUMNS = ("allocated", "reserved", "in_use", "pinned_free", "releasable", "graph_pools", "peak")


def segments() -> list[dict]:
    try:
        return torch.cuda.memory_snapshot()
    except TypeError:  # signatures differ between torch versions
        return torch.cuda.memory._snapshot()["segments"]


def sample(step: int, phase: str, engine) -> dict:
    """This rank's memory now (see the module docstring); the peak is reset."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    row = {"step": step, "phase": phase, "total": total / GIB}
    row["allocated"] = torch.cuda.memory_allocated() / GIB
    row["reserved"] = torch.cuda.memory_reserved() / GIB
    row["in_use"] = (total - free) / GIB
    row["peak"] = torch.cuda.max_memory_allocated() / GIB
    pinned = releasable = pools = largest = 0
    for s in segments():
        if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0):
            pools += s["total_size"]
        elif s["allocated_size"]:
            pinned += s["total_size"] - s["allocated_size"]
        else:
            releasable += s["total_size"]
        for b in s.get("blocks", []):
            if b.get("state") == "inactive":
                largest = max(largest, b["size"])
    row.update(pinned_free=pinned / GIB, releasable=releasable / GIB, graph_pools=pools / GIB)
    row["largest_free_block"] = largest / GIB
    if engine is not None and phase == "after_rollout":
        row["kv_slots"] = engine.stats.get("slots")
        row["kv_cache_gib"] = engine.stats.get("kv_cache_gib")
    torch.cuda.reset_peak_memory_stats()
    return row


def find_engine(source):
    while source is not None:
        if getattr(source, "engine", None) is not None:
            return source.engine
        source = getattr(source, "inner", None)
    return None


def probe_trainer(cfg, rows: list[dict], measure=sample):
    """A ``Trainer`` that appends ``measure(step, phase, engine)`` to ``rows`` at the phase
    boundaries."""
    from megatron_grpo.train.trainer import Trainer

    class Before:  # the rollout source, sampling first (``inner``: partial_source finds it)
        def __init__(self, inner, owner) -> None:
            self.inner, self.owner = inner, owner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def next(self, step, *args, **kw):
            self.owner.step_no = step + 1
            self.owner.record("before_rollout")
            return self.inner.next(step, *args, **kw)

    class ProbeTrainer(Trainer):
        def __init__(self, cfg) -> None:
            super().__init__(cfg, overwrite=True)
            self.step_no = 0
            self.engine = find_engine(self.source)
            self.source = Before(self.source, self)

        def record(self, phase: str) -> None:
            rows.append(measure(self.step_no, phase, self.engine))

        def advantages(self, batch):
            self.record("after_rollout")
            return super().advantages(batch)

        def old_and_ref_logprobs(self, mini_batches):
            out = super().old_and_ref_logprobs(mini_batches)
            self.record("after_logprob")
            return out

        def update(self, mini_batches):
            metrics = super().update(mini_batches)
            self.record("after_update")
            return metrics

    return ProbeTrainer(cfg)


def table(rows: list[dict], title: str) -> str:
    head = ["step", "phase", *COLUMNS, "kv_slots", "kv_cache_gib"]
    lines = [f"## {title} (GiB, rank 0)", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["step"]), r["phase"], *(f"{r[c]:.2f}" for c in COLUMNS)]
        slots, gib = r.get("kv_slots"), r.get("kv_cache_gib")
        cells += ["" if slots is None else f"{slots:.0f}", "" if gib is None else f"{gib:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def disable_release() -> None:
    """``--baseline``: the engine's and the first step's releases do nothing."""
    from megatron_grpo.rollout.engine import memory_release
    from megatron_grpo.train import optim

    memory_release.release = lambda device, dropped=None: True
    optim.release_before_first_step = lambda optimizer: False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="twin")
    p.add_argument("--partial", action="store_true", help="rollout.partial on (kv recompute)")
    p.add_argument("--layers", type=int, default=None, help="model.num_layers (8b: 4)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--offload", default="false", help="training.offload_during_rollout")
    p.add_argument("--out", default="gpu_out")
    p.add_argument("--work", default="/tmp/memory_probe")
    p.add_argument("--set", action="append", default=[], help="extra overrides (last wins)")
    p.add_argument(
        "--baseline",
        action="store_true",
        help="without the fix: the engine keeps its freed cache in the allocator and the first "
        "optimizer step takes whatever blocks are free (main 08d422b's behaviour)",
    )
    args = p.parse_args()
    if args.baseline:
        disable_release()
    from megatron_grpo.train.config import load_train_config

    recipe, sets = PRESETS[args.preset]
    layers = args.layers or (4 if args.preset == "8b" else None)
    tag = f"{args.preset}{layers or ''}_{'partial' if args.partial else 'sync'}"
    tag += "_baseline" if args.baseline else ""
    sets = [*sets, *(PARTIAL if args.partial else [])]
    sets += [f"model.num_layers={layers}"] if layers else []
    sets += [
        f"training.steps={args.steps}",
        f"training.offload_during_rollout={args.offload}",
        f"logging.dir={args.work}/{tag}",
        "logging.progress_bar=false",
        "checkpoint.dir=null",
        *args.set,
    ]
    rows: list[dict] = []
    probe_trainer(load_train_config(recipe, sets), rows).train()
    if int(os.environ.get("RANK", "0")) == 0:
        text = table(rows, f"{tag}: {recipe} " + " ".join(sets))
        print(text, flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "memory_probe.jsonl", "a") as f:
            for r in rows:
                f.write(json.dumps({"run": tag, **r}) + "\n")
        with open(Path(args.out) / "memory_probe.md", "a") as f:
            f.write(text + "\n\n")


if __name__ == "__main__":
    main()
