"""CUDA graphs of the update's forward and backward: two captured graphs per micro-batch shape.

The update's passes wait on the host as the log-prob passes do (:mod:`.logprob_graphs`), the
backward longer than the forward. Each micro-batch is padded to a graph shape
(:mod:`~megatron_grpo.megatron.batch.graph_shape`); its decoder forward replays one graph and,
when autograd reaches it, its backward another (:class:`_Replay`, as
``torch.cuda.make_graphed_callables`` pairs them). The backward graph computes the parameters'
gradients (``torch.autograd.grad`` of the captured forward) and adds them to megatron-core's DDP
gradient buffers (``main_grad``) itself, which is what DDP's hook does for an eager gradient: no
gradient copy of the parameters is held, none is handed to autograd. With
``overlap_grad_reduce`` the replay then marks those parameters ready in DDP's buckets (what the
hook does next), so each bucket's reduction starts as in an eager step, after the whole
backward graph rather than layer by layer. The LM head and the loss run eagerly on the static
hidden states (the padding documents carry no loss: ``loss_mask`` False); their gradients reach
DDP's hooks as usual. A tied embedding gets both: the graph adds its part, and its hook (which
autograd runs after the replay) adds the LM head's and marks it ready.

Graphs of every shape share one memory pool: a forward's saved activations are freed after its
backward's capture, so another shape's capture reuses them. That is safe only because each
replayed forward is followed by its own backward before the next forward (megatron-core's
schedule at one pipeline stage: forward, backward, micro-batch by micro-batch). A model whose
parameters, buffers or gradient buffers moved (``training.offload_during_rollout`` frees the
gradient buffers during rollout) is captured again. Scope as the log-prob graphs', a model
wrapped in megatron-core's DDP, and no activation recompute, dropout or MoE aux / z losses
(:func:`~megatron_grpo.megatron.step.graph_plan.update_graphs_unsupported`). With the distributed
optimizer's ``overlap_param_gather`` the parameters are gathered before the schedule's replays
(:func:`~megatron_grpo.megatron.step.graph_store.finish_param_gathers`), not module by module.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megatron_grpo.megatron.batch.graph_shape import GraphShape
from megatron_grpo.megatron.batch.packing import PackedBatch
from megatron_grpo.megatron.cuda_graphs import no_checkpoint
from megatron_grpo.megatron.gpt import output_weight, unwrap
from megatron_grpo.megatron.moe.ep_dispatch import no_host_sync
from megatron_grpo.megatron.moe.routing_replay import replay_stats_checkpoint, set_replay_routes
from megatron_grpo.megatron.step.graph_store import MAX_GRAPHS, GraphStore, StaticBatch


@dataclass
class _Backward:
    """What one shape's backward graph reads and who hears of its gradients."""

    grad_in: Tensor  # [T_local, H] the hidden states' gradient, in the pool
    shared: list[Tensor]  # trained by the graph and the eager LM head (tied): autograd edges
    ready: Callable[[], None]  # DDP's bookkeeping for the gradients only the graph adds


@dataclass
class _Run:
    """What a shape's captured forward hands its backward (at capture; a replay reruns the
    kernels, not this Python)."""

    leaves: list[Tensor] = field(default_factory=list)  # the shadow parameters
    hidden: Tensor | None = None  # [T_local, H], with the captured autograd graph
    grad_in: Tensor | None = None  # [T_local, H] the hidden states' gradient (static)
    trained: list[Tensor] = field(default_factory=list)  # parameters with a gradient


class _Replay(torch.autograd.Function):
    """The captured forward of ``key``; its backward replays the captured backward, which adds
    the parameters' gradients to their ``main_grad`` (none returned to autograd), then tells
    DDP. Inputs: ``anchor`` (a leaf, so that the loss's gradient reaches :meth:`backward`) and
    the ``shared`` parameters, whose DDP hooks must run after the replay."""

    @staticmethod
    def forward(ctx, graphs: UpdateGraphs, key: tuple, anchor: Tensor, *shared: Tensor) -> Tensor:
        graphs.cache.graphs[(*key, "forward")].replay()
        ctx.graphs, ctx.key, ctx.count = graphs, key, len(shared)
        return graphs.statics[key].hidden.detach()

    @staticmethod
    def backward(ctx, grad: Tensor):
        backward = ctx.graphs.backwards[ctx.key]
        backward.grad_in.copy_(grad)
        ctx.graphs.cache.graphs[(*ctx.key, "backward")].replay()
        backward.ready()
        return None, None, None, *([None] * ctx.count)


