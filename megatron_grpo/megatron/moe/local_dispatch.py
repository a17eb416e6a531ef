"""MoE token dispatch when every expert of a layer is on this rank: sort, no communication.

At EP = expert-TP = TP = 1 megatron-core's dispatchers still build their general machinery:
the all-to-all dispatcher permutes with a boolean mask (``masked_select``: a host sync for the
output size), moves the per-expert counts to the host (another sync) and scatter-adds the
expert outputs back with atomics. :class:`LocalTokenDispatcher` keeps megatron-core's dispatcher
interface (``dispatch_preprocess`` ... ``combine_postprocess``) and its permuted layout
(expert-major, tokens ascending: the same rows and ``permuted_probs`` its ``permute`` gives), but
computes the order with one stable ``argsort`` of the top-k expert ids and the counts with a
``scatter_add`` on the device (``moe.permute.sort_by_expert``), gathers the tokens, and combines
by gathering each token's k rows and summing them in fp32 (no atomics). Nothing syncs with the
host, so a decode step through it can be captured in a CUDA graph.

:class:`GroupedMoELayer` is megatron-core's ``MoELayer`` that uses it where
:func:`local_dispatch_unsupported` finds nothing (the portable spec builds it with grouped
experts); elsewhere megatron-core's own dispatcher runs, or, at EP > 1 where no host sync is
wanted (decode steps), the gathered dispatch of :mod:`.ep_dispatch`.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from torch import Tensor

from megatron_grpo.megatron.moe.ep_dispatch import EPDispatch
from megatron_grpo.megatron.moe.permute import combine_tokens, permute_tokens, sort_by_expert
from megatron_grpo.ops.kernels import check_choice


def local_dispatch_unsupported(config, pg_collection=None) -> str | None:
    """Why the local dispatch cannot serve this MoE layer (None: it can): tokens must stay on
    this rank (EP, expert-TP and TP of 1) and every token must keep its k experts (dropless)."""
    sizes = {
        "expert_model_parallel_size": config.expert_model_parallel_size,
        "expert_tensor_parallel_size": config.expert_tensor_parallel_size or 1,
        "tensor_model_parallel_size": config.tensor_model_parallel_size,
    }
    if pg_collection is not None and hasattr(pg_collection, "tp_ep"):
        sizes["tp_ep group"] = pg_collection.tp_ep.size()
    bad = [f"{name}={size}" for name, size in sizes.items() if size != 1]
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        bad.append("moe_expert_capacity_factor (token dropping)")
    if getattr(config, "moe_shared_expert_overlap", False):
        bad.append("moe_shared_expert_overlap")
    if getattr(config, "moe_latent_size", None):
        bad.append("moe_latent_size")
    return ", ".join(bad) or None


class LocalTokenDispatcher(MoETokenDispatcher):
    """megatron-core's dispatcher interface for a layer whose experts are all local."""

    def __init__(
        self,
        num_local_experts: int,
        config,
        pg_collection=None,
        sort: str = "auto",
        impl: str = "auto",
    ) -> None:
        """``sort``: ``LayerKernels.moe_sort`` (``ops.layers.sort_keys``); ``impl``: its
        ``elementwise`` (the row sums of the combine and the permute's backward)."""
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_experts = num_local_experts
        self.sort = sort
        self.impl = check_choice("impl", impl, "elementwise")
        self.topk = config.moe_router_topk
        self._state: tuple[Tensor, Tensor, torch.Size] | None = None
        self._counts: Tensor | None = None

    def dispatch_preprocess(self, hidden_states: Tensor, routing_map: Tensor, probs: Tensor):
        """``hidden_states [..., H]``, ``routing_map [T, E]`` (k per row), ``probs [T, E]`` ->
        (the tokens in expert order ``[T*k, H]``, their probs ``[T*k]``)."""
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        # the k experts of each token: top-k of its 0/1 row (exactly k ones: dropless)
        ids = torch.topk(routing_map.to(torch.uint8), self.topk, dim=1, sorted=False).indices
        order, inverse, self._counts = sort_by_expert(ids, self.num_experts, self.sort)
        self._state = (order, inverse, shape)
        permuted_probs = probs.gather(1, ids).reshape(-1).index_select(0, order)
        return permute_tokens(tokens, order, inverse, self.topk, self.impl), permuted_probs

    def token_dispatch(self, hidden_states: Tensor, probs: Tensor):
        return hidden_states, probs  # nothing to send

    def dispatch_postprocess(self, hidden_states: Tensor, probs: Tensor):
        counts, self._counts = self._counts, None
        return hidden_states, counts, probs  # tokens_per_expert stays on the device

    def combine_preprocess(self, hidden_states: Tensor) -> Tensor:
        return hidden_states

    def token_combine(self, hidden_states: Tensor) -> Tensor:
        return hidden_states

    def combine_postprocess(self, hidden_states: Tensor) -> Tensor:
        order, inverse, shape = self._state
        self._state = None
        return combine_tokens(hidden_states, order, inverse, self.topk, self.impl).view(shape)


