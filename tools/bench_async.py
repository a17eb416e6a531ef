"""Colocated vs separate placement (``rollout.placement``): the dense twin on 4 GPUs.

For each task of ``--tasks`` (``256``: the fixed 256-digit toy task; ``8-512``: ``num_digits:
[8, 512]``, the long-tailed one, ``ignore_eos`` so each response is its prompt's k + 1 tokens)
it runs ``recipes/qwen3_8b_long_sp_twin.yaml`` twice with the same samples per step
(``rollout.num_prompts`` x ``group_size``):

* ``colocated``: TP2 + SP x DP2 on all 4 ranks (every rank generates, then trains);
* ``separate``: a TP2 + SP trainer on ranks 0-1, two TP1 generation replicas on ranks 2-3
  (``rollout.separate``: ``generation_ranks: 2``, ``max_staleness`` ``--staleness``, 1);
* ``separate_dp2`` (``--placements``): the same split with a TP1 x DP2 trainer;
* ``separate_dp2_inflight``: that with ``rollout.separate.in_flight_updates``, to set against
  ``separate_dp2`` of the same call.

A failing run is logged and the others still run. Prints (and writes ``bench_async.md`` and
``bench_async.json`` under ``--out``) one row per run, the means over the steps after the first
(warm-up): step tokens/s, the step split (step / rollout = the trainer's wait / log-prob /
update / weight push seconds), weight-sync seconds and GiB/s, the policy lag, generator idle
seconds, final reward; then separate / colocated ratios of step tokens/s per task.

GPU: ``bash tools/gpu_e2e.sh async`` (installs the carried wheels, then runs this). CPU smoke
run of the same code: ``python tools/bench_async.py --cpu --out /tmp/async`` (the tiny recipe
on gloo, 4 processes: 2 trainer ranks at TP2 vs 2 generation ranks, a few seconds a run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RECIPE = "recipes/qwen3_8b_long_sp_twin.yaml"
TASKS = {
    "256": [
        "rollout.reverse_digits.num_digits=256",
        "rollout.max_prompt_length=260",
        "rollout.max_response_length=257",
    ],
    "8-512": [
        "rollout.reverse_digits.num_digits=[8,512]",
        "rollout.max_prompt_length=516",
        "rollout.max_response_length=513",
        "rollout.sampling.ignore_eos=true",  # response = k + 1 tokens: the long tail
    ],
    "3": [],  # the recipe's own task (the CPU smoke run)
}
PLACEMENTS = {
    "colocated": ["parallel.tensor_model_parallel_size=2"],
    "separate": [
        "parallel.tensor_model_parallel_size=2",
        "rollout.placement=separate",
        "rollout.separate.generation_ranks=2",
        "rollout.separate.tensor_model_parallel_size=1",
    ],
    # the same split with a data-parallel trainer: a 0.6B-shaped model needs no TP on 80 GB
    "separate_dp2": [
        "parallel.tensor_model_parallel_size=1",
        "parallel.sequence_parallel=false",
        "rollout.placement=separate",
        "rollout.separate.generation_ranks=2",
        "rollout.separate.tensor_model_parallel_size=1",
    ],
}
# requests continue under a newer version swapped in mid-part
PLACEMENTS["separate_dp2_inflight"] = [
    *PLACEMENTS["separate_dp2"],
    "rollout.separate.in_flight_updates=true",
]
COLUMNS = [  # (header, metric, format)
    ("tokens/s", "perf/tokens_per_s", "{:.0f}"),
    ("step s", "perf/step_seconds", "{:.2f}"),
    ("rollout (wait) s", "perf/rollout_seconds", "{:.2f}"),
    ("logprob s", "perf/logprob_seconds", "{:.2f}"),
    ("update s", "perf/update_seconds", "{:.2f}"),
    ("push s", "perf/weight_push_seconds", "{:.3f}"),
    ("sync s", "rollout/weight_sync_seconds", "{:.3f}"),
    ("sync GiB", "rollout/weight_sync_gib", "{:.2f}"),
    ("sync GiB/s", None, "{:.1f}"),
    ("lag mean", "rollout/policy_lag_mean", "{:.2f}"),
    ("in-flight swaps", "rollout/in_flight_swaps", "{:.1f}"),
    ("gen s", "perf/generation_seconds", "{:.2f}"),
    ("gen idle s", "perf/generator_idle_seconds", "{:.2f}"),
    ("reward", "reward/mean", "{:.3f}"),
]


def run(task: str, placement: str, args: argparse.Namespace) -> list[dict] | None:
    """One torchrun of 4 ranks; its metrics (one dict per step), None when it failed."""
    name = f"async_{task}_{placement}"
    logdir = Path(args.work) / name
    sets = [*TASKS[task], *PLACEMENTS[placement], f"training.steps={args.steps}"]
    if placement.startswith("separate"):
        sets.append(f"rollout.separate.max_staleness={args.staleness}")
    if args.cpu:  # the tiny recipe: TP2 without SP, a small batch
        sets += ["rollout.num_prompts=8", "rollout.group_size=4", "training.micro_batch_size=16"]
        sets += ["loss.is_correction_level=token"]  # the twin has sequence_mean
    sets += [f"logging.dir={logdir}", "logging.progress_bar=false", "checkpoint.dir=null"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += ["-m", "megatron_grpo.train", "--config", args.recipe, "--overwrite"]
    for s in [*sets, *args.set]:
        cmd += ["--set", s]
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    with open(Path(args.out) / f"{name}.log", "w") as log:
        code = launch(cmd, log, args.run_timeout)
    metrics = logdir / "metrics.jsonl"
    if code != 0 or not metrics.exists():
        print(f"== {name}: failed (exit {code}); see {name}.log", flush=True)
        return None
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def launch(cmd: list[str], log, timeout: float | None) -> int:
    """Run ``cmd`` (torchrun) in a session of its own; past ``timeout`` seconds every rank gets
    SIGABRT, which Python's faulthandler (PYTHONFAULTHANDLER) turns into its stacks in the log
    (a hang leaves the place it hangs, not just a timeout), then the whole tree is killed.
    torchrun starts its ranks in sessions of their own, so the ranks are found as descendants:
    signalling the launcher's session alone would abort torchrun and orphan ranks that keep
    the GPUs busy (they did, for the rest of a call). Returns the exit code, or TIMED_OUT."""
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"== timed out after {timeout:.0f} s: stacks of every rank in the log", flush=True)
    tree = descendants(proc.pid)
    signal_all(tree or [proc.pid], signal.SIGABRT)  # the ranks first: torchrun still waits
    time.sleep(ABORT_GRACE_S)
    signal_all([proc.pid, *tree, *descendants(proc.pid)], signal.SIGKILL)
    proc.wait()
    return TIMED_OUT


TIMED_OUT = 124  # the exit code of a run stopped at its timeout, as timeout(1)'s
ABORT_GRACE_S = 10  # for the ranks' faulthandler to write every thread's stack


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc), in any session, deepest last."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def mean(history: list[dict], key: str) -> float | None:
    values = [h[key] for h in history[1:] or history if h.get(key) is not None]
    return sum(values) / len(values) if values else None


def row(history: list[dict]) -> dict[str, float | None]:
    out = {header: mean(history, key) for header, key, _ in COLUMNS if key is not None}
    gib, sec = out["sync GiB"], out["sync s"]
    out["sync GiB/s"] = gib / sec if gib and sec else None
    out["reward"] = history[-1].get("reward/mean")
    return out


def table(rows: dict[str, dict]) -> str:
    heads = ["task", "placement", *(h for h, _, _ in COLUMNS)]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for name, r in rows.items():
        task, placement = name.split("/")
        if r is None:
            lines.append(f"| {task} | {placement} | failed |" + " |" * (len(COLUMNS) - 1))
            continue
        cells = [fmt.format(r[h]) if r.get(h) is not None else "-" for h, _, fmt in COLUMNS]
        lines.append(f"| {task} | {placement} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, s in rows.items():
        task, placement = name.split("/")
        c = rows.get(f"{task}/colocated")
        if placement != "colocated" and c and s and c.get("tokens/s") and s.get("tokens/s"):
            ratio = s["tokens/s"] / c["tokens/s"]
            lines.append(f"- {task}: {placement} / colocated step tokens/s = {ratio:.2f}x")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", nargs="+", default=None, choices=list(TASKS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument(
        "--placements", nargs="+", default=["colocated", "separate"], choices=list(PLACEMENTS)
    )
    p.add_argument("--recipe", default=None)
    p.add_argument("--work", default="/tmp/bench_async")
    p.add_argument("--out", default="gpu_out")
    p.add_argument("--cpu", action="store_true", help="the tiny recipe on gloo (a smoke run)")
    p.add_argument("--set", action="append", default=[], help="more overrides, every run")
    p.add_argument(
        "--run-timeout",
        type=float,
        default=None,
        help="seconds per run; past it every rank's Python stacks are dumped (SIGABRT)",
    )
    args = p.parse_args()
    args.recipe = args.recipe or ("recipes/tiny.yaml" if args.cpu else RECIPE)
    tasks = args.tasks or (["3"] if args.cpu else ["256", "8-512"])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict | None] = {}
    for task in tasks:
        for placement in args.placements:
            history = run(task, placement, args)
            rows[f"{task}/{placement}"] = None if history is None else row(history)
    text = f"## Colocated vs separate placement ({args.recipe}, 4 ranks)\n\n" + table(rows)
    (Path(args.out) / "bench_async.md").write_text(text)
    (Path(args.out) / "bench_async.json").write_text(json.dumps(rows, indent=1))
    print(text, flush=True)
    return 0 if all(r is not None for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
