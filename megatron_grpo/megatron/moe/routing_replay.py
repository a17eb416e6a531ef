"""Rollout Routing Replay (R3) for megatron-core MoE routers: record the top-k expert selection of
a forward, and replay a given selection in later forwards.

API (``model``: a GPTModel, a wrapped chunk, or the list of chunks ``build_model`` returns)::

    with record_routes(model) as rec:       # e.g. during generation
        model(...)                           # every forward since the last take() ...
        routes = rec.take()                  # ... as int64 [T, L, k]
    with replay_routes(model, routes):       # training / log-prob passes
        loss = forward(...); loss.backward()  # backward (and recompute) inside the block

:class:`RoutingReplay` is the trainer's view of it (check, scope, after-pass hooks, metrics);
:meth:`RoutingReplay.of` gives a no-op :class:`NoRoutingReplay` when replay is off.

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.loss.math import kl_estimate
from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.megatron.batch.packing import PackedBatch
from megatron_grpo.megatron.gpt import unwrap
from megatron_grpo.megatron.moe.layers import moe_layer_pattern
from megatron_grpo.megatron.parallel import all_reduce_sum

TopK = Callable[..., tuple[Tensor, Tensor]]


@dataclass
class _RouteHook:
    """Stands in megatron's ``RouterReplay`` slot of one router (duck-typed ``get_replay_topk``)."""

    layer: int  # index among the model's MoE layers
    config: Any  # the router's TransformerConfig
    tp_group: Any = None  # the router's TP group (megatron-core's ``router.tp_group``)
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
        tp = self.tp_group.size() if self.sequence_parallel else 1
        if s_local * b != n or t != s_local * b * tp or self.routes.shape[1] != topk:
            raise ValueError(
                f"routing replay: routes for {t} tokens x top-{self.routes.shape[1]} do not fit "
                f"the router input [S={s_local}, B={b}] x top-{topk} (TP shards={tp})"
            )
        r = self.routes.view(b, s_local * tp, topk).transpose(0, 1)
        if tp > 1:
            rank = self.tp_group.rank()
            r = r[rank * s_local : (rank + 1) * s_local]
        return r.reshape(-1, topk)

    def _count(self, live: Tensor, target: Tensor) -> None:
        have = target[:, 0] >= 0
        differ = (live.sort(dim=1).values != target.sort(dim=1).values).any(dim=1) & have
        new = torch.stack([differ.sum(), have.sum()]).to(torch.float64)
        if self.stats is None:
            self.stats = new
        else:  # in place: a captured forward adds to the same counts at every replay
            self.stats.add_(new)


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
    hook = _RouteHook(layer=layer, config=router.config, tp_group=router.tp_group)
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
                x = _gather_tp(x, hook.tp_group)
            parts.append(x.transpose(0, 1).reshape(-1, x.shape[-1]))
        if not parts:
            raise RuntimeError(f"no forward recorded routes of MoE layer {hook.layer}")
        return torch.cat(parts).long()


def _gather_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
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


def replay_stats_checkpoint(model, device: torch.device) -> Callable[[], None]:
    """Give every router of ``model`` its mismatch counts on ``device`` (zeros where it has
    none, allocated before a CUDA graph capture so the graph adds to them) and return what puts
    them back as they are now (a captured forward's warm-up run must not count)."""
    hooks = route_hooks(model)
    for h in hooks:
        if h.stats is None:
            h.stats = torch.zeros(2, dtype=torch.float64, device=device)
    saved = [h.stats.clone() for h in hooks]

    def restore() -> None:
        for h, s in zip(hooks, saved, strict=True):
            h.stats.copy_(s)

    return restore


def replay_mismatch(model, reset: bool = True) -> Tensor:
    """float64 ``[mismatched, replayed]`` (token, layer) pairs of this rank's replayed forwards
    (recomputes not counted) since the last reset: "mismatched" = live top-k set differs from
    the replayed one. Sum over ranks before dividing (all-reduce)."""
    total = torch.zeros(2, dtype=torch.float64)
    for h in route_hooks(model):
        if h.stats is not None:
            total += h.stats.cpu()
            if reset:  # in place: a captured forward keeps adding to this tensor
                h.stats.zero_()
    return total


def check_routes(
    routes: Sequence[Tensor] | None,
    origin: Callable[[int], str],
    *,
    num_moe_layers: int,
    topk: int,
    num_experts: int,
) -> None:
    """ValueError naming the sample's ``origin(i)`` (file:line) when its routes ``[P + R, L, k]``
    do not fit the model (MoE layer count, top-k, expert ids in ``[0, num_experts)`` or -1 for
    a whole row)."""
    if routes is None:
        raise ValueError("the rollouts carry no routed_experts (needed by routing replay)")
    for i, r in enumerate(routes):
        if r.shape[1] != num_moe_layers:
            raise ValueError(
                f"{origin(i)}: routed_experts has {r.shape[1]} layers, the model has "
                f"{num_moe_layers} MoE layers"
            )
        if r.shape[2] != topk:
            raise ValueError(
                f"{origin(i)}: routed_experts has top-{r.shape[2]}, the model top-{topk}"
            )
        known = r[:, 0, 0] >= 0
        ids = r[known]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
            raise ValueError(
                f"{origin(i)}: routed_experts has expert ids outside [0, {num_experts}) "
                f"(range {int(ids.min())}..{int(ids.max())})"
            )
        if bool((r[~known] != -1).any()):
            raise ValueError(f"{origin(i)}: routed_experts rows must be all ids or all -1")


