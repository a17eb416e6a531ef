"""The ``rollout:`` and ``evaluation:`` recipe sections: what each step generates (or reads), how
it is scored, dynamic sampling, partial rollouts and validation.

The task sections (``rollout.reverse_digits`` / ``math`` / ``dataset``, read by ``tasks/``) are
here too; the sampling and engine sections are the engine's
(:class:`~megatron_grpo.rollout.SamplingParams`, :class:`~megatron_grpo.rollout.EngineOptions`).
Checks that span the root's sections (the model's
sequence length, the loss's IS correction, the parallel sizes evaluation needs) stay in
``TrainConfig.__post_init__``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_grpo.config import check_positive
from megatron_grpo.rollout.engine.options import EngineOptions
from megatron_grpo.rollout.engine.params import SamplingParams
from megatron_grpo.rollout.placement import ColocatedConfig, Placement, SeparateConfig

TaskName = Literal["reverse_digits", "math", "dataset"]
# rollout.reward_fn names usable without a module (tasks/verifiers.py's VERIFIERS).
BUILTIN_VERIFIERS = ("exact_match", "math")


@dataclass
class ReverseDigitsConfig:
    """The toy task: ``<bos> d1 .. dk =`` -> ``dk .. d1 <eos>`` (see ``tasks/reverse_digits.py``).

    ``num_digits``: k, an int, or ``[lo, hi]``: k drawn per prompt log-uniformly in
    ``[lo, hi]`` (from the prompt's seed), and each response cut at its answer's k + 1 tokens,
    so response lengths are long-tailed (the partial-rollout benchmark's task). The reward is
    the fraction of the k + 1 target tokens (digits, then ``<eos>``) that the response matches
    position by position.
    """

    num_digits: int | list[int] = 3

    def __post_init__(self) -> None:
        k = self.num_digits
        if isinstance(k, list):
            if len(k) != 2 or not 0 < k[0] <= k[1]:
                raise ValueError(
                    f"num_digits must be an int or [lo, hi] with 0 < lo <= hi, got {k}"
                )
        else:
            check_positive(self, "num_digits")

    @property
    def max_digits(self) -> int:
        return self.num_digits[1] if isinstance(self.num_digits, list) else self.num_digits


@dataclass
class MathTaskConfig:
    """A local JSONL of ``{"prompt": ..., "answer": ...}`` rows with a local HF tokenizer.

    ``tokenizer_dir`` is loaded with ``AutoTokenizer.from_pretrained`` from disk only (never a hub
    download). ``prompt_template`` wraps each prompt (``{prompt}`` is replaced). The built-in
    reward is 1.0 when the last number in the response equals the answer, else 0.0.
    """

    data_path: str = ""
    tokenizer_dir: str = ""
    prompt_template: str = "{prompt}"


DATASET_SUFFIXES = (".jsonl", ".parquet")


@dataclass
class DatasetConfig:
    """Prompts from ``.jsonl`` / ``.parquet`` files in verl's layout (``tasks/dataset.py``).

    A row holds ``prompt`` (a string, or a list of ``{"role", "content"}`` messages) and its
    ground truth, ``reward_model.ground_truth`` (verl) or ``answer`` (plain JSONL), with optional
    ``data_source`` (a string) and ``extra_info`` (a JSON object). Everything is read, templated,
    tokenized and checked at start-up; errors name the file, row and column.

    Attributes:
        train_files: the training prompts (files in this order; visited in a seeded
            permutation per epoch).
        val_files: validation prompts, loaded and checked the same way (``task.val_prompts()``).
        prompt_key: the column holding the prompt.
        tokenizer_dir: HF tokenizer files (``AutoTokenizer.from_pretrained``, local only); a
            ``generation_config.json`` there adds its ``eos_token_id`` (an id or a list) to the
            ids that end a response.
        chat_template: ``auto`` (apply the tokenizer's template when it has one; a message-list
            prompt without one is an error), ``true`` (always; a string prompt becomes one user
            message) or ``false`` (raw text; message-list prompts are an error).
        add_generation_prompt: end the templated prompt with the assistant turn's header.
        filter_overlong_prompts: drop prompts longer than ``rollout.max_prompt_length`` tokens
            (after the template) at load, reported once with their files and rows; false: such
            a prompt is a start-up error.
    """

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    tokenizer_dir: str = ""
    chat_template: bool | str = "auto"  # "auto", true or false (checked below)
    add_generation_prompt: bool = True
    filter_overlong_prompts: bool = True

    def __post_init__(self) -> None:
        for name in ("train_files", "val_files"):
            for i, path in enumerate(getattr(self, name)):
                if not path.endswith(DATASET_SUFFIXES):
                    raise ValueError(f"{name}[{i}]: {path!r} must end in .jsonl or .parquet")
        if not self.prompt_key:
            raise ValueError("prompt_key must not be empty")
        if self.chat_template not in ("auto", True, False):
            raise ValueError(
                f"chat_template must be auto, true or false, got {self.chat_template!r}"
            )


# rollout.source values besides "module:Class" / "path/to/file.py:Class".
ROLLOUT_SOURCES = ("generate", "files")
# Extra rounds of a step draw prompts from a block of this many rounds (see dynamic_sampling).
MAX_EXTRA_ROUNDS = 1024


@dataclass
class FilterGroupsConfig:
    """Dynamic sampling (DAPO): train only on groups whose rewards differ.

    A group whose rewards are all equal has zero advantage: it costs generation and training and
    teaches nothing. With ``enabled``, such groups are dropped and further rounds of fresh prompts
    are generated until every DP rank has its ``num_prompts / DP`` informative groups, or
    ``max_extra_rounds`` extra rounds ran (then zero-variance groups fill the batch, so its size
    never changes). See ``megatron_grpo/rollout/dynamic_sampling.py``.

    Attributes:
        enabled: off by default.
        reward_tolerance: a group is informative when the spread (max - min) of its rewards is
            greater than this, counting only samples that have loss (response) tokens.
        max_extra_rounds: generation rounds after the first one, at most; 0 drops nothing (the
            batch is the unfiltered one) but logs the group counts.
        round_size: prompts of an extra round: ``full`` (``num_prompts``, as DAPO) or
            ``shortfall`` (only as many as the missing groups need at the step's informative
            rate so far: fewer generated tokens, possibly more rounds).
    """

    enabled: bool = False
    reward_tolerance: float = 1e-6
    max_extra_rounds: int = 4
    round_size: Literal["full", "shortfall"] = "full"

    def __post_init__(self) -> None:
        if not 0.0 <= self.reward_tolerance < float("inf"):
            raise ValueError(
                f"reward_tolerance must be a finite number >= 0, got {self.reward_tolerance}"
            )
        if not 0 <= self.max_extra_rounds <= MAX_EXTRA_ROUNDS:
            raise ValueError(
                f"max_extra_rounds must be in [0, {MAX_EXTRA_ROUNDS}], got {self.max_extra_rounds}"
            )


@dataclass
class PartialConfig:
    """Partial rollouts (``rollout/partial.py``): keep the decode batch full across steps.

    Attributes:
        enabled: off by default (every step generates its prompts to the end).
        over_provision: prompt groups beyond ``num_prompts`` kept in flight, as a fraction of
            it (0.5 = 50% more). A step ends as soon as ``num_prompts`` whole groups finished;
            the unfinished requests are paused and continue next step under the new weights.
        max_staleness: policy versions (training steps) a token may lag behind the step that
            trains on it; a group that would exceed it is dropped (``rollout/partial_dropped``).
            0 needs ``over_provision: 0`` (then nothing is ever carried: synchronous).
        kv: a paused request's KV cache across the update: ``recompute`` (default: prefilled
            again under the new weights, so every token's behaviour log-prob is exactly the
            policy version that sampled it) or ``keep`` (the cached rows are copied to host
            memory and back: no re-prefill, but tokens after the update attend to keys of the
            old weights, so their log-probs belong to no single policy version).
    """

    enabled: bool = False
    over_provision: float = 0.5
    max_staleness: int = 1
    kv: Literal["keep", "recompute"] = "recompute"

    def __post_init__(self) -> None:
        if not 0.0 <= self.over_provision < float("inf"):
            raise ValueError(
                f"over_provision must be a finite number >= 0, got {self.over_provision}"
            )
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.enabled and self.max_staleness == 0 and self.over_provision > 0:
            raise ValueError(
                f"max_staleness: 0 drops every carried group, so over_provision="
                f"{self.over_provision} would train only on the groups that finish first (the "
                "short responses); set over_provision: 0 or max_staleness >= 1"
            )


@dataclass
class RolloutConfig:
    """What each step generates (or reads) and how it is scored.

    Attributes:
        num_prompts: prompts per training step, over all data-parallel ranks.
        group_size: G samples per prompt (one advantage group).
        max_prompt_length / max_response_length: in tokens; longer prompts are an error (task
            ``dataset``: dropped at load, see ``dataset.filter_overlong_prompts``), responses
            stop at ``<eos>`` or at ``max_response_length``.
        sampling: how each response token is drawn (:class:`~megatron_grpo.rollout.SamplingParams`:
            ``temperature``, ``top_p``, ``top_k``, ``stop_ids``, ``ignore_eos``); the response
            limit is ``max_response_length``, the eos id the task's, the vocabulary the model's.
        engine: how the policy generates (:class:`~megatron_grpo.rollout.EngineOptions`):
            ``kind`` ``kv_cache`` (the KV-cached engine, with the section's cache, CUDA-graph
            and decode options) or ``recompute`` (no cache; the reference).
        task: ``reverse_digits`` (toy, built-in tokenizer), ``math`` (local JSONL + HF tokenizer)
            or ``dataset`` (``.jsonl`` / ``.parquet`` files in verl's layout, chat templates:
            :class:`DatasetConfig`, the ``dataset`` section).
        reward_fn: optional reward replacing the task's: ``"pkg.module:function"``,
            ``"path/to/file.py:function"`` or a built-in verifier, ``exact_match`` or ``math``
            (``tasks/verifiers.py``). Called with verl's keywords when it takes them
            (``data_source``, ``solution_str``, ``ground_truth``, ``extra_info``), else as
            ``fn(prompt, response, answer)`` with strings; returns a number, a bool or a dict
            with ``score`` plus extra numbers (logged as ``reward/<key>``). Rewards are scored
            once per sample, on one rank of each model replica (``rollout/scoring.py``).
        reward_workers: 0 = score in the trainer's process; N = in a pool of N spawned worker
            processes (created once, on the scoring ranks).
        reward_timeout_s: seconds one reward call may take (null = no limit); needs
            ``reward_workers`` >= 1 (code running in the trainer's process cannot be
            interrupted). A call past it scores ``reward_on_timeout`` and counts in
            ``reward/timeouts``.
        reward_on_timeout: the reward of a sample whose call timed out.
        source: where each step's scored rollouts come from (``rollout/source.py``):
            ``generate`` (the policy samples the task's prompts, the reward scores them),
            ``files`` (read from ``input_path``) or a class implementing the ``RolloutSource``
            protocol, ``"pkg.module:Class"`` or ``"path/to/file.py:Class"``, constructed once as
            ``Class(cfg, task, model, dp_rank, dp_size)`` (multi-turn / tool-calling
            environments, external engines). null (default): ``files`` when ``input_path`` is
            set, else ``generate``; a source that contradicts ``input_path`` is an error.
        input_path: train on rollouts from a file (``.jsonl`` / ``.parquet``) or a directory of
            them instead of generating; each step consumes the next ``num_prompts`` groups (the
            sampling and engine fields are then unused; the files must carry ``reward``).
        output_dir: write each step's rollouts to ``output_dir/rollouts_step{N:08d}_dp{d:04d}.{fmt}``
            (one file per step and data-parallel rank; e.g. ``rollouts_step00000001_dp0000.jsonl``).
        filter_groups: dynamic sampling (:class:`FilterGroupsConfig`); needs generation.
        partial: partial rollouts across steps (:class:`PartialConfig`); needs generation.
        placement: ``colocated`` (default: every rank generates, then every rank trains;
            ``colocated``: :class:`ColocatedConfig`, on which weights) or ``separate``
            (generation on ranks of its own, ``separate``: :class:`SeparateConfig`; weights
            streamed after every update, bounded staleness).
    """

    num_prompts: int = 16
    group_size: int = 8
    max_prompt_length: int = 256
    max_response_length: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    engine: EngineOptions = field(default_factory=EngineOptions)
    task: TaskName = "reverse_digits"
    reverse_digits: ReverseDigitsConfig = field(default_factory=ReverseDigitsConfig)
    math: MathTaskConfig = field(default_factory=MathTaskConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    reward_fn: str | None = None
    reward_workers: int = 0
    reward_timeout_s: float | None = None
    reward_on_timeout: float = 0.0
    source: str | None = None  # generate | files | "module:Class"; null: from input_path
    input_path: str | None = None
    output_dir: str | None = None
    output_format: Literal["jsonl", "parquet"] = "jsonl"
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    partial: PartialConfig = field(default_factory=PartialConfig)
    placement: Placement = "colocated"
    colocated: ColocatedConfig = field(default_factory=ColocatedConfig)
    separate: SeparateConfig = field(default_factory=SeparateConfig)

    def __post_init__(self) -> None:
        check_positive(self, "num_prompts", "max_prompt_length", "max_response_length")
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (GRPO compares samples), got {self.group_size}"
            )
        if (
            self.reward_fn is not None
            and ":" not in self.reward_fn
            and self.reward_fn not in BUILTIN_VERIFIERS
        ):
            raise ValueError(
                "reward_fn must look like 'pkg.module:function', 'path/to/file.py:function' or "
                f"name a built-in verifier ({', '.join(BUILTIN_VERIFIERS)}), got {self.reward_fn!r}"
            )
        if self.reward_workers < 0:
            raise ValueError(
                f"reward_workers must be >= 0 (0 = in-process), got {self.reward_workers}"
            )
        if self.reward_timeout_s is not None:
            if not self.reward_timeout_s > 0:
                raise ValueError(
                    f"reward_timeout_s must be > 0 (or null: no limit), got {self.reward_timeout_s}"
                )
            if self.reward_workers == 0:
                raise ValueError(
                    f"reward_timeout_s={self.reward_timeout_s} needs reward_workers >= 1: a reward "
                    "running in the trainer's process (reward_workers: 0) cannot be interrupted"
                )
        if not float("-inf") < self.reward_on_timeout < float("inf"):  # not NaN or inf
            raise ValueError(f"reward_on_timeout must be finite, got {self.reward_on_timeout}")
        if self.task == "math" and self.input_path is None:
            for name in ("data_path", "tokenizer_dir"):
                if not getattr(self.math, name):
                    raise ValueError(f"math.{name} is required when task is 'math'")
        if self.task == "dataset" and self.input_path is None:
            for name in ("train_files", "tokenizer_dir"):
                if not getattr(self.dataset, name):
                    raise ValueError(f"dataset.{name} is required when task is 'dataset'")
        self._check_source()
        if self.filter_groups.enabled and self.input_path is not None:
            raise ValueError(
                "filter_groups.enabled needs generated rollouts (dropped groups are replaced by "
                "new generations); with input_path, filter the files when writing them"
            )
        if self.partial.enabled and self.source != "generate":
            raise ValueError(
                f"partial.enabled needs source: generate (the policy's own engine pauses and "
                f"resumes requests), got source: {self.source}"
            )
        if self.partial.enabled and self.engine.kind != "kv_cache":
            raise ValueError(
                "partial.enabled needs engine.kind: kv_cache (the recompute engine cannot pause "
                "requests)"
            )

        self._check_placement()

    def _check_placement(self) -> None:
        """What each placement does not combine with yet (each names its field)."""
        if self.colocated.weights == "replica":
            self._check_replica()
        if self.placement != "separate":
            return
        if self.source != "generate":
            raise ValueError(
                f"placement: separate generates on its own ranks: it needs source: generate, "
                f"got source: {self.source}"
            )
        if self.partial.enabled:
            raise ValueError(
                "partial.enabled is not supported with placement: separate yet (the "
                "generation ranks keep their decode batch full by running ahead instead)"
            )
        s = self.separate
        if s.in_flight_updates and s.max_staleness == 0:
            raise ValueError(
                "separate.in_flight_updates: true needs separate.max_staleness >= 1 (at 0 the "
                "trainer waits for each unit: no newer version exists while one is generated)"
            )
        if s.in_flight_updates and self.engine.kind != "kv_cache":
            raise ValueError(
                "separate.in_flight_updates: true pauses requests between engine steps: it needs "
                f"engine.kind: kv_cache, got engine.kind: {self.engine.kind}"
            )

    def _check_replica(self) -> None:
        """``colocated.weights: replica``: generated rollouts from the KV-cached engine, on the
        trainer's ranks (partial rollouts: each rank a stream of its own, ``rollout/partial.py``)."""
        needs = {
            "placement: colocated": self.placement == "colocated",
            "source: generate": self.source == "generate",
            "engine.kind: kv_cache": self.engine.kind == "kv_cache",
        }
        for what, ok in needs.items():
            if not ok:
                raise ValueError(f"colocated.weights: replica needs {what}")

    def _check_source(self) -> None:
        """Resolve ``source: null`` from ``input_path``; a contradiction names both fields."""
        if self.source is None:
            self.source = "files" if self.input_path is not None else "generate"
        if self.source not in ROLLOUT_SOURCES and ":" not in self.source:
            raise ValueError(
                "source must be generate, files, 'pkg.module:Class' or 'path/to/file.py:Class', "
                f"got {self.source!r}"
            )
        if self.source == "files" and self.input_path is None:
            raise ValueError("source: files needs input_path (the rollout files to read)")
        if self.source != "files" and self.input_path is not None:
            raise ValueError(
                f"source: {self.source} contradicts input_path={self.input_path!r} (rollout files "
                "are read by source: files; drop one of the two)"
            )


@dataclass
class EvaluationConfig:
    """Validation during training (``rollout/evaluation.py``): the policy answers the validation
    prompts (``task.val_prompts()``: ``rollout.dataset.val_files``), scored by the same reward
    as training (once per model replica), the prompts spread over the DP ranks.

    Evaluates before the first step (logged as step 0), after every ``interval`` steps and after
    the last step. Logs ``eval/reward_mean``, ``eval/pass_at_1``, ``eval/pass_at_{n}`` (with
    ``n_samples`` > 1), ``eval/response_length`` and, per ``data_source``, the same under
    ``eval/<data_source>/``; a sample passes when its reward is >= 1.0.

    Attributes:
        interval: evaluate every this many steps; 0 = off.
        n_samples: responses per prompt (``pass_at_1`` is the mean fraction that pass,
            ``pass_at_{n}`` the fraction of prompts with at least one that passes).
        temperature: sampling temperature of the responses; 0 = greedy (top-k 1). Otherwise
            plain sampling (no top-p / top-k). ``max_response_length`` and the stop ids are
            ``rollout``'s.
        max_prompts: evaluate on the first this many validation prompts (file order); null = all.
    """

    interval: int = 0
    n_samples: int = 1
    temperature: float = 0.0
    max_prompts: int | None = None

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"interval must be >= 0 (0 = off), got {self.interval}")
        check_positive(self, "n_samples", "max_prompts")
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature == 0.0 and self.n_samples > 1:
            raise ValueError(
                f"n_samples={self.n_samples} needs temperature > 0: temperature 0 is greedy, "
                "every sample of a prompt would be the same response"
            )

    @property
    def enabled(self) -> bool:
        return self.interval > 0