def ddp_grads_ready(chunk: torch.nn.Module, params: list[Tensor]) -> Callable[[], None]:
    """What megatron-core's DDP hook does after adding a gradient to ``main_grad``, for
    ``params`` (gradients added outside the hooks): with ``overlap_grad_reduce``, mark each ready
    in its bucket group (the bucket's reduction starts when all of its are; only on the last
    micro-batch, as the hook); without, nothing (``finish_grad_sync`` reduces every bucket)."""
    ddp_config = getattr(chunk, "ddp_config", None)
    if ddp_config is None or not ddp_config.overlap_grad_reduce:
        return lambda: None
    groups = chunk.param_to_bucket_group
    marked = [(groups[p], p) for p in reversed(params) if p in groups]  # the backward's order
    # megatron-core 0.16+ passes DDP's force_all_reduce; 0.14 / 0.15 take the parameter alone
    signature = inspect.signature(type(marked[0][0]).register_grad_ready) if marked else None
    extra = (
        (chunk.force_all_reduce,)
        if signature and "force_all_reduce" in signature.parameters
        else ()
    )

    def ready() -> None:
        for group, p in marked:
            group.register_grad_ready(p, *extra)

    return ready


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
        self.backwards: dict[tuple, _Backward] = {}
        self.anchor: Tensor | None = None  # a leaf the replays hang from

    def clear(self) -> None:
        super().clear()
        self.backwards.clear()
        self.anchor = None

    def _evict(self, key: tuple) -> None:
        self.statics.pop(key)
        self.backwards.pop(key, None)
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
        if key not in self.backwards:
            self._capture(chunk, key, static, params)
        if self.anchor is None:
            self.anchor = torch.zeros((), device=device, requires_grad=True)
        return _Replay.apply(self, key, self.anchor, *self.backwards[key].shared)

    def _capture(self, chunk, key: tuple, static: StaticBatch, params: list[Tensor]) -> None:
        cache = self.cache
        checkpoint = no_checkpoint
        if static.routes is not None:  # counts allocated before capture, warm-up undone
            restore = replay_stats_checkpoint(chunk, params[0].device)
            checkpoint = lambda: restore  # noqa: E731

        run = _Run()

        def forward() -> None:
            with shadow_params(chunk, params) as leaves:
                static.forward(chunk)
            run.leaves, run.hidden = leaves, static.hidden

        def backward() -> None:
            if run.grad_in is None:  # in the pool, as torch's graphed callables' grad inputs
                run.grad_in = torch.empty_like(run.hidden)
            grads = torch.autograd.grad(run.hidden, run.leaves, run.grad_in, allow_unused=True)
            run.trained = [p for p, g in zip(params, grads, strict=True) if g is not None]
            for p, g in zip(params, grads, strict=True):
                if g is not None:  # DDP's hook: main_grad += grad
                    p.main_grad.add_(g)

        def warm_up() -> None:
            forward()
            zeros = torch.zeros_like(run.hidden)
            torch.autograd.grad(run.hidden, run.leaves, zeros, allow_unused=True)

        with no_host_sync(chunk), torch.enable_grad():
            cache.warm_up(warm_up, checkpoint)
            cache.graphs[(*key, "forward")] = cache.capture(forward)
            cache.graphs[(*key, "backward")] = cache.capture(backward)
        # the captured autograd graph goes (its activations' memory is the pool's)
        static.hidden, run.hidden, run.leaves = run.hidden.detach(), None, []
        self.backwards[key] = self._handoff(chunk, run.grad_in, run.trained)

    @staticmethod
    def _handoff(chunk: torch.nn.Module, grad_in: Tensor, trained: list[Tensor]) -> _Backward:
        """Split the graph's ``trained`` parameters: those the LM head also trains eagerly (a
        tied embedding; their hooks run after the replay, as autograd edges of it) and those
        only the graph trains (DDP hears of them from the replay)."""
        gpt = unwrap(chunk)
        eager = {id(p) for p in gpt.output_layer.parameters()} | {id(output_weight(gpt))}
        shared = [p for p in trained if id(p) in eager]
        alone = [p for p in trained if id(p) not in eager]
        return _Backward(grad_in, shared, ddp_grads_ready(chunk, alone))
