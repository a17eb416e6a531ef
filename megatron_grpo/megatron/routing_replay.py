"""Rollout Routing Replay (R3) for megatron-core MoE routers: record the top-k expert selection of
a forward, and replay a given selection in later forwards.

API (``model``: a GPTModel, a wrapped chunk, or the list of chunks ``build_model`` returns)::

    with record_routes(model) as rec:       # e.g. during generation
        model(...)                           # every forward since the last take() ...
        routes = rec.take()                  # ... as int64 [T, L, k]
    with replay_routes(model, routes):       # training / log-prob passes
        loss = forward(...); loss.backward()  # backward (and recompute) inside the block

Layout of ``routes``: ``[T, L, k]`` with ``T`` the forward's input tokens in the order of its
input ids flattened row-major (``[B, S]`` -> ``B * S``; a packed THD batch is ``[1, T]``),
``L`` the MoE layers of the whole model in layer order, ``k = moe_router_topk``. Under TP the
tokens are the full sequence of the TP group (with sequence parallelism the router sees only a
1/TP shard: recording all-gathers it, replay slices it); under CP this rank's CP-local tokens;
under EP each rank's own tokens. Under PP a rank holds only its stage's layers: ``take()``
returns those (``L`` = this rank's MoE layers), ``replay_routes`` takes the whole ``L``.

Replay semantics: only the *selection* is replayed. The router still computes its logits and
scores from the live weights and the gating weights are the live scores gathered at the
replayed ids (megatron-core's ``RouterReplay`` convention), so the router keeps its gradient.
Rows of ``-1`` (tokens without recorded routes: prompt tokens of a response-only file, padding)
use the live top-k. Recomputed layers (activation recompute) replay the same ids in backward.

Mechanism: megatron-core (>= 0.16) passes each ``TopKRouter.router_replay`` object to
``topk_routing_with_score_function``, which calls its ``get_replay_topk`` instead of the
top-k. We install our own object in that slot (instead of megatron's ``RouterReplay``, whose
global instance list would mix the policy's and the reference model's routers and whose replay
has no "live" rows). megatron-core 0.14 / 0.15 lack the slot: a clear error.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.megatron.gpt import unwrap
from megatron_grpo.megatron.layer_spec import moe_layer_pattern

TopK = Callable[..., tuple[Tensor, Tensor]]


@dataclass
class _RouteHook:
    """Stands in megatron's ``RouterReplay`` slot of one router (duck-typed ``get_replay_topk``)."""

    layer: int  # index among the model's MoE layers
    config: Any  # the router's TransformerConfig
    mode: str | None = None  # None (live), "record" or "replay"
    shape: tuple[int, int] = (0, 0)  # (S_local, B) of the router's current input
    # (ids, (S_local, B), sequence parallel) of each recorded forward
    recorded: list[tuple[Tensor, tuple[int, int], bool]] = field(default_factory=list)
    routes: Tensor | None = None  # [T, k] full-sequence routes of the next forwards
    recompute: deque = field(default_factory=deque)  # local ids of forwards, for backward
    stats: Tensor | None = None  # [mismatched, replayed] (token, layer) pairs

    @property
    def sequence_parallel(self) -> bool:
        # Read per forward: generation switches sequence parallelism off and back on.
        return bool(self.config.sequence_parallel)

    def get_replay_topk(
        self, scores: Tensor, topk: int, num_groups=None, group_topk=None, default_compute_topk=None
    ) -> tuple[Tensor, Tensor]:
        live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.mode == "record":
            self.recorded.append((live[1].detach(), self.shape, self.sequence_parallel))
            return live
        if self.mode != "replay":
            return live
        if _in_backward():  # activation recompute of a forward below
            if not self.recompute:
                raise RuntimeError("routing replay: a recompute in backward has no stored routes")
            target = self.recompute.popleft().to(scores.device)
        else:
            target = self._local_target(scores.shape[0], topk).to(scores.device)
            self.recompute.append(target)
            self._count(live[1], target)
        have = target[:, :1] >= 0
        ids = torch.where(have, target, live[1])
        return scores.gather(1, ids), ids

    def _local_target(self, n: int, topk: int) -> Tensor:
        """This router's rows of ``routes``, in its token order (S-major, SP shard)."""
        if self.routes is None:
            raise RuntimeError(
                "routing replay is active but no routes were set for this forward "
                "(set_replay_routes / PackedBatch.routes)"
            )
        s_local, b = self.shape
        t = self.routes.shape[0]
        tp = parallel_state.get_tensor_model_parallel_world_size() if self.sequence_parallel else 1
        if s_local * b != n or t != s_local * b * tp or self.routes.shape[1] != topk:
            raise ValueError(
                f"routing replay: routes for {t} tokens x top-{self.routes.shape[1]} do not fit "
                f"the router input [S={s_local}, B={b}] x top-{topk} (TP shards={tp})"
            )
        r = self.routes.view(b, s_local * tp, topk).transpose(0, 1)
        if tp > 1:
            rank = parallel_state.get_tensor_model_parallel_rank()
            r = r[rank * s_local : (rank + 1) * s_local]
        return r.reshape(-1, topk)

    def _count(self, live: Tensor, target: Tensor) -> None:
        have = target[:, 0] >= 0
        differ = (live.sort(dim=1).values != target.sort(dim=1).values).any(dim=1) & have
        new = torch.stack([differ.sum(), have.sum()]).to(torch.float64)
        self.stats = new if self.stats is None else self.stats + new


