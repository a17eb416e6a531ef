"""Per-rank memory of a generation replica (``rollout.placement: separate``), without a model.

A generation rank holds its TP shard of the weights, the :class:`WeightReceiver`'s staging copy
of them (the double buffer of the in-flight update), two bucket buffers of the weight stream,
and the KV cache. The cache is sized at run time from the GPU's free memory
(``rollout.engine.kv_cache_gib`` / ``kv_cache_fraction``); the plan states what holding every
sample of one part at once would take (more only queues sequences for a free slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_grpo.megatron.config import ModelConfig, ParallelConfig
from megatron_grpo.megatron.plan.memory import GIB, _dtype, stage_params


@dataclass(frozen=True)
class GenerationPlan:
    """GiB-able byte counts of one generation rank.

    Attributes:
        tp / replicas: each replica's TP size and the number of replicas.
        params: parameters of one rank (dense + expert).
        samples: samples of the largest part a replica generates at once.
        tokens_per_sample: ``max_prompt_length + max_response_length``.
        bytes: ``weights``, ``staging`` (the receiver's copy), ``buckets`` (two stream
            buffers) and ``kv_all_samples`` (a cache holding every sample of a part).
    """

    tp: int
    replicas: int
    params: int
    samples: int
    tokens_per_sample: int
    bytes: dict[str, float]

    @property
    def fixed_bytes(self) -> float:
        """What the rank holds before its KV cache."""
        return self.bytes["weights"] + self.bytes["staging"] + self.bytes["buckets"]


def kv_bytes_per_token(cfg: ModelConfig, tp: int, dtype: torch.dtype) -> int:
    """Keys and values of one token in every layer, on one TP rank."""
    groups = (cfg.num_query_groups or cfg.num_attention_heads) // tp
    return 2 * cfg.num_layers * groups * cfg.head_dim * (torch.finfo(dtype).bits // 8)


def generation_plan(
    cfg: ModelConfig,
    tp: int,
    replicas: int,
    samples: int,
    tokens_per_sample: int,
    bucket_bytes: int,
    params_dtype: torch.dtype | str | None = None,
) -> GenerationPlan:
    """The plan of one rank of a TP-``tp`` replica (module docstring)."""
    dtype = _dtype(cfg, params_dtype)
    dense, expert = stage_params(cfg, ParallelConfig(tensor_model_parallel_size=tp), 0)
    weights = float((dense + expert) * (torch.finfo(dtype).bits // 8))
    kv = float(samples * tokens_per_sample * kv_bytes_per_token(cfg, tp, dtype))
    parts = {"weights": weights, "staging": weights, "buckets": 2.0 * bucket_bytes}
    parts["kv_all_samples"] = kv
    return GenerationPlan(tp, replicas, dense + expert, samples, tokens_per_sample, parts)


def replica_bytes(cfg: ModelConfig, params_dtype: torch.dtype | str | None = None) -> float:
    """The weights of a TP = EP = 1 copy of the model (``rollout.colocated.weights: replica``:
    one beside the trained shards on every rank)."""
    dense, expert = stage_params(cfg, ParallelConfig(), 0)
    return float((dense + expert) * (torch.finfo(_dtype(cfg, params_dtype)).bits // 8))


def format_generation_plan(plan: GenerationPlan) -> str:
    b = {k: v / GIB for k, v in plan.bytes.items()}
    return "\n".join(
        [
            f"generation ranks: {plan.replicas} replica(s) of TP {plan.tp}, "
            f"{plan.params / 1e6:.1f}M parameters per rank",
            f"  per rank (GiB): weights {b['weights']:.2f} + staging copy {b['staging']:.2f} + "
            f"stream buckets {b['buckets']:.2f} = {plan.fixed_bytes / GIB:.2f} before the KV "
            "cache",
            f"  KV cache for all {plan.samples} samples of a part at once "
            f"({plan.tokens_per_sample} tokens each): {b['kv_all_samples']:.2f} GiB (sized at "
            "run time from free memory: a smaller cache queues sequences for a slot)",
        ]
    )
