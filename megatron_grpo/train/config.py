"""The trainer's root config tree, ``TrainConfig``, one YAML section per dataclass.

Load with :func:`load_train_config` (YAML + ``--set a.b=value`` overrides); unknown keys raise a
:class:`~megatron_grpo.config.ConfigError` naming the closest valid key. ``model`` / ``parallel``
are the Megatron integration's sections, ``loss`` is :class:`GRPOLossConfig`; the sections defined
here are ``rollout``, ``optimizer`` (megatron-core ``OptimizerConfig`` field names), ``training``,
``checkpoint`` and ``logging``. Checks that span sections live in ``TrainConfig.__post_init__``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from megatron_grpo.config import (
    ConfigError,
    apply_overrides,
    check_positive,
    from_dict,
    load_yaml,
    rename_keys,
    to_dict,
)
from megatron_grpo.config.base import collect_errors, raise_collected, report
from megatron_grpo.convert.errors import ConversionError
from megatron_grpo.convert.hf_config import check_same_architecture
from megatron_grpo.convert.layout import MODEL_CONFIG_NAME, read_model_config
from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron.config import ModelConfig, ParallelConfig
from megatron_grpo.ops.options import LMHeadOptions
from megatron_grpo.rollout.engine_options import EngineOptions
from megatron_grpo.rollout.params import SamplingParams

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
# training.logprob_max_tokens_per_micro_batch "auto" for dense models: on one H200 the no-grad
# pass of a 0.6B model runs at 0.45-0.50 MFU at 32k tokens against 0.23-0.42 at 8k
# (tools/bench_train_passes.py); one layer's activations of 32k tokens stay small
LOGPROB_MERGE_TOKENS = 32768
# Extra rounds of a step draw prompts from a block of this many rounds (see dynamic_sampling).
MAX_EXTRA_ROUNDS = 1024


@dataclass
class FilterGroupsConfig:
    """Dynamic sampling (DAPO): train only on groups whose rewards differ.

    A group whose rewards are all equal has zero advantage: it costs generation and training and
    teaches nothing. With ``enabled``, such groups are dropped and further rounds of fresh prompts
    are generated until every DP rank has its ``num_prompts / DP`` informative groups, or
    ``max_extra_rounds`` extra rounds ran (then zero-variance groups fill the batch, so its size
    never changes). See ``megatron_grpo/train/dynamic_sampling.py``.

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
    """Partial rollouts (``train/partial.py``): keep the decode batch full across steps.

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
            once per sample, on one rank of each model replica (``train/scoring.py``).
        reward_workers: 0 = score in the trainer's process; N = in a pool of N spawned worker
            processes (created once, on the scoring ranks).
        reward_timeout_s: seconds one reward call may take (null = no limit); needs
            ``reward_workers`` >= 1 (code running in the trainer's process cannot be
            interrupted). A call past it scores ``reward_on_timeout`` and counts in
            ``reward/timeouts``.
        reward_on_timeout: the reward of a sample whose call timed out.
        source: where each step's scored rollouts come from (``train/rollout_source.py``):
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
    """Validation during training (``train/evaluation.py``): the policy answers the validation
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


