"""``python -m megatron_grpo.train --config recipes/tiny.yaml [--set a.b=value ...] [--resume]``.

``--check`` checks the recipe (every mistake at once, each with its file and line), its data
files, tokenizer and reward function in seconds, without torchrun, a GPU or megatron-core, and
exits (2 on any problem). Every run runs the same checks first.

``--dry-run [--world-size N]`` prints the rank layout and per-rank memory plan and exits.

Runs under ``torchrun`` (single node or multi-node rendezvous) or as a plain ``python`` process
(a world of one). On a CPU-only host the backend is gloo.

A signal (``training.exit_signals``: SIGTERM, SIGINT, SIGUSR1) or ``training.max_wall_minutes``
stops the run after the current step: it saves a checkpoint and prints the command that resumes.

Exit codes: 0 done, 1 a failed run (the reward function raised), 2 bad input (config, data
files, rows, user code named in the recipe, a reward value that is not a number, run directory,
checkpoint), 3 stopped. An error is one line from one rank, without a traceback. Under torchrun these are the ranks' codes: torchrun
itself exits 1 when any rank exits non-zero, after its own ChildFailedError report.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

from megatron_grpo.config import ConfigError
from megatron_grpo.errors import InputError
from megatron_grpo.train.monitor import WarningLog, read_metrics, results_summary
from megatron_grpo.train.stop import STOP_EXIT_CODE, StopRequest

# After an error of the checks that run before training: how to find them all faster.
CHECK_HINT = (
    "  (python -m megatron_grpo.train --config {config} [--set ...] --check finds every such "
    "problem at once, without torchrun or a GPU)"
)
# A rank that does not print a handled error waits this long before exiting (report_error).
ERROR_EXIT_GRACE_S = 5.0


def help_description(doc: str = __doc__, width: int | None = None) -> str:
    """The module docstring as ``--help`` text: plain words (the RST double backticks removed),
    its paragraphs kept and each refilled to the terminal; the first paragraph (the command line)
    is left out, since argparse prints its own usage line."""
    if width is None:
        width = min(shutil.get_terminal_size().columns, 100) - 2
    paragraphs = [" ".join(p.split()) for p in doc.strip().split("\n\n")][1:]
    return "\n\n".join(
        textwrap.fill(p.replace("``", ""), width, break_long_words=False, break_on_hyphens=False)
        for p in paragraphs
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_grpo.train",
        description=help_description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="YAML recipe (e.g. recipes/tiny.yaml)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="A.B=VALUE",
        help="override a config value (YAML-parsed); repeatable",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume",
        action="store_true",
        help="continue from checkpoint.dir's latest checkpoint (an error when there is none)",
    )
    mode.add_argument(
        "--overwrite",
        action="store_true",
        help="start fresh even if logging.dir / checkpoint.dir hold a previous run: its "
        "metrics.jsonl, checkpoints and rollout files are deleted (without this flag a fresh "
        "run refuses to start there)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the recipe (every mistake at once), its data, tokenizer and reward in "
        "seconds (no torchrun, no GPU), print a summary and exit: 0 ok, 2 a problem",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the parallel layout, print the rank groups and the per-rank memory plan "
        "(no GPU, no model, no torch.distributed), then exit",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks assumed by --dry-run (default: $WORLD_SIZE, else the smallest world the "
        "recipe's layout fits)",
    )
    parser.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        help="GPU memory per rank assumed by --dry-run for model.recompute_granularity=auto "
        "(e.g. 79.1 for an H100 80GB; training reads the GPU's own)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # Megatron-core's and torch's warnings (imports, model build, the run) go to
    # logging.dir/warnings.log on the logging rank, with a count on the console.
    if args.check:  # before torch and megatron-core are imported
        from megatron_grpo.train.check import run_check

        return run_check(args.config, args.overrides)
    with WarningLog() as log:
        code = _main(args, argv, log)
    import torch.distributed as dist

    if dist.is_initialized():
        from megatron_grpo.megatron.parallel import shutdown_process_groups

        if not shutdown_process_groups():  # a blocked NCCL teardown must not hold the job
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


def _main(args: argparse.Namespace, argv: list[str], log: WarningLog) -> int:
    from megatron_grpo.train.check import check_inputs
    from megatron_grpo.train.config import load_train_config

    try:  # the checks of --check: the config, then its files, user code and data
        cfg = load_train_config(args.config, args.overrides)
        task = check_inputs(cfg, planning=args.dry_run)
    except (ConfigError, FileNotFoundError, InputError) as e:
        code = report_error(e)
        if int(os.environ.get("RANK", "0")) == 0:  # the next try: seconds, not a launch
            print(CHECK_HINT.format(config=args.config), file=sys.stderr, flush=True)
        return code
    if args.dry_run:
        from megatron_grpo.train.dry_run import dry_run

        world = args.world_size
        if world is None:
            world = int(os.environ.get("WORLD_SIZE", smallest_world_size(cfg.parallel)))
        try:
            dry_run(cfg, world, device_memory_gib=args.device_memory_gib)
        except ValueError as e:
            return report_error(ConfigError(str(e)))
        return 0
    from megatron_grpo.rollout.separate.launch import trainer_world_size

    try:  # rollout.placement: separate trains on the ranks that do not generate
        world = trainer_world_size(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        return report_error(e)
    if world % smallest_world_size(cfg.parallel):
        return report_error(ConfigError(world_size_hint(cfg.parallel, world)))
    # Handlers first: a signal during the (slow) set-up stops the run before its first step.
    stop = StopRequest.from_config(cfg.training)
    stop.install()
    try:
        return _train(cfg, args.resume, args.overwrite, stop, argv, log, task)
    finally:
        stop.uninstall()  # the previous handlers again (after a stop: the signals stay ignored)


def smallest_world_size(parallel) -> int:
    """The fewest ranks the layout fits: a multiple of TP * PP * CP and of the expert layout's
    expert-TP * EP * PP."""
    etp = parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size
    expert = etp * parallel.expert_model_parallel_size * parallel.pipeline_model_parallel_size
    return math.lcm(parallel.model_parallel_size, expert)


def world_size_hint(parallel, world: int) -> str:
    """One line: why ``world`` ranks do not fit the layout, and the two ways out."""
    need = smallest_world_size(parallel)
    sizes = {
        "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "context_parallel_size": parallel.context_parallel_size,
        "expert_model_parallel_size": parallel.expert_model_parallel_size,
    }
    layout = ", ".join(f"parallel.{k}={v}" for k, v in sizes.items() if v > 1)
    sets = " ".join(f"--set parallel.{k}=1" for k, v in sizes.items() if v > 1)
    how = "torchrun --nproc-per-node" if world == 1 else "a world size that is a multiple of"
    return (
        f"{world} rank(s), but the recipe's layout ({layout}) needs a multiple of {need}: "
        f"launch with `{how} {need} -m megatron_grpo.train ...`, or change the layout "
        f"(e.g. {sets})"
    )


def _train(
    cfg, resume: bool, overwrite: bool, stop: StopRequest, argv: list[str], log, task=None
) -> int:
    # Imported after the config is valid: Megatron's import is slow and noisy.
    from megatron_grpo.rollout.separate.launch import run_generation_rank
    from megatron_grpo.rollout.tasks.reward import RewardError
    from megatron_grpo.train.checkpoint import CheckpointError
    from megatron_grpo.train.rundir import RunDirError, release_locks
    from megatron_grpo.train.trainer import Trainer

    t0 = time.perf_counter()
    try:
        # rollout.placement: separate, a generation rank: it exits as the trainer ranks do
        if (end := run_generation_rank(cfg, task)) is not None:
            return STOP_EXIT_CODE if end == "stopped" else 0
        trainer = Trainer(cfg, resume=resume, overwrite=overwrite, stop=stop, task=task)
        if trainer.monitor.enabled:  # the log is written once the first step completed
            trainer.monitor.at_first_step(lambda: _attach_warnings(log, cfg))
        start = trainer.start_step
        trainer.train()
        release_locks()  # a clean end: the next run gets no stale-lock notice
        if trainer.stopped is not None:  # a signal or the time limit: saved, see train/stop.py
            trainer.monitor.message(trainer.stopped.message(argv))
            stop.exiting()
            return STOP_EXIT_CODE
        if trainer.monitor.enabled:
            rows = read_metrics(cfg.logging.metrics_path)
            summary = _summary(cfg, start, time.perf_counter() - t0, rows, log.count_line())
            trainer.monitor.message(summary)
    except (InputError, RunDirError, CheckpointError, RewardError) as e:
        release_locks(failed=True)  # a handled end: no stale lock, no empty run folders
        return report_error(e)
    return 0


def _attach_warnings(log: WarningLog, cfg) -> None:
    log.attach(Path(cfg.logging.dir) / "warnings.log")
    if (line := log.count_line()) is not None:
        print(line, flush=True)


def report_error(e: BaseException) -> int:
    """Print ``e`` as one ``error:`` line (``config error:`` for a config) from one rank and
    return the exit code: 1 for a failed reward function (a failed run), 2 for bad input.

    Every rank meets the same bad input (all of them read the config, the data and the
    checkpoint): rank 0 prints it. A reward function fails on one data-parallel replica's
    samples and reaches that replica's peers from its scoring rank (``rollout/scoring.py``): the
    replica's first rank prints it (rank 0 may not have failed at all)."""
    import torch.distributed as dist

    from megatron_grpo.rollout.tasks.reward import RewardError, RewardValueError

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if _replica_leader() if isinstance(e, RewardError) else rank == 0:
        prefix = "config error" if isinstance(e, (ConfigError, FileNotFoundError)) else "error"
        print(f"{prefix}: {e}", file=sys.stderr, flush=True)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun stops every rank at the first failed exit: a silent rank that exits first
        # would stop the printing one before its line is out
        time.sleep(ERROR_EXIT_GRACE_S)
    return 1 if isinstance(e, RewardError) and not isinstance(e, RewardValueError) else 2


