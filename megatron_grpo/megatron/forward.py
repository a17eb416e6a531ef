"""forward_step + loss for megatron-core's pipeline schedules, and a no-grad log-prob pass.

Usage with any Megatron schedule (PP, VPP, micro-batching work as usual)::

    step = GRPOStep(loss_cfg, vocab_size=model_cfg.vocab_size)
    losses = get_forward_backward_func()(
        forward_step_func=step.forward_step, data_iterator=iter(micro_batches), model=chunks,
        num_microbatches=len(micro_batches), seq_length=max_tokens, micro_batch_size=1,
    )
    finalize_model_grads(chunks, num_tokens=...)  # done by the schedule via config

On the last pipeline stage the decoder runs to its final-normed hidden states (the GPTModel's
output layer is skipped: no [T, V] logits), then one of three log-prob paths
(``GRPOStep.logprob_path``) feeds the GRPO loss. Which one runs, and how (tiles, kernels, loop
order, d_weight mode), is the LM-head plan of each call (:mod:`megatron_grpo.ops.plan`; its
``memory_budget`` is ``GRPOStep.memory_budget``):

* ``"fused"``: ``fused_grpo_loss``: by default the op's tiled stats pass, the loss on all rows
  and the tiled recompute in backward ("fused_tiled"); a single 3-GEMM pass with the loss per
  full-width chunk ("fused_single_pass") only where the plan's rule allows (narrow vocab shards,
  small batches). Either can be asked for by name. GSPO (a sequence ratio) runs "fused_tiled":
  its loss needs all of a sequence's log-probs first, so "fused_single_pass" is refused;
* ``"op"``: ``vocab_parallel_logprobs`` (tiled, recomputed in backward) then ``grpo_loss``;
* ``"megatron"``: Megatron's standard path, the baseline of our comparisons: the GPTModel's
  ``output_layer`` materializes vocab-parallel logits ``[s, b, V/TP]``, then
  ``tensor_parallel.vocab_parallel_cross_entropy`` (fp32 logits, softmax saved for backward),
  ``logp = -CE``, then ``grpo_loss``. Temperature and the padded-vocab mask are applied to the
  logits in place, so all three paths compute the same distribution.

The two ops are applied to the output-layer weight (the embedding weight when tied). The loss
function returns Megatron's ``calculate_per_token_loss`` convention ``(loss_sum, local_count,
report)``: the loss module is called with ``denominator=1.0`` and ``local_count`` comes from
``loss.reduction.local_denominator``; Megatron sums the counts over micro-batches and DP x CP
ranks and divides the gradients by the total (``finalize_model_grads(num_tokens=...)``), so
token_mean and the seq_mean modes are exact whatever the split. MoE aux losses are added by
megatron-core itself (``MoEAuxLossAutoScaler``, scale 1 per micro-batch in this convention, then
divided by the same global count).

MoE routing replay: a micro-batch with ``routes`` replays them (``routing_replay.py``);
``compute_logprobs`` opens the ``replay_routes`` block itself, training schedules must run
inside ``with replay_routes(chunks):`` (so recomputes in backward find their routes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func as _mcore_fb_func
from torch import Tensor

from megatron_grpo.loss import GRPOLossConfig, grpo_loss, local_denominator
from megatron_grpo.loss.metrics import MeanMetric
from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.megatron.batch import (
    PackedBatch,
    packed_seq_params,
    padded_layout,
    split_for_context_parallel,
    thd_partition_index,
)
from megatron_grpo.megatron.model import unwrap
from megatron_grpo.megatron.parallel import comm_device, cuda_compat
from megatron_grpo.megatron.routing_replay import replay_routes, set_replay_routes
from megatron_grpo.ops import fused_grpo_loss, vocab_parallel_logprobs
from megatron_grpo.ops.lm_head import check_targets
from megatron_grpo.ops.plan import resolve_request

LogprobPath = Literal["fused", "op", "megatron", "fused_tiled", "fused_single_pass"]
LOGPROB_PATHS: tuple[str, ...] = ("fused", "op", "megatron", "fused_tiled", "fused_single_pass")


def get_forward_backward_func() -> Callable:
    """megatron-core's schedule for the current layout; on CUDA-less hosts it runs under
    :func:`cuda_compat` (its buffers are created with ``device="cuda"``).

    ``forward_only=True`` runs under ``torch.no_grad()``: megatron-core leaves gradients enabled
    there, and the fused path writes the output layer's d_weight into ``main_grad`` during the
    forward, so an evaluation pass would otherwise leave a gradient behind."""
    func = _mcore_fb_func()

    def run(**kwargs):
        grad = contextlib.nullcontext() if not kwargs.get("forward_only") else torch.no_grad()
        with cuda_compat(), grad:
            return func(**kwargs)

    return run


def check_training_config(model: torch.nn.Module) -> None:
    """Raise naming the field when ``model`` (a chunk as the schedule passes it) is not set up
    the way :meth:`GRPOStep.forward_step`'s gradients rely on. ``build_model`` does all of it."""
    config = unwrap(model).config
    if not getattr(config, "calculate_per_token_loss", False):
        raise ValueError(
            "GRPOStep: the model's TransformerConfig.calculate_per_token_loss must be True: the "
            "loss is a token sum that Megatron divides by the global token count; without it "
            "gradients and the reported loss are wrong. Set config.calculate_per_token_loss = "
            "True before wrapping the model in DistributedDataParallel (build_model does)"
        )
    if torch.is_grad_enabled() and getattr(config, "finalize_model_grads_func", None) is None:
        raise ValueError(
            "GRPOStep: the model's TransformerConfig.finalize_model_grads_func is None, so "
            "nothing divides the gradients by the global token count (they come out that many "
            "times too large) or reduces them over data-parallel ranks. Set "
            "config.finalize_model_grads_func = megatron.core.distributed.finalize_model_grads "
            "(build_model does)"
        )
    for buffer in _grad_buffers(model):
        if buffer.gradient_scaling_factor != 1.0:
            raise ValueError(
                "GRPOStep: DistributedDataParallel was built while calculate_per_token_loss was "
                f"False, so it also scales gradients by {buffer.gradient_scaling_factor}; set "
                "calculate_per_token_loss = True before wrapping the model"
            )


