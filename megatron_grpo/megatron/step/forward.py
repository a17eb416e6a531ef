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
order, d_weight mode), is the LM-head plan of each call (:mod:`megatron_grpo.ops.lm_head.plan`; its
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
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func as _mcore_fb_func
from torch import Tensor

from megatron_grpo.loss import GRPOLossConfig, LossInputs, local_denominator
from megatron_grpo.loss.metrics import MeanMetric
from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.megatron.batch.graph_shape import GraphShape, graph_shapes, pad_to_shape
from megatron_grpo.megatron.batch.merge import (
    match_count,
    merge_groups,
    merge_packed,
    split_merged,
)
from megatron_grpo.megatron.batch.packing import PackedBatch
from megatron_grpo.megatron.batch.transport import full_logprobs, prepare_batch, run_model
from megatron_grpo.megatron.gpt import check_training_config, unwrap
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.moe.routing_replay import replay_routes, set_replay_routes
from megatron_grpo.megatron.parallel import all_reduce_max, cuda_compat
from megatron_grpo.megatron.step.graph_plan import plan_logprob_graphs, plan_update_graphs
from megatron_grpo.megatron.step.graph_store import routes_shape, shape_budget
from megatron_grpo.megatron.step.logprob_graphs import LogprobGraphs, graphed_logprob_passes
from megatron_grpo.megatron.step.logprob_paths import LogprobPath, choose_path
from megatron_grpo.megatron.step.update_graphs import UpdateGraphs
from megatron_grpo.ops.lm_head.options import LMHeadOptions, LMHeadRequest


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


class GRPOStep:
    """Megatron ``forward_step_func``s for GRPO training and for no-grad log-probs.

    Args (the LM-head ones, from ``vocab_size`` to ``gemm``, are the fields of
    :class:`LMHeadOptions` by their keyword names; where given they override ``options``'s):
        loss_cfg: the GRPO loss options.
        vocab_size: the real vocabulary (``ModelConfig.vocab_size``): padded ids get zero
            probability and are never scored.
        temperature: sampling temperature the log-probs are computed under.
        chunk_size / impl: passed to the log-prob op (all paths but "megatron").
        logprob_path: "fused", "op" or "megatron" (see the module docstring), or a fused path
            by name ("fused_tiled", "fused_single_pass": token ratio only). "megatron"
            computes no entropy, so it needs ``loss_cfg.entropy_coef == 0``.
        memory_budget: bytes of the LM head's working set, trading memory for speed
            (:mod:`megatron_grpo.ops.lm_head.plan`); None = its default (1 GiB).
        gemm: the logits GEMM mode of the LM-head op ("auto", "separate", "fused_epilogue").
        on_policy: the training step is the only optimizer step on its rollouts, so a batch
            without ``old_logprobs`` uses the current log-probs, detached (the loss's
            ``old_logprobs=None``: ratio exactly 1, no old-log-prob pass). False: a batch
            without ``old_logprobs`` is an error. With a sequence-level IS correction the
            automatic fused request runs "fused_tiled" (the weight needs whole sequences of
            current log-probs; "fused_single_pass" is refused).
        layout: the parallel layout, computed once (``initialize_parallel`` returns it); None =
            megatron-core's current ``parallel_state`` with the model's ``sequence_parallel``,
            read at each forward.
        options: the LM-head options as one object (a recipe's ``lm_head`` section); default:
            LMHeadOptions' defaults, path "fused".

    The step holds the options as one :class:`LMHeadOptions` (``self.options``, validated
    once) and the path as one :class:`~megatron_grpo.megatron.step.logprob_paths.LogprobPath`
    (``self.path``), both made when the step is built.
    """

    def __init__(
        self,
        loss_cfg: GRPOLossConfig,
        vocab_size: int | None = None,
        temperature: float | None = None,
        chunk_size: int | None = None,
        impl: str | None = None,
        logprob_path: LMHeadRequest | None = None,
        memory_budget: int | None = None,
        on_policy: bool = False,
        layout: ParallelLayout | None = None,
        gemm: str | None = None,
        *,
        options: LMHeadOptions | None = None,
    ) -> None:
        given = dict(
            vocab_size=vocab_size,
            temperature=temperature,
            chunk_size=chunk_size,
            impl=impl,
            path=logprob_path,
            memory_budget=memory_budget,
            gemm=gemm,
        )
        opts = LMHeadOptions.of(options, **{k: v for k, v in given.items() if v is not None})
        if opts.path is None:  # the step's default request
            opts = LMHeadOptions.of(opts, path="fused")
        if opts.vocab_size is None:
            raise ValueError("GRPOStep needs vocab_size (the real vocabulary)")
        self.loss_cfg, self.on_policy, self.layout = loss_cfg, on_policy, layout
        self.options: LMHeadOptions = opts
        self.path: LogprobPath = choose_path(loss_cfg, opts, on_policy)
        # the no-grad passes replay CUDA graphs (:meth:`plan_logprob_graphs`); shapes warmed
        self.logprob_graphs = False
        self.graphs = LogprobGraphs()  # kept across calls
        # the update's passes replay CUDA graphs (:meth:`plan_update_graphs`): each schedule's
        # micro-batch shapes, in order (:meth:`prepare_update`)
        self.update_graphs = False
        self.update_store = UpdateGraphs()  # kept across steps
        self._captures = (0, 0)  # (log-prob, update) at the last :meth:`graph_metrics`
        self._update_shapes = shape_budget(1)  # shapes a schedule may take
        self._shapes: deque[GraphShape] = deque()
        self._routes: tuple[int, int] | None = None

    def plan_logprob_graphs(
        self,
        model: list[torch.nn.Module],
        requested: bool | None = None,
        tokens: int | None = None,
    ) -> str:
        """Decide whether :meth:`compute_logprobs` replays CUDA graphs of ``model``'s forward
        (:mod:`~megatron_grpo.megatron.step.graph_plan`; ``requested``:
        ``training.logprob_cuda_graphs``, None = auto: where they run and a forward of the
        passes' ``tokens`` per micro-batch is host-bound) and return the reason for the
        start-up line. The policy and the reference model share the decision."""
        layout = self.layout_of(unwrap(model[0]))
        on, why = plan_logprob_graphs(model, layout, requested, tokens)
        self.logprob_graphs = on
        if not on:
            self.graphs.clear()
        return why

    def plan_update_graphs(
        self,
        model: list[torch.nn.Module],
        requested: bool | None = None,
        tokens: int | None = None,
        grads_move: bool = False,
        schedules: int = 1,
    ) -> str:
        """:meth:`plan_logprob_graphs` for the update's forward and backward
        (:mod:`~megatron_grpo.megatron.step.update_graphs`; ``requested``:
        ``training.update_cuda_graphs``; ``grads_move``: the gradient buffers move between
        steps, e.g. offloaded during rollout; ``schedules``: training schedules a step, e.g.
        ``training.mini_batches_per_step``, whose shapes share the store:
        :func:`~.graph_store.shape_budget`). With them on, call :meth:`prepare_update` before
        each training schedule."""
        self._update_shapes = shape_budget(schedules)
        layout = self.layout_of(unwrap(model[0]))
        on, why = plan_update_graphs(model, layout, requested, tokens, grads_move)
        self.update_graphs = on
        if not on:
            self.update_store.clear()
        return why

    def graph_metrics(self) -> dict[str, float]:
        """Since the last call, by each kind that is on: graphs captured
        (``perf/logprob_graph_captures``, ``perf/update_graph_captures``: an update shape is two,
        forward and backward) and the padding's share of the tokens replayed
        (``perf/logprob_graph_padding``, ``perf/update_graph_padding``; absent if none ran). A
        steady run captures none; captures in every step mean more shapes than
        ``graph_store.MAX_GRAPHS``, or graphs dropped for the KV cache."""
        stores = (self.graphs, self.update_store)
        now = tuple(s.captures for s in stores)
        new = [a - b for a, b in zip(now, self._captures, strict=True)]
        self._captures = now
        out = {}
        on = (self.logprob_graphs, self.update_graphs)
        for kind, yes, n, store in zip(("logprob", "update"), on, new, stores, strict=True):
            padding = store.padding()
            if yes:
                out[f"perf/{kind}_graph_captures"] = float(n)
                if padding is not None:
                    out[f"perf/{kind}_graph_padding"] = padding
        return out

    def drop_graphs(self) -> int:
        """Drop every captured graph of the log-prob and update passes, and with them their
        memory pools (the trainer: before a rollout whose KV cache needs the room); the next
        passes capture again. Returns how many were held."""
        held = len(self.graphs.statics) + len(self.update_store.statics)
        self.graphs.clear()
        self.update_store.clear()
        return held

    def prepare_update(
        self,
        model: list[torch.nn.Module] | torch.nn.Module,
        micro_batches: list[PackedBatch],
        count_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Before a training schedule over ``micro_batches`` with update graphs on: the graph
        shape of each (agreed over ``count_group`` as in :meth:`compute_logprobs`: their
        graphs hold the same collectives) and whether ``model``'s weights moved since its
        captures (agreed over TP and ``count_group``); the parameters' overlapped all-gathers
        waited for (the replays run no DDP hooks). A no-op with them off."""
        if not self.update_graphs:
            return
        chunk = model[0] if isinstance(model, list) else model
        layout = self.layout_of(unwrap(chunk))
        for b in micro_batches:
            b.validate()
        self._routes = routes_shape(micro_batches)
        store = self.update_store
        store.before_replays(chunk, [layout.tp_group, count_group])  # may drop its graphs
        reuse = store.reuse(chunk, self._routes, backward=True)
        multiple, most = layout.token_multiple, self._update_shapes
        self._shapes = deque(graph_shapes(micro_batches, multiple, count_group, most, reuse))

    @classmethod
    def from_options(
        cls,
        loss_cfg: GRPOLossConfig,
        options: LMHeadOptions,
        *,
        on_policy: bool = False,
        layout: ParallelLayout | None = None,
    ) -> GRPOStep:
        """The step of an :class:`LMHeadOptions` (e.g. a recipe's ``lm_head`` section with its
        runtime ``temperature`` and ``vocab_size`` filled in; ``vocab_size`` is required)."""
        if options.vocab_size is None:
            raise ValueError("GRPOStep.from_options needs options.vocab_size (the real vocabulary)")
        return cls(loss_cfg, options=options, on_policy=on_policy, layout=layout)

    def layout_of(self, gpt: GPTModel) -> ParallelLayout:
        """The step's layout, or (None) megatron-core's current one, read at each call so that
        one step serves models of several layouts; its ``sequence_parallel`` is the model's."""
        sp = bool(gpt.config.sequence_parallel)
        if self.layout is None:
            return ParallelLayout.current(sp)
        if self.layout.sequence_parallel != sp:
            raise ValueError(
                f"GRPOStep.layout.sequence_parallel={self.layout.sequence_parallel} but the "
                f"model's config.sequence_parallel={sp}"
            )
        return self.layout

    def forward_step(self, data_iterator: Iterator[PackedBatch], model: torch.nn.Module):
        """Training ``forward_step_func``: returns ``(output, loss_func)`` for the schedule.

        Checks the model's config first (:func:`check_training_config`)."""
        check_training_config(model)
        if self.update_graphs:
            return self._graphed_forward(data_iterator, model)
        return self._forward(data_iterator, model, self.loss_func)

    def _graphed_forward(self, data_iterator, model):
        batch: PackedBatch = next(data_iterator)
        if not self._shapes:
            raise RuntimeError(
                "GRPOStep.update_graphs is on: call prepare_update(model, micro_batches) "
                "before each training schedule"
            )
        shape = self._shapes.popleft()
        padded = pad_to_shape(batch, shape)  # padding documents: loss_mask False
        self.update_store.count(batch.num_tokens, shape)
        hidden = self.update_store.forward(model, padded, shape, self._routes)
        return hidden, partial(self.loss_func, padded, unwrap(model))

    def logprob_step(self, data_iterator: Iterator[PackedBatch], model: torch.nn.Module):
        """No-grad ``forward_step_func``: the loss function reports ``{"logprobs": [T_local]}``
        (log-probs at the ``loss_mask`` rows, 0 elsewhere)."""
        return self._forward(data_iterator, model, self._logprob_loss)

    def _forward(self, data_iterator, model, loss_func):
        batch: PackedBatch = next(data_iterator)
        gpt = unwrap(model)
        local, params = prepare_batch(batch, self.layout_of(gpt))
        if local.routes is not None:  # MoE routing replay: needs an active replay_routes block
            set_replay_routes(model, local.routes)
        out = run_model(model, local, params)
        return out, partial(loss_func, local, gpt if gpt.post_process else None)

    def loss_func(
        self, batch: PackedBatch, gpt: GPTModel | None, hidden: Tensor
    ) -> tuple[Tensor, Tensor, dict]:
        """Last stage: ``hidden [T_local, H]`` of the (local) ``batch`` under ``gpt`` ->
        ``(loss_sum, local_count, report)``.

        ``report`` maps metric keys to exactly-aggregating values
        (``megatron_grpo.loss.reduce_metrics``); ``"loss/loss"`` aggregates to the loss of
        the whole step (sum over micro-batches and ranks / global count).
        """
        if batch.old_logprobs is None and not self.on_policy:
            raise ValueError(
                "PackedBatch.old_logprobs is required for the GRPO loss (it may be None only "
                "with GRPOStep(on_policy=True): one optimizer step per rollout batch)"
            )
        layout = self.layout_of(gpt)
        dev = hidden.device
        # None old_logprobs (on-policy): the loss uses the current log-probs, detached
        inputs = LossInputs.from_batch(batch, device=dev, denominator=1.0, cp_group=layout.cp_group)
        targets = host_to_device(batch.targets, dev)
        loss, metrics = self.path.loss(self.loss_cfg, gpt, hidden, targets, inputs, layout)
        count = local_denominator(
            self.loss_cfg, inputs.loss_mask, inputs.cu_seqlens, layout.cp_group
        )
        count = count.round().to(torch.int)
        report = dict(metrics)
        report["loss/loss"] = MeanMetric(loss.detach(), count.float())
        return loss, count, report

    def _logprob_loss(self, batch: PackedBatch, gpt: GPTModel | None, hidden: Tensor):
        dev = hidden.device
        rows = host_to_device(batch.loss_mask, dev)
        targets = host_to_device(batch.targets, dev)
        logp = self.path.logprobs(gpt, hidden, targets, rows, self.layout_of(gpt))
        return hidden.new_zeros(()), torch.zeros((), dtype=torch.int), {"logprobs": logp.detach()}

    @torch.no_grad()
    def compute_logprobs(
        self,
        model: list[torch.nn.Module],
        batches: list[PackedBatch],
        max_tokens: int | None = None,
        count_group: dist.ProcessGroup | None = None,
    ) -> list[Tensor]:
        """Log-probs ``[T]`` (float32, CPU) of each batch's targets under ``model``, no grad.

        For old and reference log-probs: runs Megatron's forward-only schedule (so PP and
        micro-batching work); results are gathered over CP and broadcast from the last pipeline
        stage, so every rank gets the full ``[T]`` of its batches. 0 outside ``loss_mask``.
        Batches carrying ``routes`` replay them (MoE routing replay).

        ``max_tokens``: run consecutive batches merged into micro-batches of up to this many
        tokens (:mod:`~megatron_grpo.megatron.batch.merge`; the host's cost is per layer and
        micro-batch, not per token). The result is the same per batch. Every rank of a model
        replica must pass the same batches.

        ``count_group``: the ranks whose forwards are collectives with each other (MoE expert
        parallelism over DP: the trainer passes the DP group) agree on the number of forwards
        by one all-reduce: a rank with fewer splits its merged groups, then runs its smallest
        batch again and drops the result, so no rank waits in a collective the others never
        reach. Needs a dispatcher that takes different token counts per rank (all-to-all).
        """
        singles = [[i] for i in range(len(batches))]
        groups = singles if max_tokens is None else merge_groups(batches, max_tokens)
        extra = 0
        if count_group is not None:  # one small all-reduce: the group's forward count
            count = all_reduce_max([len(groups)], count_group, torch.int64)[0]
            groups, extra = match_count(groups, count)
        if extra and not batches:
            raise ValueError("compute_logprobs: a rank of count_group has no batch to run")
        merged = [merge_packed([batches[i] for i in g]) for g in groups]
        # forwards to match the group's count: the smallest batch again, its output dropped
        spare = min(batches, key=lambda b: b.num_tokens) if extra else None
        out = self._logprob_passes(model, merged + [spare] * extra, count_group)
        return [
            lp
            for g, m in zip(groups, out[: len(groups)], strict=True)
            for lp in split_merged(m, [batches[i] for i in g])
        ]

    def _logprob_passes(
        self,
        model: list[torch.nn.Module],
        batches: list[PackedBatch],
        count_group: dist.ProcessGroup | None = None,
    ) -> list[Tensor]:
        for chunk in model:
            chunk.eval()
        replay = any(b.routes is not None for b in batches)
        try:
            if self.logprob_graphs:
                layout = self.layout_of(unwrap(model[0]))
                return graphed_logprob_passes(
                    model[0],
                    batches,
                    self.path.logprobs,
                    layout,
                    self.graphs,
                    count_group,
                )
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
        layout = self.layout_of(unwrap(model[-1]))
        last = layout.is_pipeline_last_stage
        return [
            full_logprobs(out[i]["logprobs"] if last else None, batch, layout)
            for i, batch in enumerate(batches)
        ]