@dataclass
class OptimizerConfig:
    """megatron-core ``OptimizerConfig`` fields plus the LR schedule (``OptimizerParamScheduler``).

    ``lr_warmup_steps`` and ``lr_decay_steps`` count optimizer steps (``training.steps *
    training.mini_batches_per_step`` in all; ``lr_decay_steps=None`` decays over all of them).
    """

    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    lr_warmup_steps: int = 0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_decay_steps: int | None = None

    def __post_init__(self) -> None:
        check_positive(self, "lr", "adam_eps", "lr_decay_steps")
        if not 0.0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        for name in ("weight_decay", "clip_grad", "lr_warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2", "sgd_momentum"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")


@dataclass
class TrainingConfig:
    """The loop.

    Attributes:
        steps: rollout steps (each: rollout, rewards, advantages, log-probs, policy update).
        mini_batches_per_step: optimizer steps per rollout batch (the batch is split in order).
        micro_batch_size: sequences per micro-batch, or ``max_tokens_per_micro_batch``: pack
            sequences up to this many tokens (exactly one of the two).
        advantage_estimator: ``grpo`` / ``dr_grpo`` / ``rloo`` (``loss.compute_advantages``).
        use_reference_model: keep a frozen copy of the initial policy for ``ref_logprobs`` (needed
            when ``loss.kl_coef > 0``; otherwise only the KL metric uses it).
        max_consecutive_nonfinite_skips: abort after this many optimizer steps in a row were
            skipped for a non-finite loss or gradient.
        log_mismatch_without_replay: with ``model.moe_enable_routing_replay``, also run the
            old-log-prob pass with live routing (one more no-grad forward of the policy per
            step) and log ``mismatch/k1_no_replay`` / ``mismatch/k3_no_replay``: the rollout
            mismatch of the same rollouts without replay, next to ``mismatch/k1`` / ``k3``.
        on_policy_shortcut: with ``mini_batches_per_step: 1`` the update is the only optimizer
            step on its rollouts, so the old policy is the current one: the no-grad
            old-log-prob pass is skipped and the loss uses the update's own log-probs, detached,
            as ``old_logprobs`` (ratio exactly 1; the gradients of the run with the pass, which
            computes the same log-probs). IS correction and ``mismatch/*`` then compare those
            with the rollout log-probs. The reference pass still runs with a reference model.
            Logged as ``perf/old_logprob_pass_skipped`` (1 or 0). False: always run the pass.
            Ignored with ``mini_batches_per_step > 1``, where the pass is always needed.
        logprob_max_tokens_per_micro_batch: the no-grad old / reference log-prob passes run
            consecutive update micro-batches merged into micro-batches of up to this many
            tokens (a no-grad forward keeps one layer's activations at a time, and the host's
            launch cost is per layer and micro-batch, so a larger one keeps the GPU busy); the
            log-probs are the same. "auto" (default): ``LOGPROB_MERGE_TOKENS`` (32768), except
            for MoE at ``parallel.expert_model_parallel_size > 1``: there every MoE forward is
            a collective over the expert-parallel ranks, which must then run the same number
            of forwards, and a token budget merges each rank's micro-batches differently; such
            passes run the update's micro-batches (and a number is a config error). null: the
            update's micro-batches.
        exit_signals: signals that stop the run cleanly (``train/stop.py``): every rank
            finishes the current step, saves a checkpoint (with ``checkpoint.dir``) and exits
            with code 3; a second signal exits at once. ``[]``: the signals' default actions.
        max_wall_minutes: stop the same way once the time since the process started plus the
            slowest step so far would exceed this many minutes (set it below the scheduler's
            limit by one checkpoint save); null = no limit.
    """

    steps: int = 100
    seed: int = 1234
    mini_batches_per_step: int = 1
    micro_batch_size: int | None = 16
    max_tokens_per_micro_batch: int | None = None
    logprob_max_tokens_per_micro_batch: int | Literal["auto"] | None = "auto"
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    use_reference_model: bool = False
    max_consecutive_nonfinite_skips: int = 3
    log_mismatch_without_replay: bool = False
    on_policy_shortcut: bool = True
    exit_signals: list[
        Literal["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGXCPU"]
    ] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    max_wall_minutes: float | None = None

    def __post_init__(self) -> None:
        check_positive(self, "steps", "mini_batches_per_step", "max_consecutive_nonfinite_skips")
        check_positive(self, "max_wall_minutes")
        repeated = sorted({s for s in self.exit_signals if self.exit_signals.count(s) > 1})
        if repeated:
            raise ValueError(f"exit_signals lists {', '.join(repeated)} more than once")
        check_positive(self, "micro_batch_size", "max_tokens_per_micro_batch")
        if self.logprob_max_tokens_per_micro_batch != "auto":
            check_positive(self, "logprob_max_tokens_per_micro_batch")
        if (self.micro_batch_size is None) == (self.max_tokens_per_micro_batch is None):
            raise ValueError(
                "set exactly one of micro_batch_size and max_tokens_per_micro_batch, got "
                f"{self.micro_batch_size} and {self.max_tokens_per_micro_batch}"
            )


@dataclass
class CheckpointConfig:
    """dist_checkpointing saves of model, optimizer, RNG states, step and data position.

    Attributes:
        dir: checkpoint root; ``dir/step_N`` per save and a ``dir/latest`` pointer file.
        save_interval: save every N steps (and after the last step); 0 = only after the last.
        keep_last: how many ``step_N`` directories to keep.
        load: start from the model weights of this dist_checkpointing directory (one of ours, or
            one written by ``tools/convert_checkpoint.py``); ignored when ``--resume`` finds a
            checkpoint in ``dir``. A recipe without a ``model`` section takes it from the
            converted directory's ``model_config.yaml`` (see :func:`load_train_config`).
    """

    dir: str | None = None
    save_interval: int = 0
    keep_last: int = 2
    load: str | None = None

    def __post_init__(self) -> None:
        if self.save_interval < 0:
            raise ValueError(f"save_interval must be >= 0, got {self.save_interval}")
        check_positive(self, "keep_last")
        # "" would mean the current directory, where pruning would then run.
        check_not_empty(self, "dir", "null disables checkpoints")
        check_not_empty(self, "load", "null starts from a fresh initialization")


@dataclass
class LoggingConfig:
    """Where the run's resolved config and metrics go.

    ``dir/config.yaml`` (the resolved config) and one JSON line of metrics per step in
    ``jsonl_path`` (default ``dir/metrics.jsonl``). ``tensorboard_dir`` needs the ``tensorboard``
    package. ``progress_bar``: a one-line status per step on rank 0, redrawn in place and fitted
    to the terminal's width. ``print_interval``: when stdout is not a terminal (a log file, a
    pipe), the status is one plain line every ``print_interval`` steps (and the first and last).
    Megatron-core's and torch's warnings go to ``dir/warnings.log`` (a count on the console).
    """

    dir: str = "runs/default"
    jsonl_path: str | None = None
    tensorboard_dir: str | None = None
    progress_bar: bool = True
    print_interval: int = 10

    def __post_init__(self) -> None:
        if self.print_interval < 1:
            raise ValueError(f"print_interval must be >= 1, got {self.print_interval}")
        check_not_empty(self, "dir", "e.g. runs/my_run")
        check_not_empty(self, "jsonl_path", "null writes dir/metrics.jsonl")
        check_not_empty(self, "tensorboard_dir", "null disables TensorBoard")

    @property
    def metrics_path(self) -> Path:
        return Path(self.jsonl_path) if self.jsonl_path else Path(self.dir) / "metrics.jsonl"


def check_not_empty(obj: object, name: str, hint: str) -> None:
    """An empty path string (``--set checkpoint.dir=``) is an error, not the current directory."""
    value = getattr(obj, name)
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"{name} is an empty path ({hint})")