def _in_backward() -> bool:
    """Whether autograd is running a backward (where megatron's checkpointing recomputes)."""
    return torch._C._current_graph_task_id() != -1


def _check_megatron() -> None:
    from megatron.core.transformer.moe import moe_utils

    params = inspect.signature(moe_utils.topk_routing_with_score_function).parameters
    if "router_replay" not in params:
        raise RuntimeError(
            "MoE routing replay needs megatron-core >= 0.16 (topk_routing_with_score_function's "
            "router_replay hook); this megatron-core has none: upgrade it or set "
            "model.moe_enable_routing_replay=false"
        )


def _chunks(model) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _gpt(chunk: torch.nn.Module) -> torch.nn.Module:
    return unwrap(chunk)


def _save_shape(hook: _RouteHook) -> Callable:
    def pre_hook(_module, args, kwargs=None):
        x = args[0] if args else kwargs["input"]
        hook.shape = (x.shape[0], x.shape[1])

    return pre_hook


def route_hooks(model) -> list[_RouteHook]:
    """The route hooks of ``model``'s MoE routers (installed on first use), in layer order."""
    hooks = []
    for chunk in _chunks(model):
        gpt = _gpt(chunk)
        pattern = moe_layer_pattern(gpt.config)
        for layer in gpt.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is None:
                continue
            hook = router.router_replay
            if not isinstance(hook, _RouteHook):
                hook = _install(router, sum(pattern[: layer.layer_number - 1]))
            hooks.append(hook)
    if not hooks:
        raise ValueError("routing replay: the model has no MoE router")
    return sorted(hooks, key=lambda h: h.layer)


def _install(router: torch.nn.Module, layer: int) -> _RouteHook:
    _check_megatron()
    if getattr(router.config, "moe_router_fusion", False):
        raise ValueError(
            "routing replay needs moe_router_fusion=False (the fused top-k has no hook)"
        )
    if router.routing_type in ("sinkhorn", "quantile_balancing"):
        raise ValueError(f"routing replay does not support {router.routing_type!r} routing")
    hook = _RouteHook(layer=layer, config=router.config)
    router.register_forward_pre_hook(_save_shape(hook), with_kwargs=True)
    router.router_replay = hook
    return hook


def num_moe_layers(config) -> int:
    """MoE layers of the whole model (the ``L`` of a routes tensor)."""
    return sum(moe_layer_pattern(config))


