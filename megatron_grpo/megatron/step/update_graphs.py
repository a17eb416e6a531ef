"""CUDA graphs of the update's forward and backward: two captured graphs per micro-batch shape.

The update's passes wait on the host as the log-prob passes do (:mod:`.logprob_graphs`), the
backward longer than the forward. Each micro-batch is padded to a graph shape
(:mod:`~megatron_grpo.megatron.batch.graph_shape`); its decoder forward replays one graph and,
when autograd reaches it, its backward another (:class:`_Replay`, as
``torch.cuda.make_graphed_callables`` pairs them). The backward graph computes the parameters'
gradients (``torch.autograd.grad`` of the captured forward) and adds them to megatron-core's DDP
gradient buffers (``main_grad``) itself, which is what DDP's hook does for an eager gradient
when it does not overlap the reduction: no gradient copy of the parameters is held, none is
handed to autograd. The LM head and the loss run eagerly on the static hidden states (the
padding documents carry no loss: ``loss_mask`` False); their gradients reach DDP's hooks as
usual.

Graphs of every shape share one memory pool: a forward's saved activations are freed after its
backward's capture, so another shape's capture reuses them. That is safe only because each
replayed forward is followed by its own backward before the next forward (megatron-core's
schedule at one pipeline stage: forward, backward, micro-batch by micro-batch). A model whose
parameters, buffers or gradient buffers moved (``training.offload_during_rollout`` frees the
gradient buffers during rollout) is captured again. Scope as the log-prob graphs', a model
wrapped in megatron-core's DDP without ``overlap_grad_reduce``, and no activation recompute,
dropout, MoE aux / z losses or overlapped parameter gathers
(:func:`~megatron_grpo.megatron.step.graph_plan.update_graphs_unsupported`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from megatron_grpo.megatron.batch.graph_shape import GraphShape
from megatron_grpo.megatron.batch.packing import PackedBatch
from megatron_grpo.megatron.cuda_graphs import no_checkpoint
from megatron_grpo.megatron.gpt import unwrap
from megatron_grpo.megatron.moe.ep_dispatch import no_host_sync
from megatron_grpo.megatron.moe.routing_replay import replay_stats_checkpoint, set_replay_routes
from megatron_grpo.megatron.step.graph_store import MAX_GRAPHS, GraphStore, StaticBatch


class _Replay(torch.autograd.Function):
    """The captured forward of ``key`` on ``params`` (autograd's edges to them, so that the
    loss's gradient reaches :meth:`backward`); its backward replays the captured backward, which
    adds the parameters' gradients to their ``main_grad`` (none returned to autograd)."""

    @staticmethod
    def forward(ctx, graphs: UpdateGraphs, key: tuple, *params: Tensor) -> Tensor:
        graphs.cache.graphs[(*key, "forward")].replay()
        ctx.graphs, ctx.key, ctx.count = graphs, key, len(params)
        return graphs.statics[key].hidden.detach()

    @staticmethod
    def backward(ctx, grad: Tensor):
        graphs, key = ctx.graphs, ctx.key
        graphs.grad_in[key].copy_(grad)
        graphs.cache.graphs[(*key, "backward")].replay()
        return None, None, *([None] * ctx.count)


def trained_params(chunk: torch.nn.Module) -> list[Tensor]:
    """The parameters of ``chunk``'s model that take gradients, in a fixed order."""
    return [p for p in unwrap(chunk).parameters() if p.requires_grad]


@contextlib.contextmanager
def shadow_params(chunk: torch.nn.Module, params: list[Tensor]) -> Iterator[list[Tensor]]:
    """While active, ``chunk``'s modules hold new leaf parameters in place of ``params``: the
    same storage (a graph captured with them reads the parameters), autograd nodes of their own.
    A parameter's gradient accumulator belongs to the stream current at its creation, and
    megatron-core's DDP creates and keeps them on the default stream, which a capture may not
    make wait ("operation would make the legacy stream depend on a capturing blocking
    stream"); the shadows' are created inside the capture. Yields them in ``params``' order."""
    shadows = {}
    for p in params:
        leaf = torch.nn.Parameter(p.detach(), requires_grad=True)
        # megatron-core's attributes (TP, SP, expert flags), not the tensor's own (hooks)
        leaf.__dict__.update({k: v for k, v in p.__dict__.items() if not k.startswith("_")})
        shadows[id(p)] = leaf
    slots = [
        (module, name, p)
        for module in unwrap(chunk).modules()
        for name, p in module._parameters.items()
        if p is not None and id(p) in shadows
    ]
    for module, name, p in slots:
        module._parameters[name] = shadows[id(p)]
    try:
        yield [shadows[id(p)] for p in params]
    finally:
        for module, name, p in slots:
            module._parameters[name] = p


class UpdateGraphs(GraphStore):
    """The captured forwards and backwards of the update's micro-batch shapes, kept across
    steps (the optimizer updates the weights in place), per model (:class:`GraphStore`)."""

    def __init__(self, limit: int = MAX_GRAPHS) -> None:
        super().__init__(limit)
        self.grad_in: dict[tuple, Tensor] = {}  # the hidden states' gradient [T_local, H]

    def clear(self) -> None:
        super().clear()
        self.grad_in.clear()

    def _evict(self, key: tuple) -> None:
        self.statics.pop(key)
        self.grad_in.pop(key, None)
        for part in ("forward", "backward"):
            self.cache.drop((*key, part))

    def addresses_of(self, chunk: torch.nn.Module) -> tuple[int, ...]:
        """Where the graphs read and write: the parameters, buffers and gradient buffers."""
        grads = (p.main_grad.data_ptr() for p in trained_params(chunk))
        return (*super().addresses_of(chunk), *grads)

    def forward(
        self, chunk: torch.nn.Module, padded: PackedBatch, shape: GraphShape, routes
    ) -> Tensor:
        """The hidden states ``[T_local, H]`` of ``padded`` (a micro-batch padded to ``shape``)
        under ``chunk``, from the graph of its shape (captured first if new), connected to
        the parameters by autograd. Routing replay: inside an active ``replay_routes`` block."""
        params = trained_params(chunk)
        device = params[0].device
        key, static = self.static(chunk, shape, routes, device)
        static.load(padded)
        if static.routes is not None:
            set_replay_routes(chunk, static.routes)
        if key not in self.grad_in:
            self._capture(chunk, key, static, params)
        return _Replay.apply(self, key, *params)

    def _capture(self, chunk, key: tuple, static: StaticBatch, params: list[Tensor]) -> None:
        cache = self.cache
        checkpoint = no_checkpoint
        if static.routes is not None:  # counts allocated before capture, warm-up undone
            restore = replay_stats_checkpoint(chunk, params[0].device)
            checkpoint = lambda: restore  # noqa: E731

        def warm_up() -> None:
            with shadow_params(chunk, params) as leaves:
                static.forward(chunk)
            zeros = torch.zeros_like(static.hidden)
            torch.autograd.grad(static.hidden, leaves, zeros, allow_unused=True)

        with no_host_sync(chunk), torch.enable_grad():
            cache.warm_up(warm_up, checkpoint)
            with shadow_params(chunk, params) as leaves:
                cache.graphs[(*key, "forward")] = cache.capture(lambda: static.forward(chunk))
            hidden = static.hidden
            grad_in: list[Tensor] = []

            def backward() -> None:
                # the hidden states' gradient lives in the pool, as torch's graphed callables'
                grad_in.append(torch.empty_like(hidden))
                grads = torch.autograd.grad(hidden, leaves, grad_in[0], allow_unused=True)
                for p, g in zip(params, grads, strict=True):
                    if g is not None:  # DDP's hook without overlap: main_grad += grad
                        p.main_grad.add_(g)

            cache.graphs[(*key, "backward")] = cache.capture(backward)
        # the captured autograd graph goes (its activations' memory is the pool's)
        static.hidden = hidden.detach()
        self.grad_in[key] = grad_in[0]