def _default_model() -> ModelConfig:
    # The toy task's vocabulary; real models set their own.
    return ModelConfig(vocab_size=16)


@dataclass
class TrainConfig:
    """Root of a recipe: ``model, parallel, loss, rollout, evaluation, optimizer, training,
    lm_head, checkpoint, logging``.

    ``lm_head`` is :class:`~megatron_grpo.ops.LMHeadOptions` itself: how the last stage turns
    hidden states into log-probs and the loss. ``path``: null / ``fused`` (LM head + GRPO loss
    in one vocab pass; the plan picks the fused kernel), ``op`` (vocab_parallel_logprobs, then
    grpo_loss), ``megatron`` (Megatron's output_layer + vocab_parallel_cross_entropy on
    materialized [T, V/TP] logits: the baseline), or ``fused_tiled`` / ``fused_single_pass``
    (token ratio only) by name; ``impl``, ``gemm``, ``memory_budget`` (bytes of the LM head's
    working set: larger = larger logits tiles, faster; null = 1 GiB) and ``chunk_size``. Its
    temperature is ``rollout.sampling.temperature`` and its vocabulary the model's."""

    model: ModelConfig = field(default_factory=_default_model)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    lm_head: LMHeadOptions = field(default_factory=LMHeadOptions)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        if self.loss.kl_coef > 0 and not self.training.use_reference_model:
            raise ValueError("loss.kl_coef > 0 needs training.use_reference_model: true")
        if (
            self.training.logprob_max_tokens_per_micro_batch not in (None, "auto")
            and self._moe_forwards_are_collective
        ):
            raise ValueError(
                "training.logprob_max_tokens_per_micro_batch needs "
                "parallel.expert_model_parallel_size=1 for MoE: at EP > 1 MoE log-prob passes "
                "are collectives over the expert-parallel ranks that must run the update's "
                "micro-batches"
            )
        if self.training.log_mismatch_without_replay and not self.model.moe_enable_routing_replay:
            raise ValueError(
                "training.log_mismatch_without_replay needs model.moe_enable_routing_replay: true"
            )
        samples = self.rollout.num_prompts * self.rollout.group_size
        if samples % self.training.mini_batches_per_step:
            raise ValueError(
                f"training.mini_batches_per_step={self.training.mini_batches_per_step} must "
                f"divide rollout.num_prompts * rollout.group_size = {samples}"
            )
        total = self.rollout.max_prompt_length + self.rollout.max_response_length
        if total > self.model.max_sequence_length:
            raise ValueError(
                f"rollout.max_prompt_length + rollout.max_response_length = {total} exceeds "
                f"model.max_sequence_length = {self.model.max_sequence_length}"
            )
        self._check_evaluation()
        p = self.rollout.partial
        if p.enabled and p.max_staleness > 0 and self.loss.is_correction_level is None:
            raise ValueError(
                f"rollout.partial.max_staleness={p.max_staleness} trains on tokens of older "
                "policy versions: set loss.is_correction_level (token, sequence or "
                "sequence_mean: the decoupled IS correction behaviour -> proximal policy)"
            )

    def _check_evaluation(self) -> None:
        """Evaluation generates with the policy from the dataset task's validation prompts."""
        e, r = self.evaluation, self.rollout
        if not e.enabled:
            return
        on = f"evaluation.interval={e.interval}"
        if r.task != "dataset":
            raise ValueError(
                f"{on} evaluates on validation prompts: it needs rollout.task: dataset with "
                f"rollout.dataset.val_files (rollout.task is {r.task!r})"
            )
        if not r.dataset.val_files:
            raise ValueError(
                f"{on} needs validation prompts: rollout.dataset.val_files is empty (or set "
                "evaluation.interval: 0)"
            )
        p = self.parallel
        if p.pipeline_model_parallel_size > 1 or p.context_parallel_size > 1:
            raise ValueError(
                f"{on} generates with the policy, which needs "
                "parallel.pipeline_model_parallel_size = 1 and parallel.context_parallel_size = 1"
            )

    @property
    def optimizer_steps(self) -> int:
        return self.training.steps * self.training.mini_batches_per_step

    @property
    def logprob_merge_tokens(self) -> int | None:
        """What the log-prob passes merge micro-batches up to (None: they don't), with
        ``training.logprob_max_tokens_per_micro_batch`` "auto" resolved for this model."""
        merge = self.training.logprob_max_tokens_per_micro_batch
        if merge == "auto":
            return None if self._moe_forwards_are_collective else LOGPROB_MERGE_TOKENS
        return merge

    @property
    def _moe_forwards_are_collective(self) -> bool:
        """Whether every MoE forward is a collective over ranks with different batches (EP)."""
        moe = self.model.num_moe_experts is not None
        return moe and self.parallel.expert_model_parallel_size > 1


