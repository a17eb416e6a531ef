"""Where each step's scored rollouts come from: ``source.next(step) -> RolloutBatch``.

The trainer loop only calls :meth:`RolloutSource.next`, which returns this DP rank's share of
step ``step`` with rewards filled in. ``rollout.source`` picks the implementation:

* ``generate``: :class:`GeneratedRollouts`, the policy samples ``group_size`` responses per task
  prompt with ``megatron_grpo.rollout`` (one :class:`KVCacheEngine` for the whole run, so its
  CUDA graphs are captured once), then the task's reward scores them.
* ``files``: :class:`FileRollouts`, the next groups of ``rollout.input_path`` (rewards come with
  them).
* ``"pkg.module:Class"`` / ``"path/to/file.py:Class"``: a user class implementing
  :class:`RolloutSource` (:func:`source_class`), e.g. a multi-turn or tool-calling environment,
  or a client of an OpenAI-compatible vLLM / SGLang server with weight sync; the loop is
  untouched.

The wrappers that keep a step's batch full (``partial.py``, ``dynamic_sampling.py``) drive a
:class:`GeneratedRollouts` through its public members: ``task``, ``params``, ``scorer``,
``engine`` and ``generator(step, round)``. ``build.py`` assembles the chain.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

import torch

from megatron_grpo.config.base import ConfigError, field_message, recipe_fields
from megatron_grpo.errors import InputError
from megatron_grpo.rollout.batch import RolloutBatch
from megatron_grpo.rollout.config import RolloutConfig
from megatron_grpo.rollout.context import RolloutContext
from megatron_grpo.rollout.dynamic_sampling import extra_round_first_prompt
from megatron_grpo.rollout.engine import Generation, KVCacheEngine, SamplingParams, generate
from megatron_grpo.rollout.files import RolloutFileSource
from megatron_grpo.rollout.scoring import RewardScorer
from megatron_grpo.rollout.tasks import Prompt, Task, build_task


class RolloutSource(Protocol):
    """Scored rollouts of one DP rank, step by step: what the trainer loop needs.

    Implemented by :class:`GeneratedRollouts` and :class:`FileRollouts`; a class named by
    ``rollout.source: "pkg.module:Class"`` (or ``"path/to/file.py:Class"``) is constructed once,
    after the model is built, as ``Class(cfg, task, model, dp_rank, dp_size)``:

    * ``cfg``: the run's root config (the trainer's ``TrainConfig``, every section);
    * ``task``: the task of ``rollout.task`` (prompts by index, tokenizer, reward; built and
      checked before the model). :class:`~megatron_grpo.rollout.scoring.RewardScorer`
      ``(task, cfg.rollout)`` scores with it (or ``rollout.reward_fn``) once per model replica;
    * ``model``: the policy, unwrapped, its first model chunk (a ``GPTModel``; its weights are
      the current policy at every ``next`` call: generate with :func:`megatron_grpo.rollout.
      generate`, or push them to an external engine);
    * ``dp_rank`` / ``dp_size``: this rank's data-parallel coordinates (data is sharded over DP
      only; the TP / CP / PP ranks of a replica construct and call the source identically and
      must return the same batch).

    Members:

    * ``next(step)``: this DP rank's rollouts of step ``step`` (0-based), scored: a
      :class:`RolloutBatch` with ``rewards`` set (``None`` is an error naming the class).
      Samples of one prompt share a ``group_id`` (one advantage group), ``num_prompts / DP``
      groups of ``group_size`` samples by convention; ``rollout_logprobs`` are optional (needed
      by IS correction / ``mismatch/*``). A pure function of ``step`` (and the weights) keeps
      ``--resume`` exact. With ``rollout.filter_groups`` the trainer calls
      ``next(step, round, count)`` instead (dynamic sampling's ``RoundSource``).
    * ``generated``: whether ``next`` sampled the responses (then
      ``perf/generation_tokens_per_s`` is logged).
    * ``metrics()``: the source's own metrics of the last ``next`` call, by name (the trainer
      logs the max over ranks); the same names on every rank.
    """

    generated: bool

    def next(self, step: int) -> RolloutBatch: ...

    def metrics(self) -> dict[str, float]: ...


def _first_group(num_prompts: int, step: int, dp_rank: int, per_rank: int) -> int:
    """Index of this DP rank's first prompt (or file group) of ``step``."""
    return step * num_prompts + dp_rank * per_rank


class FileRollouts:
    """Groups read from ``rollout.input_path``, checked when opened: enough groups for the run,
    a ``reward`` column, ids and lengths that fit the model (errors name the file and line)."""

    generated = False

    def __init__(self, cfg: RolloutConfig, ctx: RolloutContext, dp_rank: int, dp_size: int) -> None:
        self.cfg, self.dp_rank = cfg, dp_rank
        self.per_rank = cfg.num_prompts // dp_size
        self.files = RolloutFileSource(cfg.input_path)
        needed = ctx.steps * cfg.num_prompts
        if len(self.files) < needed:
            raise InputError(
                f"rollout.input_path has {len(self.files)} groups, training.steps * "
                f"rollout.num_prompts needs {needed}"
            )
        for batch, where in self.files.files:
            if len(batch) and batch.rewards is None:
                raise InputError(
                    f"{where[0]}: rollouts from rollout.input_path must carry a 'reward' column"
                )
        self.files.check_against_model(ctx.vocab_size, ctx.max_sequence_length)

    def metrics(self) -> dict[str, float]:
        return {}

    def next(self, step: int) -> RolloutBatch:
        start = _first_group(self.cfg.num_prompts, step, self.dp_rank, self.per_rank)
        return self.files.take(start, self.per_rank)


def build_checked_task(cfg: RolloutConfig, ctx: RolloutContext) -> Task:
    """The task of ``rollout.task`` (checked against the model's vocabulary)."""
    task = build_task(cfg, ctx.seed)
    vocab = task.tokenizer.vocab_size
    if vocab > ctx.vocab_size:
        raise InputError(
            f"model.vocab_size={ctx.vocab_size} is smaller than the task tokenizer's "
            f"vocabulary ({vocab})"
        )
    return task


def sampling_params(
    cfg: RolloutConfig, vocab_size: int, eos_id: int, task_stop_ids: Sequence[int] = ()
) -> SamplingParams:
    """``rollout.sampling`` completed for generation: ``max_new_tokens`` from
    ``rollout.max_response_length``, ``eos_id``, the model's vocabulary ``vocab_size``, and
    ``task_stop_ids`` (the task's own ids that end a response, ``Task.stop_ids``, e.g. the
    ``eos_token_id`` list of the dataset task's ``generation_config.json``) added to
    ``rollout.sampling.stop_ids``."""
    r = cfg
    stop_ids = tuple(dict.fromkeys([*r.sampling.stop_ids, *task_stop_ids]))
    try:
        return dataclasses.replace(
            r.sampling,
            max_new_tokens=r.max_response_length,
            eos_id=eos_id,
            vocab_size=vocab_size,
            stop_ids=stop_ids,
        )
    except ValueError as e:  # name the recipe's field (e.g. a stop id beyond the vocabulary)
        origin = f" (the task adds stop ids {list(task_stop_ids)})" if task_stop_ids else ""
        names = [f.name for f in recipe_fields(SamplingParams)]
        raise ConfigError(field_message("rollout.sampling", f"{e}{origin}", names)) from e


def build_engine(
    cfg: RolloutConfig, model: torch.nn.Module, ctx: RolloutContext | None = None
) -> KVCacheEngine | None:
    """The engine of ``rollout.engine`` (kind ``kv_cache``), or None for ``recompute``; pass
    ``engine or "recompute"`` to ``generate``. With ``rollout.colocated.weights: shared`` a
    :class:`KVCacheEngine` on ``model``'s own parameters, so the policy's updates reach it with
    no copy; with ``replica`` a ``rollout.replica.ReplicaEngine`` (built from
    ``ctx.model_config``; a collective)."""
    if cfg.engine.kind != "kv_cache":
        return None
    max_context = cfg.max_prompt_length + cfg.max_response_length
    where = ""
    if cfg.colocated.weights == "replica" and not _whole(model):
        from megatron_grpo.rollout.replica import ReplicaEngine

        if ctx is None or ctx.model_config is None:
            raise ValueError("rollout.colocated.weights: replica needs the model's config")
        engine = ReplicaEngine(model, ctx.model_config, cfg.engine, max_context)
        where = f" {engine.describe()},"
    else:
        engine = KVCacheEngine(model, cfg.engine, max_context)
        if cfg.colocated.weights == "replica":  # the trained model is the replica already
            where = " on the trained weights (whole at TP = EP = 1: no replica),"
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        graphs = "CUDA graphs " + ("on" if engine.use_graphs else engine.graphs_off or "off")
        line = f"rollout: decode steps run{where} {engine.decode}, {graphs}, {engine.sizer.memory}"
        print(line, flush=True)
    return engine


def _whole(model: torch.nn.Module) -> bool:
    """Whether each rank holds all of ``model`` (TP = EP = 1 in the initialized layout)."""
    from megatron_grpo.megatron.layout import ParallelLayout

    layout = ParallelLayout.current(model.config.sequence_parallel)
    return layout.tp_size == 1 and layout.ep_size == 1


def engine_metrics(stats: dict[str, float]) -> dict[str, float]:
    """Metrics of an engine call's ``stats`` (see ``GeneratedRollouts.metrics``); counters a
    call did not report (a replica rank without samples) are 0."""
    s = defaultdict(float, {k: float(v) for k, v in stats.items()})
    steps = max(s["decode_steps"], 1.0)
    out = {
        "rollout/kv_slots": s["slots"],
        "rollout/prefill_forwards": s["prefill_forwards"],
        "rollout/decode_steps": s["decode_steps"],
        "rollout/decode_batch_mean": s["decode_rows"] / steps,
        "rollout/decode_batch_fill": s["decode_live_rows"] / (steps * max(s["slots"], 1.0)),
        "rollout/engine_tokens": s["generated_tokens"],
        "rollout/partial_kv_recomputed": s["kv_recomputed"],
        "rollout/graph_captures": s["graph_captures"],
        "perf/prefill_seconds": s["prefill_seconds"],
        "perf/decode_seconds": s["decode_seconds"],
    }
    if "replica_copy_seconds" in s:  # rollout.colocated.weights: replica
        out["perf/replica_copy_seconds"] = s["replica_copy_seconds"]
    return out


class GeneratedRollouts:
    """The policy generates ``group_size`` responses per prompt; the task's reward scores them
    once per model replica (:class:`~megatron_grpo.rollout.scoring.RewardScorer`).

    Step ``s`` on DP rank ``d`` samples with a generator seeded from ``(seed, s, d)`` (extra
    round ``k``: ``(seed, s, d, k)``), so a resumed run draws what an uninterrupted one would
    have. ``model`` is the unwrapped policy, its first model chunk (generation needs PP = 1,
    CP = 1).

    What a wrapper that schedules the requests itself (partial rollouts, an asynchronous
    orchestrator) needs is public: ``task``, ``params`` (the completed sampling parameters),
    ``scorer``, ``engine`` (None: ``recompute``), ``record_routes`` and
    :meth:`generator`."""

    generated = True

    def __init__(
        self,
        cfg: RolloutConfig,
        ctx: RolloutContext,
        task: Task,
        model: torch.nn.Module,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        self.cfg, self.ctx, self.task, self.model, self.dp_rank = cfg, ctx, task, model, dp_rank
        self.per_rank = cfg.num_prompts // dp_size
        self.record_routes = ctx.record_routes
        stop_ids = getattr(task, "stop_ids", ())
        self.params = sampling_params(cfg, ctx.vocab_size, task.tokenizer.eos_id, stop_ids)
        self.scorer = RewardScorer(task, cfg)  # once per replica (rollout/scoring.py)
        self.engine = build_engine(cfg, model, ctx)  # one per run: graphs reused across steps

    def metrics(self) -> dict[str, float]:
        """The KV-cached engine's counters of the last call: ``rollout/kv_slots`` (sequences the
        cache held at once), ``rollout/prefill_forwards``, ``rollout/decode_steps``,
        ``rollout/decode_batch_mean`` (rows per decode step), ``rollout/decode_batch_fill``
        (unfinished rows per decode step / cache slots), ``rollout/engine_tokens`` (tokens
        sampled, whether trained on, carried or dropped), ``rollout/partial_kv_recomputed``
        (paused ``kv: keep`` requests whose rows no longer fit the cache: prefilled again),
        ``perf/prefill_seconds``, ``perf/decode_seconds`` and, generating on replicas,
        ``perf/replica_copy_seconds``. None for ``rollout.engine.kind: recompute``."""
        if self.engine is None:
            return {}
        return engine_metrics(self.engine.stats)

    def next(self, step: int, round: int = 0, count: int | None = None) -> RolloutBatch:
        """Step ``step``'s prompts; ``round`` >= 1: an extra round of fresh prompts (dynamic
        sampling, ``rollout.filter_groups``) with its own seed; ``count``: only the first
        ``count`` of them (default: all ``num_prompts / DP``)."""
        r = self.cfg
        start, prompts = self.step_prompts(step, round, count)
        expanded = [p for p in prompts for _ in range(r.group_size)]
        samples = [list(p.ids) for p in expanded]
        out = self._generate(samples, [p.max_new_tokens for p in expanded], step, round)
        group_ids = [start + i for i in range(len(prompts)) for _ in range(r.group_size)]
        return self.scored_batch(expanded, out.responses, group_ids, out.logprobs, out.routes)

    def scored_batch(
        self,
        expanded: list[Prompt],
        responses: list[list[int]],
        group_ids: list[int],
        logprobs: list[list[float]],
        routes: list | None = None,
        versions: list[list[int]] | None = None,
    ) -> RolloutBatch:
        """The batch of generated samples (one prompt per sample, ``expanded``), scored here:
        every source of generated rollouts (colocated, partial, separate) builds it so."""
        scores = self.scorer.score(expanded, responses, group_ids)
        return RolloutBatch(
            [list(p.ids) for p in expanded],
            responses,
            group_ids,
            logprobs,
            scores.rewards,
            routed_experts=routes,
            reward_extras=scores.extras or None,
            policy_versions=versions,
        )

    def step_prompts(
        self, step: int, round: int = 0, count: int | None = None
    ) -> tuple[int, list[Prompt]]:
        """The index of this DP rank's first prompt of ``step`` (round ``round``) and its
        prompts (checked against ``rollout.max_prompt_length``)."""
        r = self.cfg
        start = self._first_prompt(step, round)
        prompts = self.task.prompts(start, self.per_rank if count is None else count)
        too_long = [p for p in prompts if len(p.ids) > r.max_prompt_length]
        if too_long:
            raise InputError(
                f"a prompt has {len(too_long[0].ids)} tokens > rollout.max_prompt_length="
                f"{r.max_prompt_length}: {too_long[0].text[:80]!r}"
            )
        return start, prompts

    def _generate(
        self, samples: list[list[int]], limits: list[int | None], step: int, round: int
    ) -> Generation:
        """With ``model.moe_enable_routing_replay`` the routes of every sample's tokens as the
        generation's routers chose them, int64 ``[P + R, L, k]`` (``RolloutBatch.routed_experts``;
        the last row -1). ``limits``: the task's per-prompt response limits."""
        engine = self.engine if self.engine is not None else "recompute"
        return generate(
            self.model,
            samples,
            self.params,
            self.generator(step, round),
            engine=engine,
            record_routes=self.record_routes,
            limits=None if all(k is None for k in limits) else limits,
        )

    def _first_prompt(self, step: int, round: int) -> int:
        n = self.cfg.num_prompts
        if round == 0:
            return _first_group(n, step, self.dp_rank, self.per_rank)
        return extra_round_first_prompt(n, step, round, self.dp_rank, self.per_rank)

    def generator(self, step: int, round: int = 0) -> torch.Generator:
        """The CPU generator of round ``round`` of ``step`` on this DP rank: seeded from
        ``(seed, step, dp_rank, round)``, the same on every rank of the model replica."""
        key = f"{self.ctx.seed}/{step}/{self.dp_rank}"
        key += f"/{round}" if round else ""  # round 0 keeps the seeds of runs without extras
        return torch.Generator().manual_seed(random.Random(key).getrandbits(63))


def generated_rollouts(source: object) -> GeneratedRollouts | None:
    """The :class:`GeneratedRollouts` behind ``source`` (through wrappers that keep it as
    ``inner``, e.g. dynamic sampling), or None: its engine and scorer can be shared."""
    while source is not None:
        if isinstance(source, GeneratedRollouts):
            return source
        source = getattr(source, "inner", None)
    return None
