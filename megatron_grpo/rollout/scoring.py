"""Rewards scored once per sample: on one rank of each model replica, shared with its peers.

The TP, CP and PP ranks of a model replica hold the same samples (data is sharded over DP only),
so scoring on each of them would call the reward TP x CP x PP times per sample, and a
non-deterministic reward (an LLM judge, a sandbox with a clock) could give the peers different
advantages. :class:`RewardScorer` scores on the replica's *scoring rank* (tensor-parallel rank
0, context-parallel rank 0, first pipeline stage) and broadcasts the results (score, extra
numbers of a dict reward, timeout flags) as one float64 tensor: over the TP group, then
(first stage) the CP group, then the PP group; groups of one rank are skipped, a world of one
does no communication. A failure on the scoring rank (the reward raised, returned a non-number
or its worker died) is broadcast first as a status flag with its message, so every peer raises
the same :class:`RewardError` instead of waiting for scores.

``rollout.reward_workers: N`` scores in a pool of N spawned processes
(``concurrent.futures.ProcessPoolExecutor``, created once on each scoring rank, shut down at
exit); ``rollout.reward_timeout_s`` bounds each call there. A call past it scores
``rollout.reward_on_timeout`` and is flagged (``reward/timeouts``); its worker cannot be
interrupted, so the pool is replaced (its workers start again, a few seconds).
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import pickle
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_grpo.errors import InputError
from megatron_grpo.rollout.config import RolloutConfig
from megatron_grpo.rollout.tasks.base import Prompt, Task
from megatron_grpo.rollout.tasks.reward import (
    PluginReward,
    RewardError,
    RewardValueError,
    reward_value,
)
from megatron_grpo.rollout.user_frames import user_frames

if TYPE_CHECKING:  # megatron-core loads only where a layout is looked up (scoring.py stays light)
    from megatron_grpo.megatron.layout import ParallelLayout

TIMEOUTS = "timeouts"  # the extras column of timed-out samples (1.0) -> reward/timeouts
Call = tuple[tuple, dict[str, Any]]


@dataclass
class Scores:
    """``rewards``: one per sample. ``extras``: per sample, the extra numbers of a dict reward
    by name (NaN where a sample's dict had no such key) and, with ``rollout.reward_timeout_s``,
    ``timeouts`` (1.0 where the call timed out)."""

    rewards: list[float]
    extras: dict[str, list[float]]


# ------------------------------------------------------------------ worker processes
_WORKER_FN: Callable[..., Any] | None = None


def _init_worker(fn: Callable[..., Any], barrier: Any) -> None:
    global _WORKER_FN
    _WORKER_FN = fn
    barrier.wait(timeout=600)  # every worker is up before the first timed call


def _call_in_worker(args: tuple, kwargs: dict[str, Any]) -> Any:
    assert _WORKER_FN is not None
    return _WORKER_FN(*args, **kwargs)


class _CallFailed(Exception):
    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(index, error)
        self.index, self.error = index, error


_TIMED_OUT = object()


class RewardPool:
    """``workers`` spawned processes that run ``fn`` (pickled once per process); ``map`` keeps at
    most one call per worker in flight, so a call's clock starts when a worker takes it."""

    def __init__(self, fn: Callable[..., Any], workers: int, what: str) -> None:
        try:
            pickle.dumps(fn)
        except Exception as e:
            raise InputError(
                f"rollout.reward_workers={workers}: {what} cannot be sent to worker processes "
                f"({type(e).__name__}: {e}); use rollout.reward_workers: 0"
            ) from e
        self.fn, self.workers, self.what = fn, workers, what
        self.executor: ProcessPoolExecutor | None = None
        self._start()
        atexit.register(self.close)

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        executor = ProcessPoolExecutor(
            self.workers,
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(self.fn, ctx.Barrier(self.workers)),
        )
        # One call per worker: each submit starts a process (none is idle before the barrier).
        ready = [executor.submit(os.getpid) for _ in range(self.workers)]
        try:
            for f in ready:
                f.result()
        except Exception as e:
            self.executor = executor
            self.close()
            raise RuntimeError(
                f"rollout.reward_workers: a reward worker process failed to start with "
                f"{self.what} ({type(e).__name__}: {e}; its error is printed above)"
            ) from e
        self.executor = executor

    def close(self) -> None:
        """Stop the workers now (a call still running is abandoned)."""
        executor, self.executor = self.executor, None
        if executor is None:
            return
        # ProcessPoolExecutor cannot cancel a running call (Python 3.14 adds kill_workers()):
        # terminate its processes, then shut it down without waiting for them.
        for p in list(getattr(executor, "_processes", {}).values()):
            if p.is_alive():
                p.terminate()
        executor.shutdown(wait=False, cancel_futures=True)

    def map(self, calls: Sequence[Call], timeout: float | None) -> list[Any]:
        """``fn(*args, **kwargs)`` of each call; a call past ``timeout`` seconds gives
        ``_TIMED_OUT``. The first call that raises stops the pool: :class:`_CallFailed`."""
        results: list[Any] = [None] * len(calls)
        todo = deque(range(len(calls)))
        running: dict[Future, tuple[int, float]] = {}
        try:
            if self.executor is None:  # closed by an earlier failure
                self._start()
            while todo or running:
                assert self.executor is not None
                while todo and len(running) < self.workers:
                    i = todo.popleft()
                    future = self.executor.submit(_call_in_worker, *calls[i])
                    deadline = time.monotonic() + timeout if timeout is not None else float("inf")
                    running[future] = (i, deadline)
                first = min(d for _, d in running.values())
                left = None if first == float("inf") else max(first - time.monotonic(), 0.0)
                done, _ = wait(running, timeout=left, return_when=FIRST_COMPLETED)
                for future in done:
                    i, _ = running.pop(future)
                    self._take(future, i, results)
                now = time.monotonic()
                late = [f for f, (_, d) in running.items() if d <= now and not f.done()]
                if late:
                    for future in late:
                        results[running.pop(future)[0]] = _TIMED_OUT
                    for future in [f for f in running if f.done()]:
                        self._take(future, running.pop(future)[0], results)
                    todo.extendleft(sorted((i for i, _ in running.values()), reverse=True))
                    running.clear()
                    self.close()  # the late calls hold their workers: start fresh ones
                    self._start()
        except BaseException:
            self.close()
            raise
        return results

    @staticmethod
    def _take(future: Future, index: int, results: list[Any]) -> None:
        error = future.exception()
        if error is not None:
            raise _CallFailed(index, error)
        results[index] = future.result()


# ------------------------------------------------------------------ who scores, who receives
def replica_layout(layout: ParallelLayout | None) -> tuple[bool, list[tuple[Any, int]]]:
    """``(scores, steps)``: whether this rank scores its replica's samples, and the broadcasts
    it takes part in, in order, as ``(group, source global rank)``: TP (first stage, CP rank 0),
    CP (first stage), PP. A world of one, or no layout (no Megatron parallel state): every rank
    scores, no broadcast."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or layout is None:
        return True, []
    first, cp = layout.is_first_stage, layout.cp_rank
    steps = []
    if first and cp == 0 and layout.tp_size > 1:
        steps.append((layout.tp_group, layout.tp_src_rank))
    if first and layout.cp_size > 1:
        steps.append((layout.cp_group, layout.cp_src_rank))
    if layout.pp_size > 1:
        steps.append((layout.pp_group, layout.pp_first_rank))
    return layout.tp_rank == 0 and cp == 0 and first, steps


def _reraise(error: BaseException, message: str) -> None:
    if isinstance(error, RewardError):
        raise error
    raise RewardError(message) from error


def _task_reward_call(prompt: Prompt, response_ids: list[int]) -> Call:
    return (prompt, list(response_ids)), {}


class RewardScorer:
    """Scores samples with ``task.reward`` (a :class:`PluginReward` for ``rollout.reward_fn``)
    once per model replica; see the module docstring.

    ``score(prompts, responses, indices)``: ``prompts[i]`` and ``responses[i]`` (ids) are
    sample ``i``; ``indices[i]`` its prompt's index, named in errors when the prompt has no
    ``source`` (``path:row``). Every rank of the replica must call it with the same samples."""

    def __init__(
        self, task: Task, cfg: RolloutConfig, layout: ParallelLayout | None = None
    ) -> None:
        """``layout``: this rank's (default: the current one, None without Megatron's parallel
        state), which decides who scores and who receives."""
        reward = task.reward
        if isinstance(reward, PluginReward):
            self.name = reward.name
            self.fn: Callable[..., Any] = reward.fn
            self.call_args: Callable[[Prompt, list[int]], Call] = reward.call_args
        else:
            self.name = f"{type(task).__name__}.reward"
            self.fn, self.call_args = reward, _task_reward_call
        self.timeout, self.on_timeout = cfg.reward_timeout_s, cfg.reward_on_timeout
        if layout is None:
            from megatron_grpo.megatron.parallel import current_layout

            layout = current_layout()
        self.is_scorer, self.steps = replica_layout(layout)
        self.pool = None
        if cfg.reward_workers > 0 and self.is_scorer:
            self.pool = RewardPool(self.fn, cfg.reward_workers, self.name)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def score(
        self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]], indices: Sequence[int]
    ) -> Scores:
        scores: Scores | None = None
        error: BaseException | None = None
        message = ""
        if self.is_scorer:
            try:
                scores = self._compute(prompts, responses, indices)
            except Exception as e:  # reported to the peers before raising here
                error = e
                message = str(e) if isinstance(e, RewardError) else f"{type(e).__name__}: {e}"
        if not self.steps:
            if error is not None:
                _reraise(error, message)
            assert scores is not None
            return scores
        return self._share(scores, message, error, len(prompts))

    # -------------------------------------------------------------- scoring rank
    def _where(self, prompt: Prompt, index: int) -> str:
        return prompt.source or f"prompt {index}"

    def _compute(
        self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]], indices: Sequence[int]
    ) -> Scores:
        calls = [self.call_args(p, list(r)) for p, r in zip(prompts, responses, strict=True)]
        if self.pool is None:
            raw = []
            for i, (args, kwargs) in enumerate(calls):
                try:
                    raw.append(self.fn(*args, **kwargs))
                except Exception as e:
                    raise self._failed(prompts, indices, i, e) from e
        else:
            try:
                raw = self.pool.map(calls, self.timeout)
            except _CallFailed as f:
                raise self._failed(prompts, indices, f.index, f.error) from f.error
        rewards: list[float] = []
        extras: dict[str, list[float]] = {}
        timeouts = []
        for i, value in enumerate(raw):
            if value is _TIMED_OUT:
                score, more = self.on_timeout, {}
            else:
                score, more = reward_value(value, self.name, self._where(prompts[i], indices[i]))
            for key, v in more.items():
                extras.setdefault(key, [float("nan")] * len(raw))[i] = v
            rewards.append(score)
            timeouts.append(float(value is _TIMED_OUT))
        if self.timeout is not None:
            extras[TIMEOUTS] = timeouts
        return Scores(rewards, extras)

    def _failed(
        self, prompts: Sequence[Prompt], indices: Sequence[int], i: int, error: BaseException
    ) -> RewardError:
        where = self._where(prompts[i], indices[i])
        what = f"{type(error).__name__}: {error}"
        if type(error).__name__ == "BrokenProcessPool":
            what = f"its worker process died ({error})"
        code = getattr(getattr(self.fn, "fn", self.fn), "__code__", None)
        frames = user_frames(error, code.co_filename if code is not None else None)
        return RewardError("\n".join([f"{self.name} failed on {where}: {what}", *frames]))

    # -------------------------------------------------------------- all ranks
    def _broadcast(self, t: torch.Tensor) -> None:
        for group, src in self.steps:
            dist.broadcast(t, src=src, group=group)

    def _share(
        self, scores: Scores | None, message: str, error: BaseException | None, n: int
    ) -> Scores:
        from megatron_grpo.megatron.parallel import comm_device

        device = comm_device()
        if scores is not None:
            columns = ["score", *scores.extras]
            payload = json.dumps({"columns": columns}).encode()
        else:
            columns = []
            bad_value = isinstance(error, RewardValueError)  # the peers exit with its code
            payload = json.dumps({"error": message, "bad_value": bad_value}).encode()
        header = torch.tensor(
            [float(scores is None), len(payload), len(columns)], dtype=torch.float64, device=device
        )
        self._broadcast(header)
        failed, size, ncols = bool(header[0].item()), int(header[1].item()), int(header[2].item())
        data = torch.zeros(size, dtype=torch.uint8, device=device)
        if self.is_scorer:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self._broadcast(data)
        info = json.loads(bytes(data.cpu().tolist()).decode())
        if failed:
            if error is not None:
                _reraise(error, message)
            first, *frames = info["error"].split("\n")
            from_scorer = f"{first} (from this model replica's scoring rank)"
            kind = RewardValueError if info.get("bad_value") else RewardError
            raise kind("\n".join([from_scorer, *frames]))
        values = torch.zeros(n, ncols, dtype=torch.float64, device=device)
        if scores is not None:
            rows = [scores.rewards, *scores.extras.values()]
            values.copy_(torch.tensor(rows, dtype=torch.float64).T)
        self._broadcast(values)
        cols = values.cpu().T.tolist()
        names = info["columns"]
        return Scores(cols[0], dict(zip(names[1:], cols[1:], strict=True)))
