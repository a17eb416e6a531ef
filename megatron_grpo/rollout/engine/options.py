"""The ``rollout.engine`` recipe section: which engine generates and the KV-cached engine's knobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_grpo.ops.kernels import check_choice


@dataclass(frozen=True)
class EngineOptions:
    """Knobs of the KV-cached engine (a recipe's ``rollout.engine`` section).

    Attributes:
        kind: which engine a recipe's rollouts use: ``kv_cache`` (:class:`KVCacheEngine` with
            these options) or ``recompute`` (no cache: every token re-runs the whole sequence,
            ``generate(..., engine="recompute")``, the reference the engine is tested against;
            the other options are then unused). :class:`KVCacheEngine` itself is ``kv_cache``.
        kv_cache_gib: the KV cache budget per GPU in GiB; sequences beyond it wait for a free
            slot. None (default): sized from the GPU's memory at each call (``kv_cache_fraction``);
            on CPU ``kv_cache.CPU_KV_CACHE_GIB`` (16).
        kv_cache_fraction: with ``kv_cache_gib`` None on GPU, the cache may grow until this
            fraction of the GPU's total memory is in use (vLLM's ``gpu_memory_utilization``):
            ``slots = (fraction * total - in_use - headroom) // (bytes per sequence + per-slot
            headroom)``, ``in_use`` being all but the driver's free memory and PyTorch's unused
            cached blocks, the headroom the call's other working memory estimated from the
            shapes (``kv_cache.Headroom``). The rest (``(1 - fraction) * total``) is left for
            fragmentation, NCCL and other buffers allocated later. TP / EP ranks take their
            group's minimum.
        cuda_graphs: replay decode steps as CUDA graphs; None = on for dense models on GPU
            (MoE routing has data-dependent shapes, so MoE always runs eagerly).
        max_prefill_tokens: tokens per prefill forward (bounds its activation memory).
        context_bucket: decode attends to keys in multiples of this many positions.
        keep_cache: keep the KV cache allocated between calls (CUDA graphs are then always
            reused; for generation-only use). Off: the cache is freed when a call returns, so
            the policy update never holds it, and graphs are re-captured only when the next
            call's cache lands at another address.
        decode_path: "fused" (``fused_decode``), "modules" (megatron-core's layers), or "auto":
            fused wherever it covers the model.
        decode_impl: the fused path's element-wise kernels: "triton", "torch" or "auto"
            (Triton on GPU).
        decode_attention: "triton" (``kernels.decode_attention``: split-K over exactly each
            row's keys), "sdpa" (masked SDPA over the context bucket) or "auto" (as the impl).
        tp_sampling: how a TP > 1 engine draws the next token (``engine.tp_sampling``):
            "vocab_parallel" (each rank samples from its vocabulary shard, two small
            collectives; untruncated or greedy sampling only), "gathered" (all-gather the fp32
            logits, sample, broadcast) or "auto" (vocab-parallel where the sampling allows).
        tp_all_reduce: the fused decode step's TP all-reduces (``engine.tp_all_reduce``):
            "nccl", "one_shot" / "two_shot" (symmetric memory: one kernel reads every TP
            rank's partial sum over NVLink, up to ``tp_all_reduce.SYMM_MAX_BYTES``, NCCL above;
            CUDA, one host) or "auto" (the size tiers measured ahead of NCCL, else NCCL).
        decode_overlap: the fused TP decode step in two halves of its rows, each half's TP
            all-reduces overlapping the other half's GEMMs and attention on a second stream
            (``engine.decode_overlap``): "halves" (every step of 2 rows or more; the fused
            path, TP > 1, dense layers), "off", or "auto" (the TP sizes and row counts
            measured ahead of one batch, ``decode_overlap.MEASURED_AHEAD``, else off).
        kv_cache_memory: where the KV cache lives (``fixed_address.plan_kv_cache_memory``):
            "fixed_address" (an address range reserved once, backed by memory only during a
            call: the memory is returned between calls, as with the allocator, but the
            address never moves, so decode graphs are captured once), "allocator" (PyTorch's
            caching allocator: a call's cache may land elsewhere and its graphs be captured
            again) or "auto" (fixed wherever decode graphs are on and the driver can).
        ep_decode_steps: at EP > 1 (MoE), decode steps the expert group runs between two
            agreements (one host round trip each), with the next step launched before the
            last one's tokens reach the host; a row that stops meanwhile stays in the batch,
            its tokens dropped, until the group next agrees (fewer when a row reaches its
            length limit sooner; 1 with routing replay, which records step by step, and
            while waiting samples fit in free slots).
    """

    kind: Literal["kv_cache", "recompute"] = "kv_cache"
    kv_cache_gib: float | None = None
    kv_cache_fraction: float = 0.9
    cuda_graphs: bool | None = None
    max_prefill_tokens: int = 32768
    context_bucket: int = 128
    keep_cache: bool = False
    decode_path: Literal["auto", "fused", "modules"] = "auto"
    decode_impl: Literal["auto", "triton", "torch"] = "auto"
    decode_attention: Literal["auto", "triton", "sdpa"] = "auto"
    tp_sampling: Literal["auto", "gathered", "vocab_parallel"] = "auto"
    tp_all_reduce: Literal["auto", "nccl", "one_shot", "two_shot"] = "auto"
    decode_overlap: Literal["auto", "off", "halves"] = "auto"
    kv_cache_memory: Literal["auto", "fixed_address", "allocator"] = "auto"
    ep_decode_steps: int = 16

    def __post_init__(self) -> None:
        if self.kind not in ("kv_cache", "recompute"):
            raise ValueError(f"kind must be kv_cache or recompute, got {self.kind!r}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0 (or null: auto), got {self.kv_cache_gib}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        check_choice("tp_sampling", self.tp_sampling, "rollout.engine.tp_sampling")
        check_choice("tp_all_reduce", self.tp_all_reduce, "rollout.engine.tp_all_reduce")
        check_choice("decode_overlap", self.decode_overlap, "rollout.engine.decode_overlap")
        check_choice("kv_cache_memory", self.kv_cache_memory, "rollout.engine.kv_cache_memory")
        for name in ("max_prefill_tokens", "context_bucket", "ep_decode_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