# Keys moved into rollout.sampling / rollout.engine (kept for one release, with a warning).
_MOVED = {
    "sampling": "temperature top_p top_k stop_ids".split(),
    "engine": "kv_cache_gib kv_cache_fraction cuda_graphs max_prefill_tokens context_bucket "
    "decode_path".split(),
}
RENAMED_KEYS = {
    "rollout.engine": "rollout.engine.kind",  # `engine: recompute`; first: the others move below it
    "training.logprob_path": "lm_head.path",
    "training.lm_head_memory_budget": "lm_head.memory_budget",
    **{f"rollout.{key}": f"rollout.{sec}.{key}" for sec, keys in _MOVED.items() for key in keys},
}


def load_train_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """``TrainConfig`` from a YAML recipe plus ``a.b=value`` overrides (validated). Every
    mistake is collected (``config.base.collect_errors``) and raised as one ConfigError, each
    on its own line led by the recipe's ``FILE:LINE`` (one mistake: that line alone).

    A key of :data:`RENAMED_KEYS` (in the YAML or an override) moves to its new path with a
    deprecation warning naming it; the old and the new key both set is a ConfigError.

    When the recipe has no ``model`` section and ``checkpoint.load`` is set, the model section is
    ``checkpoint.load``'s ``model_config.yaml`` (written by ``tools/convert_checkpoint.py``), with
    any ``--set model.X=...`` applied on top. Whenever that file exists, the resolved model must
    have its architecture (a ConfigError names the field): matching shapes alone would load a
    checkpoint into, e.g., a model with another rotary base without any error.
    """
    data = _load_yaml(path) if path is not None else {}
    with collect_errors() as errors:  # every mistake of the recipe, each with its line
        try:
            cfg = _train_config(data, overrides)
        except ConfigError as e:  # one that stops the build (e.g. no model section)
            report(e)
    raise_collected(errors, path, overrides)
    return cfg


