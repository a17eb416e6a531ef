"""Where the optimizer's device memory lives: its tensors, and a first step that gives the
lazily created state segments of its own.

megatron-core's optimizers (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
``DistributedOptimizer``, ``ChainedOptimizer`` of them) wrap a torch optimizer (Adam / SGD; TE's
or apex's FusedAdam when they import) whose state (Adam's ``exp_avg`` / ``exp_avg_sq``) is
created at its first ``step()``. The caching allocator would carve that state out of the free
blocks the backward pass just left, so tensors that live for the whole run would pin the
activation segments around them, and the generation engine, which needs its KV cache in one
piece, would find those segments in use at every later step. Releasing the unused segments
once, right before the step that creates the state, places the state in segments of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron-core optimizer (each of a ``ChainedOptimizer``)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    members = chained if chained is not None else [optimizer]
    out = []
    for member in members:
        inner = getattr(member, "optimizer", None)
        if inner is not None:  # stub optimizers (no parameters on this rank) hold none
            out.append(inner)
    return out


def state_tensors(optimizer) -> Iterator[torch.Tensor]:
    """Every tensor of the torch optimizers' per-parameter state (Adam: ``exp_avg``,
    ``exp_avg_sq``, ``step``)."""
    for inner in torch_optimizers(optimizer):
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value


def main_params(optimizer) -> Iterator[torch.Tensor]:
    """The parameters the torch optimizers update: megatron's fp32 main copies (or the model's
    own fp32 parameters under ``FP32Optimizer``)."""
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            yield from group["params"]


def has_state(optimizer) -> bool:
    return any(len(inner.state) for inner in torch_optimizers(optimizer))


def release_before_first_step(optimizer) -> bool:
    """Before the step that creates the optimizer state on a GPU: return the allocator's unused
    segments to the driver, so the state lands in fresh segments (see the module docstring).
    Returns whether it released (once per run: afterwards the state exists)."""
    if has_state(optimizer):
        return False
    if not any(p.is_cuda for p in main_params(optimizer)):
        return False
    torch.cuda.empty_cache()
    return True
