"""The trainer's root config tree, ``TrainConfig``, one YAML section per dataclass.

Load with :func:`load_train_config` (YAML + ``--set a.b=value`` overrides); unknown keys raise a
:class:`~megatron_grpo.config.ConfigError` naming the closest valid key. ``model`` / ``parallel``
are the Megatron integration's sections, ``loss`` is :class:`GRPOLossConfig`, ``rollout`` and
``evaluation`` the rollout wing's (``megatron_grpo/rollout/config.py``); the sections defined here
are ``optimizer`` (megatron-core ``OptimizerConfig`` field names), ``training``, ``checkpoint``
and ``logging``. Checks that span sections live in ``TrainConfig.__post_init__``; the rollout
wing gets what it needs of the others as a :class:`RolloutContext` (``rollout_context``)."""

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
from megatron_grpo.config.base import collect_errors, report
from megatron_grpo.config.recipe_lines import raise_collected
from megatron_grpo.convert.layout import (
    MODEL_CONFIG_NAME,
    check_checkpoint_architecture,
    stored_model_config,
)
from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron.config import ModelConfig, ParallelConfig
from megatron_grpo.ops.lm_head.options import LMHeadOptions
from megatron_grpo.rollout.config import EvaluationConfig, RolloutConfig
from megatron_grpo.rollout.context import RolloutContext
from megatron_grpo.train.layout_checks import (
    STALE_NEEDS_IS,
    check_evaluation,
    check_separate,
    check_tp_collectives,
)
from megatron_grpo.train.logprob_sizes import (  # noqa: F401 (LOGPROB_MERGE_TOKENS: public here)
    LOGPROB_MERGE_TOKENS,
    MERGE_NEEDS_ALLTOALL,
    LogprobPassSizes,
)


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
            log-probs are the same. "auto" (default): ``LOGPROB_MERGE_TOKENS`` (32768). MoE at
            ``parallel.expert_model_parallel_size > 1`` (every MoE forward a collective over
            the expert-parallel ranks) merges too: the ranks agree on the number of forwards by
            one all-reduce, and a rank with fewer runs extra ones; except under dispatches
            needing equal tokens per forward (allgather, the CPU default; gathered) with the
            expert group across TP groups: "auto" then keeps the update's micro-batches and a
            number is a config error. null: the update's micro-batches.
        logprob_cuda_graphs: the no-grad log-prob passes replay a captured CUDA graph of the
            decoder per micro-batch shape (``megatron/step/logprob_graphs.py``: micro-batches
            padded to a few shapes, captured once per shape and pass, the LM head eager; the
            same log-probs as eager on one H200). null (default): where they can run (one
            pipeline stage, no CP, 'varlen' attention, 16-bit, MoE without host syncs,
            no hidden dropout) and either EP > 1 (the expert group's ranks wait for each
            other's host at every dispatch: measured ahead) or TP = 1 and a forward of
            ``logprob_pass_tokens`` host-bound by an estimate (``megatron/step/
            graph_plan.py``); off for dense models at TP > 1 (not measured). Said at start-up
            with the reason. true: on wherever they can run (an error elsewhere); false: off.
        update_cuda_graphs: the update's forward and backward replay captured CUDA graphs per
            micro-batch shape (``megatron/step/update_graphs.py``: the backward graph adds the
            gradients to megatron-core's DDP ``main_grad``; the LM head and loss eager). null
            (default), true and false as ``logprob_cuda_graphs``, for a micro-batch of
            ``update_pass_tokens``; they also need no activation recompute, dropout or MoE
            aux / z losses. Auto leaves them off when ``offload_during_rollout`` is on (it
            moves the gradient buffers, so each step would capture again).
        exit_signals: signals that stop the run cleanly (``train/stop.py``): every rank
            finishes the current step, saves a checkpoint (with ``checkpoint.dir``) and exits
            with code 3; a second signal exits at once. ``[]``: the signals' default actions.
        max_wall_minutes: stop the same way once the time since the process started plus the
            slowest step so far would exceed this many minutes (set it below the scheduler's
            limit by one checkpoint save); null = no limit.
        offload_during_rollout: move the optimizer state and the main gradients to pinned host
            memory while the policy generates, so the KV cache can use their device memory
            (``train/offload.py``; bit-exact; logged as ``perf/offload_seconds``). "auto"
            (default): on when the step's samples would not all get a cache slot otherwise
            (from the memory plan; the start-up line says which and why; left off, measured
            again before each rollout and on from the first step that falls short, in one
            line); needs generated rollouts.
    """

    steps: int = 100
    seed: int = 1234
    mini_batches_per_step: int = 1
    micro_batch_size: int | None = 16
    max_tokens_per_micro_batch: int | None = None
    logprob_max_tokens_per_micro_batch: int | Literal["auto"] | None = "auto"
    logprob_cuda_graphs: bool | None = None
    update_cuda_graphs: bool | None = None
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    use_reference_model: bool = False
    max_consecutive_nonfinite_skips: int = 3
    log_mismatch_without_replay: bool = False
    on_policy_shortcut: bool = True
    exit_signals: list[
        Literal["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGXCPU"]
    ] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    max_wall_minutes: float | None = None
    offload_during_rollout: bool | Literal["auto"] = "auto"

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

    ``dir/config.yaml`` (the resolved config), a JSON line of metrics a step in ``jsonl_path``
    (default ``dir/metrics.jsonl``). ``tensorboard_dir`` needs ``tensorboard``. ``progress_bar``:
    a one-line status per step on rank 0, redrawn in place, fitted to the terminal. When stdout
    is no terminal, the status is one line every ``print_interval`` steps (and first and last).
    Megatron-core's and torch's warnings go to ``dir/warnings.log`` (a count on the console).
    ``profile_step_start`` .. ``profile_step_end`` (1-based steps, inclusive; end default: the
    start; Megatron-LM's names): those steps run under torch.profiler on the global ranks
    ``profile_ranks``, each writing a trace and a device-time table to ``dir/profile/``
    (``megatron_grpo/profiling.py``); ``profile_with_stack``: with Python stacks in the trace.
    """

    dir: str = "runs/default"
    jsonl_path: str | None = None
    tensorboard_dir: str | None = None
    progress_bar: bool = True
    print_interval: int = 10
    profile_step_start: int | None = None
    profile_step_end: int | None = None
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    profile_with_stack: bool = False

    def __post_init__(self) -> None:
        if self.print_interval < 1:
            raise ValueError(f"print_interval must be >= 1, got {self.print_interval}")
        self._check_profile()
        check_not_empty(self, "dir", "e.g. runs/my_run")
        check_not_empty(self, "jsonl_path", "null writes dir/metrics.jsonl")
        check_not_empty(self, "tensorboard_dir", "null disables TensorBoard")

    def _check_profile(self) -> None:
        start, end = self.profile_step_start, self.profile_step_end
        if start is None:
            if end is not None or self.profile_with_stack:
                raise ValueError("profile_step_end and profile_with_stack need profile_step_start")
            return
        if start < 1 or (end is not None and end < start):
            raise ValueError(
                f"profile_step_start must be >= 1 and profile_step_end >= it (steps are "
                f"1-based), got {start} and {end}"
            )
        if not self.profile_ranks or min(self.profile_ranks) < 0:
            raise ValueError(f"profile_ranks must list global ranks >= 0, got {self.profile_ranks}")

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
class TrainConfig(LogprobPassSizes):
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
        if self.training.logprob_max_tokens_per_micro_batch not in (
            None,
            "auto",
        ) and self.moe_forwards_need_equal_tokens(self.model.moe_token_dispatcher_type):
            raise ValueError(MERGE_NEEDS_ALLTOALL)
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
        check_evaluation(self.evaluation, self.rollout, self.parallel)
        if self.training.offload_during_rollout is True and self.rollout.input_path is not None:
            raise ValueError(
                "training.offload_during_rollout: true needs generated rollouts, but "
                "rollout.input_path reads them from files (set it to auto or false)"
            )
        off = self.training.offload_during_rollout
        check_separate(self.rollout, self.parallel, self.model, self.loss.is_correction_level, off)
        check_tp_collectives(self.parallel, self.model, self.rollout)
        p = self.rollout.partial
        if p.enabled and p.max_staleness > 0 and self.loss.is_correction_level is None:
            raise ValueError(f"rollout.partial.max_staleness={p.max_staleness} {STALE_NEEDS_IS}")

    def rollout_context(self) -> RolloutContext:
        """What the rollout wing needs of the sections beside ``rollout``."""
        return RolloutContext(
            seed=self.training.seed,
            steps=self.training.steps,
            vocab_size=self.model.vocab_size,
            max_sequence_length=self.model.max_sequence_length,
            record_routes=self.model.moe_enable_routing_replay,
            model_config=self.model,
        )

    @property
    def optimizer_steps(self) -> int:
        return self.training.steps * self.training.mini_batches_per_step


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
    stored = stored_model_config(str(load)) if isinstance(load, str) else None
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
