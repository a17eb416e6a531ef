"""Partial rollouts off vs on: the dense twin on the long-tailed toy task (one GPU).

Runs ``recipes/qwen3_8b_long_sp_twin.yaml`` (TP 1, no SP) on ``reverse_digits`` with
``num_digits: [8, 512]`` (prompt k + 2 tokens, response exactly k + 1 tokens: ``ignore_eos``,
the task's per-prompt limit) for ``--steps`` steps with ``rollout.partial`` off, then on, and
prints one table (means over the steps after the first, a warm-up):

    mode | rollout s | step s | generated tokens / rollout s | decode_batch_fill |
    offpolicy_token_frac | staleness_max | carried | dropped | reward

Run it from the repository root on a GPU machine with the wheels installed, e.g.
``bash tools/gpu_e2e.sh partial`` (installs the carried wheels, then runs this), or directly:
``python3 tools/bench_partial.py --out gpu_out``. About 6 minutes on one H200 at 6 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RECIPE = "recipes/qwen3_8b_long_sp_twin.yaml"
TASK = [
    "parallel.tensor_model_parallel_size=1",
    "parallel.sequence_parallel=false",
    "rollout.reverse_digits.num_digits=[8,512]",
    "rollout.max_prompt_length=514",
    "rollout.max_response_length=513",
    "rollout.sampling.ignore_eos=true",  # response length = the prompt's k + 1: the long tail
    "logging.progress_bar=false",
    "checkpoint.dir=null",
]
COLUMNS = [
    ("rollout s", "perf/rollout_seconds", "{:.2f}"),
    ("step s", "perf/step_seconds", "{:.2f}"),
    ("gen tok / rollout s", None, "{:.0f}"),
    ("decode fill", "rollout/decode_batch_fill", "{:.3f}"),
    ("off-policy frac", "rollout/offpolicy_token_frac", "{:.3f}"),
    ("staleness max", "rollout/staleness_max", "{:.0f}"),
    ("carried", "rollout/partial_carried", "{:.0f}"),
    ("dropped", "rollout/partial_dropped", "{:.0f}"),
    ("reward", "reward/mean", "{:.3f}"),
]


def run(mode: str, args: argparse.Namespace) -> list[dict]:
    """One trainer run; its metrics, one dict per step."""
    logdir = Path(args.work) / f"partial_{mode}"
    sets = [*TASK, f"training.steps={args.steps}", f"logging.dir={logdir}", *args.set]
    if mode != "off":
        sets += ["rollout.partial.enabled=true", f"rollout.partial.kv={mode}",
                 f"rollout.partial.over_provision={args.over_provision}"]  # fmt: skip
    cmd = [sys.executable, "-m", "megatron_grpo.train", "--config", args.recipe, "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    with open(Path(args.out) / f"bench_partial_{mode}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
    lines = (logdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def row(mode: str, history: list[dict]) -> list[str]:
    """Means over the steps after the first (CUDA graphs captured, caches warm)."""
    steps = history[1:] or history
    cells = [mode]
    for _, key, fmt in COLUMNS:
        if key is None:  # every token the engine sampled, over the rollout seconds
            tokens = sum(h.get("rollout/engine_tokens", 0.0) for h in steps)
            value = tokens / max(sum(h["perf/rollout_seconds"] for h in steps), 1e-9)
        else:
            value = sum(h.get(key, 0.0) for h in steps) / len(steps)
        cells.append(fmt.format(value))
    return cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--over-provision", type=float, default=0.5)
    p.add_argument("--modes", default="off recompute", help="off, recompute and/or keep")
    p.add_argument("--work", default="/tmp/bench_partial")
    p.add_argument("--out", default="gpu_out")
    p.add_argument("--recipe", default=RECIPE)
    p.add_argument("--set", action="append", default=[], help="extra overrides (last wins)")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = [row(mode, run(mode, args)) for mode in args.modes.split()]
    header = ["partial", *(c[0] for c in COLUMNS)]
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(table) + "\n"
    (Path(args.out) / "bench_partial.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
