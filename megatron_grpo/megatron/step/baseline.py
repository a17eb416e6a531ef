"""Megatron's standard log-prob path, the baseline of our comparisons: the GPTModel's
``output_layer`` materializes vocab-parallel logits, then
``tensor_parallel.vocab_parallel_cross_entropy`` gives ``logp = -CE``."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from torch import Tensor

from megatron_grpo.ops.lm_head.head import check_targets


def megatron_logprobs(
    output_layer: torch.nn.Module,
    weight: Tensor,
    hidden: Tensor,
    targets: Tensor,
    *,
    vocab_size: int,
    tp_rank: int,
    temperature: float = 1.0,
) -> Tensor:
    """Megatron's standard log-prob path: ``[T_local, H]`` hidden -> float32 ``[T]`` log-probs.

    ``output_layer`` (the GPTModel's ``ColumnParallelLinear``; all-gathers the hidden states
    under sequence parallelism) materializes ``[T, 1, V_local]`` logits; they are divided by
    ``temperature`` and padded vocab columns (ids ``>= vocab_size``; ``tp_rank``: this rank's
    shard) set to ``-inf`` in place, then ``tensor_parallel.vocab_parallel_cross_entropy``
    gives ``logp = -CE``. Every position is scored (prompt tokens too), as in Megatron;
    ``targets`` ``[T]`` must be real ids.
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
    n_valid = vocab_size - tp_rank * v_local
    if n_valid < v_local:
        logits[..., max(n_valid, 0) :] = float("-inf")
    ce = tensor_parallel.vocab_parallel_cross_entropy(logits, targets.unsqueeze(1))
    return -ce.view(-1).float()