def _train_config(data: dict, overrides: Sequence[str]) -> TrainConfig:
    model_from_checkpoint = "model" not in data
    overrides = rename_keys(data, overrides, RENAMED_KEYS)
    apply_overrides(data, overrides, root=TrainConfig)
    load = (data.get("checkpoint") or {}).get("load")
    stored = _stored_model(str(load)) if isinstance(load, str) else None
    if model_from_checkpoint and isinstance(load, str):
        if stored is None:
            raise ConfigError(
                f"model: the recipe has no model section and checkpoint.load={load!r} has no "
                f"{MODEL_CONFIG_NAME} (tools/convert_checkpoint.py writes one); add a model "
                "section"
            )
        data["model"] = {**to_dict(stored), **(data.get("model") or {})}
    cfg = from_dict(TrainConfig, data)
    if stored is not None:
        check_checkpoint_architecture(cfg.model, str(load), stored)
    return cfg


def _load_yaml(path: str | Path) -> dict:
    """``load_yaml`` with syntax errors as a ConfigError naming the file, line and column."""
    try:
        return load_yaml(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from None


def check_checkpoint_architecture(
    model: ModelConfig, ckpt_dir: str, stored: ModelConfig | None = None
) -> None:
    """Raise a ConfigError naming the field when ``ckpt_dir``'s ``model_config.yaml`` (if any)
    describes another architecture than ``model``."""
    stored = stored if stored is not None else _stored_model(ckpt_dir)
    if stored is None:
        return
    try:
        check_same_architecture(stored, model, "model")
    except ConversionError as e:
        raise ConfigError(f"{e} (in {Path(ckpt_dir) / MODEL_CONFIG_NAME})") from e


def _stored_model(load: str) -> ModelConfig | None:
    """The ModelConfig saved next to a converted checkpoint, or None when there is none."""
    path = Path(load) / MODEL_CONFIG_NAME
    if not path.is_file():
        return None
    try:
        return read_model_config(path)
    except ConversionError as e:
        raise ConfigError(f"checkpoint.load: {e}") from e
