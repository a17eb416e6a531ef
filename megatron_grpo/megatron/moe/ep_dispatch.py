"""Expert-parallel token dispatch whose shapes do not depend on the routing (no host sync).

megatron-core's all-to-all dispatcher moves each token to the ranks of its experts: the split
sizes of its all-to-all come from the routing, so it copies them to the host (a sync per layer)
and a decode step through it cannot be captured in a CUDA graph. Decode batches are small
(hundreds of tokens per rank), so :class:`GatheredTokenDispatcher` sends every token of the
expert-parallel group to every rank of it instead, with fixed shapes:

    x_g = all_gather(x)                     # [P*T, H]   the group's tokens (+ ids and probs)
    order = argsort(local expert or E_l)    # this rank's (token, slot) pairs first, by expert
    y = experts(x_g[order[:M] // k], ends)  # [M, H]     M = P*T*min(k, E_l): never too few
    out_g = sum of each token's local rows  # [P*T, H]   fp32, zero for tokens routed elsewhere
    out = reduce_scatter(out_g)             # [T, H]     each token's k experts summed

``ends`` (the cumulative per-expert counts) stay on the device; the grouped GEMM computes the
rows of the local experts only (rows past ``ends[-1]`` are left alone and never read). With
tokens that are the same on every rank of the group (tensor parallelism without sequence
parallelism, the expert group inside the TP group: generation of the recipe's EP 2 layout)
nothing is gathered: each rank runs its experts on its tokens and the partial sums are
all-reduced. Where the TP group lies inside a larger expert group (EP 4 or 8 with TP 2, no SP:
the 30B-A3B recipe's generation), each TP rank brings only its 1/TP slice of the (same) tokens,
so every token reaches the experts once, not TP times; the combined slices are all-gathered
over TP (a token count not divisible by TP is padded with rows routed to no expert).

Gradients: the all-gather's backward is a reduce-scatter (and the all-reduce's an identity over
replicated inputs, the input's an all-reduce), the row gathers are inverted by gathers on the
inverse permutation (no atomics), so outputs, input, expert and router gradients equal the
all-to-all dispatcher's. Every rank of the group must bring the same number of tokens (the
engine's forwards do: the group pads to its largest batch).

The choice between this dispatch and megatron-core's is :func:`choose_dispatch`, made per
forward from data on each layer (:class:`EPDispatch`): ``dispatch`` ("auto", "alltoall",
"gathered"; ``LayerKernels.moe_dispatch``, given when the model is built) and ``sync_free``
(:func:`no_host_sync`, around the engine's decode steps). "auto" takes the gathered dispatch where no host sync is wanted and
megatron-core's elsewhere (prefill and training batches are large, and their token counts
differ between ranks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from torch import Tensor

from megatron_grpo.megatron.moe.alltoall_permute import use_sort_permute
from megatron_grpo.megatron.moe.permute import gather_rows, sum_rows
from megatron_grpo.ops.kernels import CHOICES, check_choice
from megatron_grpo.ops.layers.sort_keys import sort_keys

EP_DISPATCHES = CHOICES["moe_dispatch"]


def gathered_dispatch_unsupported(config, groups) -> str | None:
    """Why :class:`GatheredTokenDispatcher` cannot serve this MoE layer (None: it can): expert-TP
    of 1 and dropless routing (every token keeps its k experts)."""
    bad = []
    if groups.expt_tp.size() != 1:
        bad.append(f"expert_tensor_parallel_size={groups.expt_tp.size()}")
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        bad.append("moe_expert_capacity_factor (token dropping)")
    if getattr(config, "moe_router_padding_for_quantization", False):
        bad.append("moe_router_padding_for_quantization")
    if getattr(config, "moe_shared_expert_overlap", False):
        bad.append("moe_shared_expert_overlap")
    if getattr(config, "moe_latent_size", None):
        bad.append("moe_latent_size")
    return ", ".join(bad) or None


def gathered_decode_width(config) -> int:
    """Elements one token of a decode step keeps live in one MoE layer under the gathered
    dispatch (0 where it does not run: no MoE, EP 1): its C gathered copies (C = P, or P / TP
    where each TP rank brings a 1/TP slice), their C * min(k, E_local) permuted rows through the
    experts (input and output ``H``, fc1 ``2F`` and SwiGLU ``F``; fixed sizes whatever the
    routing) and the fp32 sum (2 ``H`` of 16 bits); sliced, the TP all-gather's fp32 ``[T, H]``
    besides."""
    p = getattr(config, "expert_model_parallel_size", 1) or 1
    if not config.num_moe_experts or p == 1:
        return 0
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    sliced = 1 < tp < p and p % tp == 0  # megatron-core's expert groups hold whole TP groups
    rows = p * min(config.moe_router_topk, config.num_moe_experts // p)
    ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
    hidden = config.hidden_size
    width = 3 * p * hidden + rows * (2 * hidden + 3 * ffn + 2)
    return -(-width // tp) + 2 * hidden if sliced else width


def choose_dispatch(choice: str, sync_free: bool, gathered_why: str | None) -> str:
    """The one decision, per forward: "gathered" or "megatron" (megatron-core's dispatcher).

    ``choice`` (:data:`EP_DISPATCHES`): "auto" = gathered where no host sync is wanted
    (``sync_free``: the engine's decode steps) and the layer supports it; an explicit
    "gathered" the layer cannot run is an error naming why."""
    if choice not in EP_DISPATCHES:
        raise ValueError(f"MoE dispatch must be one of {EP_DISPATCHES}, got {choice!r}")
    if choice == "gathered" and gathered_why is not None:
        raise ValueError(f"MoE dispatch 'gathered' does not support {gathered_why}")
    if choice == "gathered" or (choice == "auto" and sync_free and gathered_why is None):
        return "gathered"
    return "megatron"


@dataclass
class EPDispatch:
    """A layer's dispatchers at EP > 1 and what picks between them (:func:`choose_dispatch`)."""

    megatron: MoETokenDispatcher
    gathered: GatheredTokenDispatcher | None
    gathered_why: str | None
    choice: str = "auto"  # EP_DISPATCHES: LayerKernels.moe_dispatch
    sync_free: bool = False  # no_host_sync: the engine's decode steps

    @classmethod
    def of(
        cls,
        layer,
        built: MoETokenDispatcher,
        groups,
        choice: str = "auto",
        sort: str = "auto",
        impl: str = "auto",
    ) -> EPDispatch:
        """``built``: megatron-core's dispatcher of ``layer``; ``groups``: its ``ep``,
        ``expt_tp``, ``tp_ep`` and the attention ``tp`` group; ``choice``: the model's
        ``LayerKernels.moe_dispatch`` ("gathered" where it cannot run is an error here);
        ``sort``: its ``moe_sort``; ``impl``: its ``elementwise``."""
        use_sort_permute()  # megatron-core's dispatcher: one host sync a layer (split sizes)
        why = gathered_dispatch_unsupported(layer.config, groups)
        gathered = None
        if why is None:
            offset = layer.local_expert_indices[0]
            gathered = GatheredTokenDispatcher(
                layer.num_local_experts, offset, layer.config, groups, sort, impl
            )
        choose_dispatch(choice, True, why)  # refuse an impossible choice at build time
        return cls(built, gathered, why, choice)

    def resolve(self, sync_free: bool | None = None) -> str:
        return choose_dispatch(
            self.choice, self.sync_free if sync_free is None else sync_free, self.gathered_why
        )

    def pick(self) -> MoETokenDispatcher:
        return self.gathered if self.resolve() == "gathered" else self.megatron


def _ep_layers(model) -> list:
    chunks = model if isinstance(model, list) else [model]
    modules = [m for c in chunks for m in c.modules()]
    return [m for m in modules if isinstance(getattr(m, "ep_dispatch", None), EPDispatch)]


@contextlib.contextmanager
def no_host_sync(model) -> Iterator[None]:
    """Forwards of ``model`` inside want no host sync (a decode step, captured or not): "auto"
    layers take the gathered dispatch. Every rank of an expert group must enter it for the
    same forwards."""
    layers = _ep_layers(model)
    before = [layer.ep_dispatch.sync_free for layer in layers]
    for layer in layers:
        layer.ep_dispatch.sync_free = True
    try:
        yield
    finally:
        for layer, value in zip(layers, before, strict=True):
            layer.ep_dispatch.sync_free = value


def _ranks(group) -> list[int] | None:
    if group is None or not dist.is_initialized():
        return None
    return sorted(dist.get_process_group_ranks(group))


@dataclass
class _Routing:
    """One forward's device-side routing of the gathered pairs (see :meth:`_route`)."""

    rows: Tensor  # [M] the gathered token of each permuted row
    pair_rows: Tensor  # [M] the (token, slot) pair of each permuted row
    back: Tensor  # [G, k] each pair's permuted row (M: not a local expert)
    valid: Tensor  # [M] rows of local pairs (the rest are never read)
    counts: Tensor  # [E_local] rows per local expert


class GatheredTokenDispatcher(MoETokenDispatcher):
    """megatron-core's dispatcher interface over the gathered tokens (module docstring)."""

    def __init__(
        self,
        num_local_experts: int,
        local_offset: int,
        config,
        groups,
        sort: str = "auto",
        impl: str = "auto",
    ) -> None:
        """``sort``: ``LayerKernels.moe_sort`` (``ops.layers.sort_keys``); ``impl``: its
        ``elementwise`` (the combine's row sums, ``ops.layers.gather_sum``)."""
        super().__init__(config=config, pg_collection=groups)
        self.num_local_experts = num_local_experts
        self.local_offset = local_offset
        self.sort = sort
        self.impl = check_choice("impl", impl, "elementwise")
        self.topk = config.moe_router_topk
        tp_ranks, ep_ranks = _ranks(getattr(groups, "tp", None)), _ranks(self.ep_group)
        known = tp_ranks is not None and ep_ranks is not None
        # without SP, tokens are the same on every rank of a TP group: over the whole expert
        # group when it lies inside the TP group, else on each TP group inside it
        self.ep_in_tp = known and set(ep_ranks) <= set(tp_ranks)
        self.tp_in_ep = known and len(tp_ranks) > 1 and set(tp_ranks) < set(ep_ranks)
        self.tp_group = groups.tp if self.tp_in_ep else None
        self._shape: torch.Size | None = None
        self._dtypes: tuple[torch.dtype, torch.dtype] | None = None
        self._routing: _Routing | None = None

    def replicated(self) -> bool:
        """Whether this forward's tokens are the same on every rank of the expert group."""
        return self.ep_in_tp and not self.config.sequence_parallel

    def tp_sliced(self) -> bool:
        """Whether this forward's tokens are the same on each TP group inside the expert group
        (each TP rank then dispatches only its slice of them)."""
        return self.tp_in_ep and not self.config.sequence_parallel

    def dispatch_preprocess(self, hidden_states: Tensor, routing_map: Tensor, probs: Tensor):
        """``hidden_states [..., H]``, ``routing_map [T, E]`` (k per row), ``probs [T, E]`` ->
        (tokens ``[T, H]``, their probs and expert ids ``[T, 2k]`` fp32: one gather for both;
        ids are exact in fp32)."""
        self._shape = hidden_states.shape
        self._dtypes = (hidden_states.dtype, probs.dtype)
        tokens = hidden_states.reshape(-1, self._shape[-1])
        ids = torch.topk(routing_map.to(torch.uint8), self.topk, dim=1, sorted=False).indices
        meta = torch.cat([probs.gather(1, ids).float(), ids.float()], dim=1)
        if self.tp_sliced():
            return self._tp_slice(tokens, meta)
        return tokens, meta

    def _tp_slice(self, tokens: Tensor, meta: Tensor) -> tuple[Tensor, Tensor]:
        """This TP rank's slice ``[ceil(T / TP), ...]`` of the TP group's same tokens and meta
        (backward: the slices' gradients all-gathered); padding rows go to no expert."""
        pad = -tokens.size(0) % self.tp_group.size()
        if pad:
            tokens = torch.cat([tokens, tokens.new_zeros(pad, tokens.size(1))])
            fill = meta.new_zeros(pad, meta.size(1))
            fill[:, self.topk :] = self.config.num_moe_experts  # no rank's local expert
            meta = torch.cat([meta, fill])
        scatter = scatter_to_sequence_parallel_region
        return scatter(tokens, group=self.tp_group), scatter(meta, group=self.tp_group)

    def token_dispatch(self, hidden_states: Tensor, probs: Tensor):
        """The group's tokens ``[P*T, H]`` and their meta ``[P*T, 2k]`` (no copy when
        replicated)."""
        if self.replicated():
            move = copy_to_tensor_model_parallel_region  # backward: the partial grads summed
            return move(hidden_states, group=self.ep_group), move(probs, group=self.ep_group)
        gather = gather_from_sequence_parallel_region
        return gather(hidden_states, group=self.ep_group), gather(probs, group=self.ep_group)

    def dispatch_postprocess(self, hidden_states: Tensor, probs: Tensor):
        """-> (rows of the local experts first, by expert ``[M, H]``, ``tokens_per_expert``
        ``[E_local]`` on the device, their probs ``[M]``)."""
        k = self.topk
        ids = probs[:, k:].detach().long()
        r = self._routing = self._route(ids)
        rows = gather_rows(hidden_states, r.rows, r.back, self.impl)
        flat = probs[:, :k].reshape(-1, 1)
        permuted_probs = gather_rows(flat, r.pair_rows, r.back.reshape(-1, 1), self.impl)
        return rows, r.counts, permuted_probs.view(-1).to(self._dtypes[1])

    def _route(self, ids: Tensor) -> _Routing:
        """Sort the gathered (token, slot) pairs ``ids [G, k]``: this rank's experts first (by
        expert, tokens ascending), the rest after; keep the first ``G * min(k, E_local)``."""
        g, k, e = ids.size(0), self.topk, self.num_local_experts
        m = g * min(k, e)
        order, back, counts = sort_keys(ids, self.local_offset, e, m, self.sort)
        pair_rows = order[:m]
        valid = torch.arange(m, device=ids.device) < counts.sum()
        rows = torch.div(pair_rows, k, rounding_mode="floor")
        return _Routing(rows, pair_rows, back.view(g, k), valid, counts)

    def combine_preprocess(self, hidden_states: Tensor) -> Tensor:
        """Expert outputs ``[M, H]`` -> each gathered token's local experts summed ``[P*T, H]``
        (fp32)."""
        r, self._routing = self._routing, None
        return sum_rows(hidden_states, r.back, r.rows, r.valid, torch.float32, self.impl)

    def token_combine(self, hidden_states: Tensor) -> Tensor:
        """Sum the group's partial outputs (fp32): this rank's tokens ``[T, H]``."""
        if self.replicated():
            return reduce_from_tensor_model_parallel_region(hidden_states, group=self.ep_group)
        out = reduce_scatter_to_sequence_parallel_region(hidden_states, group=self.ep_group)
        if self.tp_sliced():  # the TP group's slices back together (backward: this slice)
            return gather_from_sequence_parallel_region(
                out, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return out

    def combine_postprocess(self, hidden_states: Tensor) -> Tensor:
        """``[T (+ TP padding), H]`` fp32 -> the input's shape and dtype."""
        shape, self._shape = self._shape, None
        rows = shape.numel() // shape[-1]
        return hidden_states[:rows].to(self._dtypes[0]).view(shape)