class RouteRecorder:
    """Yielded by :func:`record_routes`."""

    def __init__(self, hooks: list[_RouteHook]) -> None:
        self.hooks = hooks

    def take(self) -> Tensor:
        """Routes of the forwards since the last take: int64 ``[T, L_local, k]`` (see the module
        docstring). Under sequence parallelism a collective over the TP group."""
        layers = [self._layer(h) for h in self.hooks]
        for h in self.hooks:
            h.recorded = []
        return torch.stack(layers, dim=1)

    def _layer(self, hook: _RouteHook) -> Tensor:
        parts = []
        for ids, (s_local, b), sequence_parallel in hook.recorded:
            x = ids.view(s_local, b, -1)
            if sequence_parallel:
                x = _gather_tp(x)
            parts.append(x.transpose(0, 1).reshape(-1, x.shape[-1]))
        if not parts:
            raise RuntimeError(f"no forward recorded routes of MoE layer {hook.layer}")
        return torch.cat(parts).long()


def _gather_tp(x: Tensor) -> Tensor:
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


@contextlib.contextmanager
def _mode(hooks: list[_RouteHook], mode: str) -> Iterator[None]:
    busy = [h.layer for h in hooks if h.mode is not None]
    if busy:
        raise RuntimeError(f"routing replay: MoE layers {busy} are already recording/replaying")
    for h in hooks:
        h.mode = mode
    try:
        yield
    finally:
        for h in hooks:
            h.mode, h.routes, h.recorded = None, None, []
            h.recompute.clear()


@contextlib.contextmanager
def record_routes(model) -> Iterator[RouteRecorder]:
    """While active, every MoE router of ``model`` records its top-k ids of each forward."""
    hooks = route_hooks(model)
    with _mode(hooks, "record"):
        yield RouteRecorder(hooks)


@contextlib.contextmanager
def replay_routes(model, routes: Tensor | None = None) -> Iterator[None]:
    """While active, ``model``'s forwards (and their recomputes in backward) use the given top-k
    selection: ``routes`` ``[T, L, k]`` for all forwards inside, or per forward with
    :func:`set_replay_routes` (pipeline schedules: ``GRPOStep`` sets each micro-batch's routes).
    Run the backward inside the block when layers are recomputed."""
    hooks = route_hooks(model)
    with _mode(hooks, "replay"):
        if routes is not None:
            set_replay_routes(model, routes)
        yield


def set_replay_routes(model, routes: Tensor) -> None:
    """The routes ``[T, L, k]`` of ``model``'s next forwards; needs an active
    :func:`replay_routes`. Each router takes its own layer's column."""
    hooks = route_hooks(model)
    if any(h.mode != "replay" for h in hooks):
        raise RuntimeError("set_replay_routes needs an active replay_routes(model) block")
    gpt = _gpt(_chunks(model)[0])
    total = num_moe_layers(gpt.config)
    if routes.dim() != 3 or routes.shape[1] != total:
        raise ValueError(f"routes must be [T, {total} MoE layers, top-k], got {list(routes.shape)}")
    # One copy to the model's device per micro-batch, queued without a sync: a blocking copy of
    # each layer's column from pageable host memory would wait for the GPU at every MoE layer.
    device = next(gpt.parameters()).device
    routes = host_to_device(routes, device)
    for h in hooks:
        h.routes = routes[:, h.layer]


def replay_mismatch(model, reset: bool = True) -> Tensor:
    """float64 ``[mismatched, replayed]`` (token, layer) pairs of this rank's replayed forwards
    (recomputes not counted) since the last reset: "mismatched" = live top-k set differs from
    the replayed one. Sum over ranks before dividing (all-reduce)."""
    total = torch.zeros(2, dtype=torch.float64)
    for h in route_hooks(model):
        if h.stats is not None:
            total += h.stats.cpu()
        if reset:
            h.stats = None
    return total