LogProbs = Callable[[list[torch.nn.Module], list[PackedBatch]], list[Tensor]]


class RoutingReplay:
    """Routing replay over a training run (``model.moe_enable_routing_replay``), as the trainer
    uses it: :meth:`check` the rollouts' routes, run the update's schedule in :meth:`scope`,
    call :meth:`after_logprob_pass` after the policy's no-grad pass, and read :meth:`metrics`
    once per step. ``on_policy``: no old-log-prob pass runs (its counts are the update's);
    ``log_without_replay``: one more live-routed pass for ``mismatch/k{1,3}_no_replay``."""

    enabled = True  # the micro-batches carry routes

    def __init__(
        self,
        model: list[torch.nn.Module],
        *,
        on_policy: bool,
        log_without_replay: bool,
        log_ratio_clamp: float | None,
        dp_group: dist.ProcessGroup | None,
    ) -> None:
        self.model, self.on_policy, self.log_without_replay = model, on_policy, log_without_replay
        self.clamp, self.dp_group = log_ratio_clamp, dp_group
        self._old: Tensor | None = None  # counts of the last old-log-prob pass, until metrics()
        self._no_replay: dict[str, float] = {}

    @staticmethod
    def of(enabled: bool, model: list[torch.nn.Module], **kwargs: Any) -> RoutingReplay:
        """A :class:`RoutingReplay`, or the no-op :class:`NoRoutingReplay` when not ``enabled``."""
        return RoutingReplay(model, **kwargs) if enabled else NoRoutingReplay()

    def check(self, routes: Sequence[Tensor] | None, origin: Callable[[int], str]) -> None:
        """The rollouts' per-sample routes fit the model (:func:`check_routes`)."""
        config = _gpt(self.model[0]).config
        check_routes(
            routes,
            origin,
            num_moe_layers=num_moe_layers(config),
            topk=config.moe_router_topk,
            num_experts=config.num_moe_experts,
        )

    def scope(self) -> AbstractContextManager[None]:
        """Around a whole training schedule: recomputes in backward replay each micro-batch's
        routes (``GRPOStep`` sets them per forward)."""
        return replay_routes(self.model)

    def after_logprob_pass(self, batches: list[PackedBatch], logprobs: LogProbs) -> None:
        """After the policy's old-log-prob pass (same weights as the rollouts): keep its counts,
        and with ``log_without_replay`` run ``logprobs(model, batches)`` routed live."""
        if not self.on_policy:
            self._old = replay_mismatch(self.model)
        if self.log_without_replay:
            self._no_replay = self._mismatch_without_replay(batches, logprobs)

    def metrics(self) -> dict[str, float]:
        """``moe/replay_mismatch_frac``: fraction of replayed (token, MoE layer) pairs whose live
        top-k differs from the replayed one in the old-log-prob pass (the policy the rollouts
        came from); ``moe/replay_mismatch_frac_update``: the same over this step's training
        forwards. All ranks (a sum over the world). On-policy (no old pass) the step's one
        update ran on the rollout policy's weights: its counts are both. Also
        ``mismatch/k{1,3}_no_replay`` with ``log_without_replay``."""
        update = replay_mismatch(self.model)
        old = update if self.on_policy else self._old
        self._old = None
        sums = all_reduce_sum([*update.tolist(), *(update if old is None else old).tolist()], None)
        out = {"moe/replay_mismatch_frac_update": sums[0] / max(sums[1], 1.0)}
        if old is not None:  # update() without the old-log-prob pass has no such count
            out["moe/replay_mismatch_frac"] = sums[2] / max(sums[3], 1.0)
        out.update(self._no_replay)
        self._no_replay = {}
        return out

    def _mismatch_without_replay(
        self, batches: list[PackedBatch], logprobs: LogProbs
    ) -> dict[str, float]:
        """``mismatch/k1_no_replay`` / ``k3_no_replay``: ``mismatch/k1`` / ``k3`` (mean over
        response tokens of ``x = old - rollout``, all DP ranks) had the old-log-prob pass routed
        live: one more no-grad forward of the policy over the same micro-batches."""
        live = [replace(mb, routes=None) for mb in batches]
        sums = [0.0, 0.0, 0.0]
        for mb, lp in zip(batches, logprobs(self.model, live), strict=True):
            if mb.rollout_logprobs is None:
                continue
            rows = mb.loss_mask & torch.isfinite(mb.rollout_logprobs)
            x = (lp[rows] - mb.rollout_logprobs[rows]).double()
            sums[0] += float(kl_estimate(x, "k1", None, None).sum())
            sums[1] += float(kl_estimate(x, "k3", self.clamp, None).sum())
            sums[2] += float(rows.sum())
        k1, k3, n = all_reduce_sum(sums, self.dp_group)
        if n == 0:  # rollouts without log-probs: no mismatch to report
            return {}
        return {"mismatch/k1_no_replay": k1 / n, "mismatch/k3_no_replay": k3 / n}


class NoRoutingReplay(RoutingReplay):
    """Routing replay off: every step of :class:`RoutingReplay` does nothing."""

    enabled = False

    def __init__(self) -> None:
        pass

    def check(self, routes: Sequence[Tensor] | None, origin: Callable[[int], str]) -> None:
        pass

    def scope(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def after_logprob_pass(self, batches: list[PackedBatch], logprobs: LogProbs) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}