class GroupedMoELayer(MoELayer):
    """megatron-core's ``MoELayer`` with :class:`LocalTokenDispatcher` where it applies
    (``local_dispatch`` says whether it does; the decision is :func:`local_dispatch_unsupported`);
    elsewhere ``ep_dispatch`` picks megatron-core's dispatcher or the gathered one per forward
    (``moe.ep_dispatch.choose_dispatch``)."""

    def __init__(
        self,
        config,
        *args,
        moe_dispatch: str = "auto",
        moe_sort: str = "auto",
        elementwise: str = "auto",
        default_groups=None,
        **kwargs,
    ) -> None:
        """``moe_dispatch``: ``LayerKernels.moe_dispatch`` (applies at EP > 1); ``moe_sort``:
        ``LayerKernels.moe_sort`` (both dispatches of ours); ``elementwise``: its
        ``elementwise`` (both dispatches' row sums). ``default_groups``: the model's
        own process groups where megatron-core (< 0.19) hands a subclass none."""
        if kwargs.get("pg_collection") is None and default_groups is not None:
            kwargs["pg_collection"] = default_groups
        super().__init__(config, *args, **kwargs)
        built = self.token_dispatcher  # megatron-core's, for its process groups
        groups = SimpleNamespace(ep=built.ep_group, expt_tp=built.tp_group, tp_ep=built.tp_ep_group)
        groups.tp = getattr(self, "attn_tp_group", None)
        if local_dispatch_unsupported(config) is None and groups.tp_ep.size() == 1:
            self.token_dispatcher = LocalTokenDispatcher(
                self.num_local_experts, config, groups, moe_sort, elementwise
            )
        self.local_dispatch = isinstance(self.token_dispatcher, LocalTokenDispatcher)
        # tokens leave the rank: megatron-core's dispatcher or the gathered one, per forward
        self.ep_dispatch = (
            None
            if self.local_dispatch
            else EPDispatch.of(self, built, groups, moe_dispatch, moe_sort, elementwise)
        )

    def forward(self, hidden_states, *args, **kwargs):
        if self.ep_dispatch is not None:
            self.token_dispatcher = self.ep_dispatch.pick()
        return super().forward(hidden_states, *args, **kwargs)


def host_sync_reason(model: torch.nn.Module) -> str | None:
    """Why a decode step of ``model`` (a forward under ``ep_dispatch.no_host_sync``) syncs with
    the host in its MoE layers (None: it does not, so it can be captured in a CUDA graph): every
    MoE layer must be a :class:`GroupedMoELayer` on the local dispatch (EP = TP = 1) or the
    gathered one (``ep_dispatch``) whose grouped experts run torch's grouped GEMM (the padded
    fallback sizes its buffer on the host)."""
    from megatron_grpo.megatron.moe.grouped_experts import GroupedExperts
    from megatron_grpo.ops.layers.grouped_mm import grouped_mm_supports

    for i, layer in enumerate(model.decoder.layers):
        mlp = layer.mlp
        if not hasattr(mlp, "router"):
            continue  # a dense layer
        experts = mlp.experts
        if not isinstance(experts, GroupedExperts):
            return f"layer {i}: {type(experts).__name__} experts (moe_grouped_gemm=false)"
        ep = getattr(mlp, "ep_dispatch", None)  # decode steps run under ep_dispatch.no_host_sync
        if ep is not None and ep.resolve(sync_free=True) != "gathered":
            why = ep.gathered_why or f"model.layer_kernels.moe_dispatch={ep.choice!r}"
            return f"layer {i}: megatron-core's token dispatcher ({why})"
        if ep is None and not getattr(mlp, "local_dispatch", False):
            why = local_dispatch_unsupported(mlp.config) or "megatron-core's MoELayer"
            return f"layer {i}: megatron-core's token dispatcher ({why})"
        for w in (experts.weight1, experts.weight2):
            why = grouped_mm_supports(w.new_empty(1, w.size(2)), w)
            if experts.gemm_impl == "padded_bmm":
                why = "layer_kernels.grouped_gemm='padded_bmm'"
            if why:
                return f"layer {i}: the padded grouped-GEMM fallback ({why})"
    return None