def _grad_buffers(model: torch.nn.Module) -> list:
    """The DDP wrapper's gradient buffers (dense and expert), empty for an unwrapped model."""
    while not isinstance(model, DistributedDataParallel) and hasattr(model, "module"):
        model = model.module
    if not isinstance(model, DistributedDataParallel):
        return []
    return list(model.buffers) + list(model.expert_parallel_buffers)


@contextlib.contextmanager
def hidden_states_only(gpt) -> Iterator[None]:
    """Make GPTModel.forward return the decoder's final-normed hidden states ``[s, b, H]``
    instead of logits: its ``_postprocess`` returns early when ``post_process`` is False (the
    decoder keeps its final layernorm, chosen at construction). Works on megatron-core
    0.14..0.16, where ``GPTModel`` has no hidden-state output option."""
    saved = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = saved


def output_weight(gpt) -> Tensor:
    """``[V_local, H]`` output-layer weight of the last stage (the embedding when tied)."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def _groups() -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    tp = parallel_state.get_tensor_model_parallel_group()
    cp = parallel_state.get_context_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    cp_size = parallel_state.get_context_parallel_world_size()
    return (tp if tp_size > 1 else None), (cp if cp_size > 1 else None)


def prepare_batch(
    batch: PackedBatch, sequence_parallel: bool
) -> tuple[PackedBatch, PackedSeqParams]:
    """Validate, split for context parallelism (when CP > 1) and check SP divisibility."""
    batch.validate()
    cp_size = parallel_state.get_context_parallel_world_size()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    multiple = tp_size if sequence_parallel else 1
    if cp_size > 1:
        cp_rank = parallel_state.get_context_parallel_rank()
        local, params, _ = split_for_context_parallel(batch, cp_size, cp_rank, multiple)
        return local, params
    if batch.num_tokens % multiple:
        raise ValueError(
            f"packed micro-batch length T={batch.num_tokens} must be divisible by "
            f"tensor_model_parallel_size={tp_size} under sequence_parallel "
            "(pack_sequences(..., pad_to_multiple_of=TP))"
        )
    return batch, packed_seq_params(batch)


def run_model(model: torch.nn.Module, batch: PackedBatch, params: PackedSeqParams) -> Tensor:
    """Forward one (local) packed batch. Last stage: hidden ``[T_local, H]`` in the output
    weight's dtype; other stages: the activation tensor for the next stage.

    Megatron's ``Float16Module`` upcasts last-stage outputs to fp32 (bf16/fp16 runs); the
    hidden states are cast back (exact) so the log-prob paths see the GEMM dtype.
    """
    gpt = unwrap(model)
    device = next(gpt.parameters()).device
    tokens = host_to_device(batch.tokens, device)[None]
    positions = host_to_device(batch.position_ids, device)[None]
    params = _params_to(params, device)
    if not gpt.post_process:
        return model(tokens, positions, None, packed_seq_params=params)
    with hidden_states_only(gpt):
        hidden = model(tokens, positions, None, packed_seq_params=params)
    return hidden.squeeze(1).to(output_weight(gpt).dtype)


def megatron_logprobs(
    output_layer: torch.nn.Module,
    weight: Tensor,
    hidden: Tensor,
    targets: Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
) -> Tensor:
    """Megatron's standard log-prob path: ``[T_local, H]`` hidden -> float32 ``[T]`` log-probs.

    ``output_layer`` (the GPTModel's ``ColumnParallelLinear``; all-gathers the hidden states
    under sequence parallelism) materializes ``[T, 1, V_local]`` logits; they are divided by
    ``temperature`` and padded vocab columns (ids ``>= vocab_size``) set to ``-inf`` in place,
    then ``tensor_parallel.vocab_parallel_cross_entropy`` gives ``logp = -CE``. Every position
    is scored (prompt tokens too), as in Megatron; ``targets`` ``[T]`` must be real ids.
    """
    check_targets(targets, None, vocab_size)
    logits, _ = output_layer(hidden.unsqueeze(1), weight=weight)  # [T, 1, V_local]
    if logits.dtype == torch.float32:
        # vocab_parallel_cross_entropy upcasts with .float() and then overwrites that tensor in
        # place: a bf16 input gets its own fp32 copy, an fp32 one needs the same explicitly.
        logits = logits.clone()
    if temperature != 1.0:
        logits.div_(temperature)
    v_local = logits.size(-1)
    n_valid = vocab_size - parallel_state.get_tensor_model_parallel_rank() * v_local
    if n_valid < v_local:
        logits[..., max(n_valid, 0) :] = float("-inf")
    ce = tensor_parallel.vocab_parallel_cross_entropy(logits, targets.unsqueeze(1))
    return -ce.view(-1).float()


def _params_to(params: PackedSeqParams, device: torch.device) -> PackedSeqParams:
    moved = {
        k: (host_to_device(v, device) if isinstance(v, Tensor) else v)
        for k, v in vars(params).items()
    }
    return PackedSeqParams(**moved)


@dataclass
class GRPOStep:
    """Megatron ``forward_step_func``s for GRPO training and for no-grad log-probs.

    Args:
        loss_cfg: the GRPO loss options.
        vocab_size: the real vocabulary (``ModelConfig.vocab_size``): padded ids get zero
            probability and are never scored.
        temperature: sampling temperature the log-probs are computed under.
        fused: the original switch, kept for compatibility: True = ``logprob_path="fused"``,
            False = ``"op"``. Ignored when ``logprob_path`` is given (False together with a
            fused ``logprob_path`` is an error); afterwards it reflects the chosen path.
        chunk_size / impl: passed to the log-prob op (all paths but "megatron").
        logprob_path: "fused", "op" or "megatron" (see the module docstring), or a fused path
            by name ("fused_tiled", "fused_single_pass": token ratio only); None = from
            ``fused``. "megatron" computes no entropy, so it needs ``loss_cfg.entropy_coef == 0``.
        memory_budget: bytes of the LM head's working set, trading memory for speed
            (:mod:`megatron_grpo.ops.plan`); None = its default (1 GiB).
        on_policy: the training step is the only optimizer step on its rollouts, so a batch
            without ``old_logprobs`` uses the current log-probs, detached (the loss's
            ``old_logprobs=None``: ratio exactly 1, no old-log-prob pass). False: a batch
            without ``old_logprobs`` is an error. With a sequence-level IS correction the
            automatic fused request runs "fused_tiled" (the weight needs whole sequences of
            current log-probs; "fused_single_pass" is refused).
    """

    loss_cfg: GRPOLossConfig
    vocab_size: int
    temperature: float = 1.0
    fused: bool = True
    chunk_size: int | None = None
    impl: str = "auto"
    logprob_path: LogprobPath | None = None
    memory_budget: int | None = None
    on_policy: bool = False

    def __post_init__(self) -> None:
        if self.logprob_path is None:
            self.logprob_path = "fused" if self.fused else "op"
        elif self.logprob_path not in LOGPROB_PATHS:
            raise ValueError(
                f"logprob_path must be one of {list(LOGPROB_PATHS)}, got {self.logprob_path!r}"
            )
        elif self.logprob_path.startswith("fused") and not self.fused:
            raise ValueError(
                f"fused=False contradicts logprob_path={self.logprob_path!r}; set only one"
            )
        self.fused = self.logprob_path.startswith("fused")
        resolve_request(self.logprob_path, self.loss_cfg)  # the plan's checks (entropy, GSPO)
        self._loss_path = self.logprob_path  # the path the training loss asks for
        if self.on_policy and self.loss_cfg.is_correction_level in ("sequence", "sequence_mean"):
            # on-policy sequence IS weights need each sequence's current log-probs first
            if self.logprob_path == "fused_single_pass":
                raise ValueError(
                    "logprob_path 'fused_single_pass' runs the loss chunk by chunk, but on-policy "
                    f"is_correction_level {self.loss_cfg.is_correction_level!r} weighs each "
                    "sequence by all of its current log-probs: use 'fused' / 'fused_tiled' or 'op'"
                )
            if self.logprob_path == "fused":
                self._loss_path = "fused_tiled"

    def forward_step(self, data_iterator: Iterator[PackedBatch], model: torch.nn.Module):
        """Training ``forward_step_func``: returns ``(output, loss_func)`` for the schedule.

        Checks the model's config first (:func:`check_training_config`)."""
        check_training_config(model)
        return self._forward(data_iterator, model, self.loss_func)

    def logprob_step(self, data_iterator: Iterator[PackedBatch], model: torch.nn.Module):
        """No-grad ``forward_step_func``: the loss function reports ``{"logprobs": [T_local]}``
        (log-probs at the ``loss_mask`` rows, 0 elsewhere)."""
        return self._forward(data_iterator, model, self._logprob_loss)

    def _forward(self, data_iterator, model, loss_func):
        batch: PackedBatch = next(data_iterator)
        gpt = unwrap(model)
        sp = gpt.config.sequence_parallel
        local, params = prepare_batch(batch, sp)
        if local.routes is not None:  # MoE routing replay: needs an active replay_routes block
            set_replay_routes(model, local.routes)
        out = run_model(model, local, params)
        if not gpt.post_process:
            return out, partial(loss_func, local, None, sp)
        layer = gpt.output_layer if self.logprob_path == "megatron" else None
        return out, partial(loss_func, local, output_weight(gpt), sp, output_layer=layer)

    def loss_func(
        self,
        batch: PackedBatch,
        weight: Tensor,
        sequence_parallel: bool,
        hidden: Tensor,
        *,
        output_layer: torch.nn.Module | None = None,
    ) -> tuple[Tensor, Tensor, dict]:
        """Last stage: ``hidden [T_local, H]`` -> ``(loss_sum, local_count, report)``.

        ``report`` maps metric keys to exactly-aggregating values
        (``megatron_grpo.loss.reduce_metrics``); ``"loss/loss"`` aggregates to the loss of
        the whole step (sum over micro-batches and ranks / global count). ``output_layer`` (the
        GPTModel's) is required by ``logprob_path="megatron"``.
        """
        if batch.old_logprobs is None and not self.on_policy:
            raise ValueError(
                "PackedBatch.old_logprobs is required for the GRPO loss (it may be None only "
                "with GRPOStep(on_policy=True): one optimizer step per rollout batch)"
            )
        tp_group, cp_group = _groups()
        dev = hidden.device
        args = dict(
            # None (on-policy): the loss uses the current log-probs, detached
            old_logprobs=_opt(batch.old_logprobs, dev),
            advantages=host_to_device(_req(batch, "advantages"), dev),
            loss_mask=host_to_device(batch.loss_mask, dev),
            cu_seqlens=batch.cu_seqlens,  # host: checked there for free, moved by the loss
            ref_logprobs=_opt(batch.ref_logprobs, dev),
            rollout_logprobs=_opt(batch.rollout_logprobs, dev),
            denominator=1.0,
            cp_group=cp_group,
        )
        targets = host_to_device(batch.targets, dev)
        if self.logprob_path == "megatron":
            logp = self._megatron_logprobs(output_layer, weight, hidden, targets)
            loss, metrics = grpo_loss(self.loss_cfg, logprobs=logp, **args)
        else:  # the plan picks "op" or a fused path (GSPO: "fused_tiled") from the request
            op = self._op_args(tp_group, sequence_parallel)
            loss, metrics, _ = fused_grpo_loss(
                hidden, weight, targets, self.loss_cfg, **args, **op, path=self._loss_path
            )
        count = local_denominator(self.loss_cfg, args["loss_mask"], args["cu_seqlens"], cp_group)
        count = count.round().to(torch.int)
        report = dict(metrics)
        report["loss/loss"] = MeanMetric(loss.detach(), count.float())
        return loss, count, report

    def _op_args(self, tp_group: dist.ProcessGroup | None, sequence_parallel: bool) -> dict:
        return dict(
            tp_group=tp_group, sequence_parallel=sequence_parallel, temperature=self.temperature,
            vocab_size=self.vocab_size, chunk_size=self.chunk_size, impl=self.impl,
            memory_budget=self.memory_budget,
        )  # fmt: skip

    def _megatron_logprobs(
        self, output_layer: torch.nn.Module | None, weight: Tensor, hidden: Tensor, targets: Tensor
    ) -> Tensor:
        if output_layer is None:
            raise ValueError("logprob_path='megatron' needs the GPTModel's output_layer")
        return megatron_logprobs(
            output_layer, weight, hidden, targets,
            vocab_size=self.vocab_size, temperature=self.temperature,
        )  # fmt: skip

    def _logprob_loss(
        self,
        batch: PackedBatch,
        weight: Tensor,
        sp: bool,
        hidden: Tensor,
        *,
        output_layer: torch.nn.Module | None = None,
    ):
        tp_group, _ = _groups()
        dev = hidden.device
        rows = host_to_device(batch.loss_mask, dev)
        targets = host_to_device(batch.targets, dev)
        if self.logprob_path == "megatron":
            logp = self._megatron_logprobs(output_layer, weight, hidden, targets) * rows
        else:
            op = self._op_args(tp_group, sp)
            logp = vocab_parallel_logprobs(hidden, weight, targets, rows=rows, **op)
        return hidden.new_zeros(()), torch.zeros((), dtype=torch.int), {"logprobs": logp.detach()}

    @torch.no_grad()
    def compute_logprobs(
        self, model: list[torch.nn.Module], batches: list[PackedBatch]
    ) -> list[Tensor]:
        """Log-probs ``[T]`` (float32, CPU) of each batch's targets under ``model``, no grad.

        For old and reference log-probs: runs Megatron's forward-only schedule (so PP and
        micro-batching work); results are gathered over CP and broadcast from the last pipeline
        stage, so every rank gets the full ``[T]`` of its batches. 0 outside ``loss_mask``.
        Batches carrying ``routes`` replay them (MoE routing replay).
        """
        for chunk in model:
            chunk.eval()
        replay = any(b.routes is not None for b in batches)
        try:
            with replay_routes(model) if replay else contextlib.nullcontext():
                out = get_forward_backward_func()(
                    forward_step_func=self.logprob_step,
                    data_iterator=iter(batches),
                    model=model if len(model) > 1 else model[0],
                    num_microbatches=len(batches),
                    seq_length=max(b.num_tokens for b in batches),
                    micro_batch_size=1,
                    forward_only=True,
                )
        finally:
            for chunk in model:
                chunk.train()
        sp = unwrap(model[-1]).config.sequence_parallel
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        return [
            _full_logprobs(out[i]["logprobs"] if last else None, batch, sp)
            for i, batch in enumerate(batches)
        ]


