"""The metrics of one trainer step: loss (reduced over DP x CP), optimizer, rollouts (rewards
and lengths over DP), the seconds of each stage and the throughputs.

Every function here that reduces is a collective: all ranks call it at the same point.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from megatron_grpo.loss import reduce_metrics
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.rollout.batch import RolloutBatch
from megatron_grpo.rollout.scoring import TIMEOUTS
from megatron_grpo.rollout.source import RolloutSource
from megatron_grpo.train import comm


@contextlib.contextmanager
def timed(stages: dict[str, float], name: str) -> Iterator[None]:
    """Wall seconds of a stage into ``stages[name]`` (GPU work included: synchronized); a
    ``stage/<name>`` range in a profiler's trace (``logging.profile_step_start``)."""
    start = time.perf_counter()
    with torch.profiler.record_function(f"stage/{name}"):
        yield
        if torch.cuda.is_available():  # inside the range: it spans the stage's GPU work
            torch.cuda.synchronize()
    stages[name] = time.perf_counter() - start


def loss_metrics(reports: list[dict[str, Any]], layout: ParallelLayout) -> dict[str, float]:
    """The loss reports of the step's micro-batches, reduced over DP x CP (last stage only)."""
    if not layout.is_last_stage or not reports:
        return {}
    metrics = reduce_metrics(reports, group=layout.dp_cp_group)
    low, high = metrics.get("loss/pg_clipfrac_low"), metrics.get("loss/pg_clipfrac_high")
    if low is not None and high is not None:
        metrics["loss/clipfrac"] = low + high
    return metrics


def optim_metrics(
    norms: list[float], lr: float, skipped_total: int, skipped_now: int, on_policy: bool
) -> dict[str, float]:
    """Mean grad norm of the step's optimizer steps, the LR and the non-finite skips."""
    out = {"optim/grad_norm": sum(norms) / len(norms)} if norms else {}
    out["optim/lr"] = lr
    out["optim/skipped_steps_total"] = float(skipped_total)
    out["optim/skipped_steps"] = float(skipped_now)
    out["perf/old_logprob_pass_skipped"] = float(on_policy)
    return out


def rollout_metrics(
    batch: RolloutBatch,
    stages: dict[str, float],
    source: RolloutSource,
    layout: ParallelLayout,
    extras: bool,
) -> dict[str, float]:
    """Rewards and lengths (over DP), the time of each stage and the throughputs; the seconds
    are the slowest rank's (a step waits for it). ``extras``: the batch may carry
    ``reward_extras`` (rollout files carry none)."""
    rewards = batch.rewards
    resp = sum(len(r) for r in batch.response_ids)
    total, sq, n, resp_tokens, tokens = comm.all_reduce_sum(
        [sum(rewards), sum(r * r for r in rewards), len(rewards), resp, batch.num_tokens],
        layout.dp_group,
    )
    mean = total / n
    metrics = {
        "reward/mean": mean,
        "reward/std": max(sq / n - mean * mean, 0.0) ** 0.5,
        "response/length_mean": resp_tokens / n,
    }
    if extras:
        metrics.update(reward_extra_metrics(batch, layout))
    metrics.update(perf_metrics(stages, tokens, resp_tokens, source))
    if torch.cuda.is_available():
        # this step's peak (reset below for the next one), the max over all ranks
        peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device="cuda")
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        torch.cuda.reset_peak_memory_stats()
        metrics["perf/peak_memory_gib"] = peak.item()
    return metrics


def reward_extra_metrics(batch: RolloutBatch, layout: ParallelLayout) -> dict[str, float]:
    """``reward/<name>`` of the batch's ``reward_extras`` (a dict reward's other keys) over DP:
    the mean over the samples that have the key; ``reward/timeouts``: the number of samples
    whose reward timed out. The names are the union over the DP ranks."""
    extras = batch.reward_extras or {}
    names = sorted(extras)
    group, dp_size = layout.dp_group, layout.dp_size
    if dp_size > 1:  # a rank's samples may lack a key the others have
        gathered: list[Any] = [None] * dp_size
        torch.distributed.all_gather_object(gathered, names, group=group)
        names = sorted(set().union(*gathered))
    if not names:
        return {}
    sums = []
    for name in names:
        values = [v for v in extras.get(name, []) if v == v]  # NaN: this sample has none
        sums += [sum(values), len(values)]
    totals = comm.all_reduce_sum(sums, group)
    out = {}
    for j, name in enumerate(names):
        total, count = totals[2 * j], totals[2 * j + 1]
        if name == TIMEOUTS:
            out[f"reward/{TIMEOUTS}"] = total
        elif count:
            out[f"reward/{name}"] = total / count
    return out


def perf_metrics(
    stages: dict[str, float], tokens: float, new_tokens: float, source: RolloutSource
) -> dict[str, float]:
    """``perf/<stage>_seconds`` (the slowest rank's: the step waits for it), throughputs over
    all DP ranks, and the rollout source's own metrics (the max over ranks)."""
    own = source.metrics()
    names = [f"perf/{k}_seconds" for k in stages] + list(own)
    out = dict(zip(names, comm.all_reduce_max([*stages.values(), *own.values()]), strict=True))
    out["perf/tokens_per_s"] = tokens / out["perf/step_seconds"]
    out["perf/train_tokens_per_s"] = tokens / out["perf/update_seconds"]
    if source.generated:  # file rollouts were generated elsewhere: no rate to report
        generated = out.get("rollout/generated_tokens", new_tokens)  # filter_groups: all rounds
        # separate placement: the generators' own time (the rollout stage is the trainer's wait)
        seconds = out.get("perf/generation_seconds") or out["perf/rollout_seconds"]
        out["perf/generation_tokens_per_s"] = generated / seconds
    return out
