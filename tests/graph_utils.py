"""CPU stand-ins for CUDA graphs: the graph stores' own capture, replay and bookkeeping run in CI
with each "graph" rerunning the Python it captured (a GPU's graph replays the kernels that
Python launched), as captured: the same grad mode, MoE layers on the dispatch without host
syncs, and none of DDP's forward pre-hooks (with ``overlap_param_gather`` they gather the
parameters module by module: a replay never runs them, a capture records no gather).
``rerun_graphs()`` also keeps the static bounds readable on the host: the captured forwards'
'varlen' attention runs on CUDA only, and a rerun reads the bounds each time."""

from __future__ import annotations

import contextlib

import torch

from megatron_grpo.megatron.batch.packing import PackedBatch, pack_sequences
from megatron_grpo.megatron.moe.ep_dispatch import no_host_sync
from megatron_grpo.megatron.step import graph_store

# layout -> (ParallelConfig settings, model settings) of the rerun tests, each on 2 gloo ranks
MOE = dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64, moe_grouped_gemm=True)
LAYOUTS = {
    "dp2": ({}, {}),
    "dp2_overlap": (dict(overlap_grad_reduce=True), {}),
    "dp2_tied_overlap": (
        dict(overlap_grad_reduce=True),
        dict(share_embeddings_and_output_weights=True),
    ),
    "tp2_sp": (dict(tensor_model_parallel_size=2, sequence_parallel=True), {}),
    "ep2": (dict(expert_model_parallel_size=2), dict(MOE, moe_token_dispatcher_type="alltoall")),
}


@contextlib.contextmanager
def without_param_hooks(chunk):
    """megatron-core DDP's forward pre-hooks (``overlap_param_gather``) off meanwhile."""
    hooked = getattr(chunk, "use_forward_hook", False)
    if hooked:
        chunk.disable_forward_pre_hook(param_sync=False)
    try:
        yield
    finally:
        if hooked:
            chunk.enable_forward_pre_hook()


class Rerun:
    """A "graph": :meth:`replay` runs its captured step again, as captured."""

    def __init__(self, step, chunk, grad: bool) -> None:
        self.step, self.chunk, self.grad = step, chunk, grad

    def replay(self) -> None:
        # an autograd Function's forward runs under no_grad; the capture may not have
        grad = torch.set_grad_enabled(self.grad)
        with grad, no_host_sync(self.chunk), without_param_hooks(self.chunk):
            self.step()


class RerunCache:
    """:class:`~megatron_grpo.megatron.cuda_graphs.GraphCache`'s interface: a capture runs its
    step once (its writes to the model's ``main_grad`` undone: a capture runs nothing) and
    keeps it for the replays."""

    def __init__(self, chunk: torch.nn.Module) -> None:
        self.graphs, self.captures, self.chunk = {}, 0, chunk
        self.grads = [p.main_grad for p in chunk.parameters() if hasattr(p, "main_grad")]

    def warm_up(self, step, checkpoint) -> None:
        restore = checkpoint()
        step()
        restore()

    def capture(self, step) -> Rerun:
        before = [g.clone() for g in self.grads]
        with without_param_hooks(self.chunk):
            step()
        for g, b in zip(self.grads, before, strict=True):
            g.copy_(b)
        self.captures += 1
        return Rerun(step, self.chunk, torch.is_grad_enabled())

    def run(self, key, step, checkpoint) -> None:
        if key not in self.graphs:
            self.warm_up(step, checkpoint)
            self.graphs[key] = self.capture(step)
        self.graphs[key].replay()

    def drop(self, key) -> None:
        self.graphs.pop(key, None)


def rerun_graphs() -> None:
    """In a spawned test process: static bounds stay on the host (see the module docstring)."""
    graph_store.mark_static = lambda params, max_len: None


def rerun_model(layout: str):
    """(model config, chunks) of one of ``LAYOUTS`` in a spawned rerun test, the process set
    up (:func:`rerun_graphs`; at EP 2 the eager passes' all-to-all on the CPU, the graphs
    taking the gathered dispatch)."""
    from megatron_grpo.megatron import ParallelConfig
    from tests.ep_utils import cpu_alltoall
    from tests.megatron_utils import build_layout, tiny_model

    rerun_graphs()
    cpu_alltoall()
    parallel, model = LAYOUTS[layout]
    cfg = tiny_model(**model)
    return cfg, build_layout(ParallelConfig(**parallel), cfg)


def count_dispatches() -> list[str]:
    """Record the dispatch each MoE layer's forward takes ("gathered" / "megatron")."""
    from megatron_grpo.megatron.moe import ep_dispatch

    chosen: list[str] = []
    choose = ep_dispatch.choose_dispatch
    ep_dispatch.choose_dispatch = lambda *a: chosen.append(choose(*a)) or chosen[-1]
    return chosen


def mixed_batches(n: int, max_len: int, seed: int, multiple: int = 1) -> list[PackedBatch]:
    """``n`` packed micro-batches of 1-8 documents of 4..``max_len`` tokens each: mixed
    lengths, whose own graph-shape buckets are many."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        docs = int(torch.randint(1, 9, (1,), generator=g))
        lens = torch.randint(4, max_len, (docs,), generator=g).tolist()
        seqs = [torch.randint(0, 50, (k,), generator=g) for k in lens]
        masks = [torch.arange(k) >= 1 for k in lens]
        out.append(pack_sequences(seqs, masks, pad_to_multiple_of=multiple))
    return out