def _full_logprobs(local: Tensor | None, batch: PackedBatch, sp: bool) -> Tensor:
    """Gather a last-stage ``[T_local]`` over CP and broadcast it over PP -> ``[T]`` on CPU."""
    cp_size = parallel_state.get_context_parallel_world_size()
    if local is not None and cp_size > 1:
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        local = gather_from_context_parallel(
            local, batch, cp_size, tp_size if sp else 1, parallel_state.get_context_parallel_group()
        )
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        buf = local if local is not None else torch.empty(batch.num_tokens, device=comm_device())
        group = parallel_state.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, dist.get_world_size(group) - 1)
        dist.broadcast(buf.float().contiguous() if local is not None else buf, src=src, group=group)
        local = buf
    return local.float().cpu()


def gather_from_context_parallel(
    local: Tensor, batch: PackedBatch, cp_size: int, multiple: int, group: dist.ProcessGroup
) -> Tensor:
    """Inverse of :func:`split_for_context_parallel` for a per-token ``[T_local]`` tensor."""
    shards = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    cu_pad, dest = padded_layout(batch, cp_size, multiple)
    full = local.new_zeros(int(cu_pad[-1]))
    for rank, shard in enumerate(shards):
        full[thd_partition_index(cu_pad, cp_size, rank).to(local.device)] = shard
    return full[dest.to(local.device)]


def _req(batch: PackedBatch, name: str) -> Tensor:
    value = getattr(batch, name)
    if value is None:
        raise ValueError(f"PackedBatch.{name} is required for the GRPO loss")
    return value


def _opt(x: Tensor | None, device: torch.device) -> Tensor | None:
    return None if x is None else host_to_device(x, device)