def _replica_leader() -> bool:
    """Whether this rank is the first of its model replica (rank 0 of the model-parallel
    group; every rank when no parallel state exists)."""
    import torch.distributed as dist

    from megatron_grpo.megatron.parallel import current_layout

    layout = current_layout()  # None without Megatron's parallel state
    if layout is None:
        return not dist.is_initialized() or dist.get_rank() == 0
    return dist.get_rank(layout.mp_group) == 0


def _summary(
    cfg, start: int, seconds: float, rows: list[dict] | None = None, warnings: str | None = None
) -> str:
    """The end-of-run lines: what ran, how long, the results (reward first -> last and best,
    the last eval, tokens/s and the time split, from the metrics ``rows``), where its outputs
    are."""
    steps = cfg.training.steps
    ran = (
        f"done: steps {start + 1}..{steps} in {seconds:.0f} s"
        if start < steps
        else f"done: the run was already complete at step {start} of training.steps={steps} "
        f"(raise training.steps to train further)"
    )
    lines = [
        ran,
        *results_summary(rows or []),
        f"  metrics:     {cfg.logging.metrics_path}",
        f"  config:      {cfg.logging.dir}/config.yaml",
    ]
    if cfg.checkpoint.dir is not None:
        latest = Path(cfg.checkpoint.dir) / "latest"
        name = latest.read_text().strip() if latest.is_file() else "none"
        lines.append(f"  checkpoints: {cfg.checkpoint.dir} (latest: {name})")
    if cfg.rollout.output_dir is not None:
        lines.append(f"  rollouts:    {cfg.rollout.output_dir}")
    if warnings is not None:
        lines.append(f"  warnings:    {warnings}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
