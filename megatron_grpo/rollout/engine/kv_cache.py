"""The KV cache of the generation engine, its sizing and the attention that reads and writes it.

One buffer ``kv [L, 2, slots + 1, n_kv, S, d]`` holds the keys (RoPE applied) and values of this
rank's L layers for ``slots`` sequences of up to S tokens; the extra last slot is scratch that
padding tokens write into. Rows are independent sequences at their own positions (no shared
offset, no left padding): a decode query attends to its own row's keys ``[0, pos]`` through a
key-padding mask, so ragged prompts decode exactly as if each ran alone. :class:`CacheSizer`
decides how many slots a call's cache holds (the budget, the memory it may take, the agreement
of the TP / expert groups).
The attention over it is ``cached_attention.py``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.moe.ep_dispatch import gathered_decode_width
from megatron_grpo.megatron.parallel import all_reduce_max
from megatron_grpo.ops.layers.rope import rope_reference
from megatron_grpo.rollout.engine import memory_release
from megatron_grpo.rollout.engine import model_io as io
from megatron_grpo.rollout.engine.fixed_address import FixedAddressMemory, plan_kv_cache_memory
from megatron_grpo.rollout.engine.options import EngineOptions


@dataclass(frozen=True)
class CacheShape:
    """Per-token KV size of this rank's model: ``layers * 2 * kv_heads * head_dim`` elements."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: torch.nn.Module) -> CacheShape:
        cfg = model.config
        tp = cfg.tensor_model_parallel_size
        groups = cfg.num_query_groups or cfg.num_attention_heads
        if groups % tp:
            raise ValueError(f"num_query_groups={groups} is not divisible by TP={tp}")
        dtype = next(model.parameters()).dtype
        return cls(len(model.decoder.layers), groups // tp, cfg.kv_channels, dtype)

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.finfo(self.dtype).bits // 8
        return self.layers * 2 * self.kv_heads * self.head_dim * itemsize


def slots_for_budget(shape: CacheShape, budget_gib: float, seq_len: int) -> int:
    """How many sequences of ``seq_len`` tokens fit in ``budget_gib``; an error if none does."""
    per_seq = shape.bytes_per_token * seq_len
    slots = int(budget_gib * 2**30) // per_seq
    if slots < 1:
        raise ValueError(
            f"rollout.engine.kv_cache_gib={budget_gib} is too small for one sequence: {seq_len} "
            f"tokens x {shape.bytes_per_token} bytes per token = {per_seq / 2**30:.4f} GiB"
        )
    return slots


# ---------------------------------------------------------------------------- automatic sizing
# With ``kv_cache_gib`` unset the cache is sized from the device's memory at each call, as
# serving engines do (vLLM's ``gpu_memory_utilization``, SGLang's ``mem_fraction_static``): the
# cache may grow until the GPU is ``kv_cache_fraction`` full, after what is in use and the
# call's other working memory (:class:`Headroom`, estimated from the shapes).

CPU_KV_CACHE_GIB = 16.0  # the budget when there is no device memory to size from (CPU)


@dataclass(frozen=True)
class Headroom:
    """Device bytes a generation call needs besides its cache slots: ``fixed`` plus
    ``per_slot`` for each slot. Rough upper estimates from the shapes (:meth:`of`)."""

    fixed: int
    per_slot: int

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        shape: CacheShape,
        seq_len: int,
        prefill_tokens: int,
        graphs: bool,
    ) -> Headroom:
        """``fixed``: the scratch slot, the RoPE table, and one prefill forward of
        ``prefill_tokens`` (:func:`activation_width` elements a token). ``per_slot`` (a decode
        step over every slot, or the first tokens of as many prefilled prompts): fp32 logits
        (the local ``[V / TP]`` head output, the ``[V]`` gathered over TP and ~5 sampling
        temporaries of ``[V]``), the step's activations (MoE at EP > 1: the gathered
        dispatch's, ``ep_dispatch.gathered_decode_width``) and static buffers; twice with CUDA
        graphs (the graphs' memory pool and the eager warm-up before each capture)."""
        cfg = model.config
        itemsize = torch.finfo(shape.dtype).bits // 8
        tp = cfg.tensor_model_parallel_size
        width = activation_width(cfg, tp)
        vocab_local = _output_rows(model)
        rope = seq_len * (cfg.kv_channels or 0) * 16  # cos and sin, and their fp32 sources
        fixed = shape.bytes_per_token * seq_len + rope + prefill_tokens * width * itemsize
        # MoE at EP > 1: a decode row's gathered-dispatch buffers (moe.ep_dispatch)
        step_width = max(width, gathered_decode_width(cfg))
        step = 4 * (vocab_local + 6 * vocab_local * tp) + step_width * itemsize
        return cls(int(fixed), int(step * (2 if graphs else 1) + 64))


def activation_width(cfg, tp: int) -> int:
    """Elements a token of one layer keeps live in a no-grad forward on this rank (rough): the
    residual stream and the norm, attention and MLP outputs (4 H), QKV with its RoPE'd and
    padded copies (3x), the MLP's fc1 output and activation (2x; MoE: the top-k experts' rows
    of each token under balanced routing, its permuted copies and the tokens gathered over EP)."""
    hidden = cfg.hidden_size
    heads = cfg.num_attention_heads
    qkv = (heads + 2 * (cfg.num_query_groups or heads)) * (cfg.kv_channels or 0) // tp
    gate = 2 if cfg.gated_linear_unit else 1
    extra = 0
    if cfg.num_moe_experts:
        topk = cfg.moe_router_topk
        etp = cfg.expert_tensor_parallel_size or tp
        ffn = topk * (cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size) // etp
        ffn += (cfg.moe_shared_expert_intermediate_size or 0) // tp
        extra = (2 * topk + cfg.expert_model_parallel_size) * hidden
    else:
        ffn = cfg.ffn_hidden_size // tp
    return 4 * hidden + 3 * qkv + 2 * gate * ffn + extra


def _output_rows(model: torch.nn.Module) -> int:
    """Rows of this rank's output layer (``V_padded / TP``)."""
    from megatron_grpo.megatron.gpt import output_weight

    return output_weight(model).size(0)


def device_memory(device: torch.device, cached: bool = True) -> tuple[int, int] | None:
    """``(free, total)`` bytes of ``device``, or None off CUDA. ``free``: what a new tensor can
    take: the driver's free memory plus, with ``cached``, what PyTorch's caching allocator holds
    unused (reserved - allocated; a large tensor needs it in one piece) outside CUDA-graph pools
    (:func:`~memory_release.graph_pool_unused`: no tensor of ours can take those)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    if cached:
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        free += unused - memory_release.graph_pool_unused(device)
    return free, total


def memory_budget(free: int, total: int, fraction: float, fixed: int) -> float:
    """Bytes the cache's slots may take: ``fraction * total - in_use - fixed`` with ``in_use =
    total - free`` (this process's tensors, the CUDA context, other processes) and ``fixed`` the
    call's :class:`Headroom` beside its slots (the trainer's offload check asks the same)."""
    return fraction * total - (total - free) - fixed


def memory_slots(free: int, total: int, per_seq: int, fraction: float, headroom: Headroom) -> int:
    """Sequences of ``per_seq`` bytes the cache may hold (0 if none): the
    :func:`memory_budget` over ``per_seq + headroom.per_slot`` each."""
    budget = memory_budget(free, total, fraction, headroom.fixed)
    return max(0, int(budget // (per_seq + headroom.per_slot)))


def require_slots(
    slots: int, free: int, total: int, per_seq: int, fraction: float, headroom: Headroom
) -> int:
    """``slots`` if >= 1, else an error naming the settings and this rank's numbers."""
    if slots >= 1:
        return slots
    gib = 2**30
    raise ValueError(
        f"rollout.engine.kv_cache_fraction={fraction} leaves no room for one sequence on this GPU "
        f"or another of its TP/EP group: {fraction} x {total / gib:.2f} GiB - "
        f"{(total - free) / gib:.2f} GiB in use - {headroom.fixed / gib:.2f} GiB headroom < "
        f"{(per_seq + headroom.per_slot) / gib:.4f} GiB per sequence; raise "
        "rollout.engine.kv_cache_fraction, shorten the sequences or set "
        "rollout.engine.kv_cache_gib"
    )


class CacheSizer:
    """How many sequences the engine's cache holds at a call, decided here and nowhere else.

    The budget is ``rollout.engine.kv_cache_gib`` when set (on CPU without it:
    :data:`CPU_KV_CACHE_GIB`), else sized from the GPU's memory at each call
    (``kv_cache_fraction`` of the total, less what is in use and the call's :class:`Headroom`);
    the ranks of the TP group and of the expert group agree on the smallest count, and the
    expert group's ranks then hold equal slot counts (it pads decode batches to its largest).
    A cache that some rank cannot place in one piece is sized again from the driver's free
    memory alone. One log line (global rank 0) at the first call and whenever the cache holds
    fewer sequences than ever before."""

    def __init__(
        self,
        model: torch.nn.Module,
        options: EngineOptions,
        layout: ParallelLayout,
        max_context: int | None,
        graphs: bool,
    ) -> None:
        """``max_context``: the longest prompt + response any call brings (None: each call's
        own); ``graphs``: decode steps replay CUDA graphs (their pool counts in the headroom,
        and only they read the cache's address: ``options.kv_cache_memory``)."""
        self.model, self.options, self.layout = model, options, layout
        self.max_context, self.graphs = max_context, graphs
        self.fixed: FixedAddressMemory | None = None
        self._retired: list[FixedAddressMemory] = []  # still viewed when their call ended
        device = io.model_device(model)
        fixed, self._memory_off = plan_kv_cache_memory(options.kv_cache_memory, device, graphs)
        if fixed:  # the range spans the GPU: no cache can outgrow it
            total = torch.cuda.get_device_properties(device).total_memory
            self.fixed = FixedAddressMemory(device, total)
        self._reported_slots: int | None = None  # the fewest slots logged so far

    def allocate(
        self, prompts: list[list[int]], max_new_tokens: int, kept: KVCache | None
    ) -> KVCache:
        """The cache of a call over ``prompts``: ``kept`` (the engine's previous one, with
        ``keep_cache``) when it is as long and holds enough slots, else a new one (``kept``
        freed first)."""
        shape = CacheShape.of(self.model)
        if self.options.kv_cache_gib is None and kept is None:
            # sized from free memory: unused segments back first (with a kept cache nothing
            # else ran since: no release, a device synchronization, on a generation-only GPU)
            memory_release.release(io.model_device(self.model))
        longest = max(len(p) for p in prompts) + max_new_tokens
        longest = max(longest, self.max_context or 0)
        bucket = self.options.context_bucket
        seq_len = min(-(-longest // bucket) * bucket, self.model.max_sequence_length)
        if self.graphs and self.layout.expert_tp_ep_group is not None:
            # decode graphs hold collectives: the group captures and replays the same keys
            seq_len = all_reduce_max([seq_len], self.layout.expert_tp_ep_group, torch.int64)[0]
        cache = None
        for cached in (True, False):  # False: again, from the driver's free memory alone
            budget, sizing = self._budget_slots(prompts, shape, seq_len, kept, cached)
            slots = min(len(prompts), budget)
            group = self.layout.expert_tp_ep_group
            if group is not None:  # equal slot counts: the group pads decode batches to its largest
                slots = all_reduce_max([slots], group, torch.int64)[0]
            if (
                kept is not None
                and (kept.shape, kept.seq_len) == (shape, seq_len)
                and kept.slots >= slots
            ):
                cache = kept
                break
            if kept is not None:  # freed before the new one is allocated
                kept.release()
                kept = None
            cache = self._new_cache(shape, slots, seq_len, last=not cached)
            if cache is not None:
                break
            torch.cuda.empty_cache()  # whole free segments back to the driver
        self._report(cache, len(prompts), budget, sizing)
        return cache

    def _budget_slots(
        self,
        prompts: list[list[int]],
        shape: CacheShape,
        seq_len: int,
        kept: KVCache | None,
        cached: bool,
    ) -> tuple[int, str]:
        """Sequences of ``seq_len`` tokens the budget holds, and how it was set (for the log).
        Sized from memory, every rank of the TP / EP groups takes the smallest count."""
        o = self.options
        device = io.model_device(self.model)
        memory = None if o.kv_cache_gib is not None else device_memory(device, cached)
        if memory is None:  # an explicit budget, or the CPU default: exactly as set
            gib = CPU_KV_CACHE_GIB if o.kv_cache_gib is None else o.kv_cache_gib
            default = " (the CPU default)" if o.kv_cache_gib is None else ""
            return slots_for_budget(shape, gib, seq_len), f"kv_cache_gib={gib}{default}"
        free, total = memory
        if kept is not None:  # freed before a new cache is allocated
            free += kept.kv.numel() * kept.kv.element_size()
        lens = sorted(len(p) for p in prompts)
        prefill = max(lens[-1], min(o.max_prefill_tokens, sum(lens)))
        headroom = Headroom.of(self.model, shape, seq_len, prefill, self.graphs)
        per_seq = shape.bytes_per_token * seq_len
        local = memory_slots(free, total, per_seq, o.kv_cache_fraction, headroom)
        slots = _agree_min(local, self._sizing_groups())
        require_slots(slots, free, total, per_seq, o.kv_cache_fraction, headroom)
        gib = 2**30
        sizing = (
            f"kv_cache_fraction={o.kv_cache_fraction} of {total / gib:.2f} GiB, "
            f"{(total - free) / gib:.2f} GiB in use, headroom {headroom.fixed / gib:.2f} GiB + "
            f"{headroom.per_slot / 2**20:.2f} MiB a slot"
        )
        if slots < local:
            sizing += f"; {local} here, the fewest of the TP / EP group taken"
        return slots, sizing

    def _sizing_groups(self) -> list[dist.ProcessGroup]:
        """The groups whose ranks must hold equal slot counts: TP (the same decode batches),
        then EP's (every MoE forward is a collective; nested with TP in megatron's layouts)."""
        groups = []
        if self.layout.tp_size > 1:
            groups.append(self.layout.tp_group)
        expert = self.layout.expert_tp_ep_group
        if expert is not None:
            groups.append(expert)
        return groups

    def _new_cache(self, shape: CacheShape, slots: int, seq_len: int, last: bool) -> KVCache | None:
        """The cache, or None on every rank of the groups when it was sized from memory and
        some rank's allocator could not place it in one piece (fragmentation): the caller sizes
        it again from the driver's free memory alone (``last``: an error on every rank)."""
        device = io.model_device(self.model)
        if self.options.kv_cache_gib is not None or device.type != "cuda":
            return KVCache(shape, slots, seq_len, device, self.fixed)
        cache, error = None, None
        try:
            cache = KVCache(shape, slots, seq_len, device, self.fixed)
        except torch.OutOfMemoryError as e:
            error = e
        if _agree_min(int(error is None), self._sizing_groups()) == 1:
            return cache
        cache = None
        if last:
            raise RuntimeError(
                f"the KV cache ({slots} slots of {seq_len} tokens) did not fit on this GPU or "
                "another of its TP / EP group; lower rollout.engine.kv_cache_fraction or set "
                "rollout.engine.kv_cache_gib"
            ) from error
        return None

    @property
    def memory(self) -> str:
        """Where the caches live (``rollout.engine.kv_cache_memory``), for the start-up line."""
        if self.fixed is not None:
            return "KV cache at a fixed address"
        return "KV cache from the " + (self._memory_off or "allocator")

    def release(self) -> bool:
        """Return a dropped cache's fixed-address memory to the driver (True without one).
        While a tensor still views it (an exception's frames), the next cache takes a new
        range (its graphs are captured again) and this one is unmapped once it is free."""
        self._retired = [r for r in self._retired if not r.unmap()]
        if self.fixed is None or self.fixed.unmap():
            return True
        self._retired.append(self.fixed)
        self.fixed = type(self.fixed)(self.fixed.device, self.fixed.capacity)
        return False

    def _report(self, cache: KVCache, samples: int, budget: int, sizing: str) -> None:
        """One log line (global rank 0) at the first call, and whenever memory (not a smaller
        batch: an evaluation's, a shortfall round's) lets the cache hold fewer sequences than
        ever before."""
        bound = cache.slots < samples  # the budget, not the batch, sets the slots
        seen = self._reported_slots
        if seen is not None and (cache.slots >= seen or not bound):
            return
        self._reported_slots = cache.slots
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        size = _size(cache.kv.numel() * cache.kv.element_size())
        lines = [
            f"rollout: KV cache {size}: {cache.slots} slots of {cache.seq_len} tokens for "
            f"{samples} samples (room for {budget})",
            *(f"  sized by {part}" for part in sizing.split("; ")),  # short lines: no wrapping
        ]
        print("\n".join(lines), flush=True)


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _agree_min(value: int, groups: list[dist.ProcessGroup]) -> int:
    """The minimum of ``value`` over the ranks of each group in turn (one all-reduce each)."""
    for group in groups:
        value = -all_reduce_max([-value], group, torch.int64)[0]
    return value


class KVCache:
    """The buffer plus the per-forward write/read plan that every layer's attention shares."""

    def __init__(
        self,
        shape: CacheShape,
        slots: int,
        seq_len: int,
        device,
        memory: FixedAddressMemory | None = None,
    ) -> None:
        """``memory``: the buffer is mapped there (at its fixed address), else allocated."""
        self.shape, self.slots, self.seq_len = shape, slots, seq_len
        dims = (shape.layers, 2, slots + 1, shape.kv_heads, seq_len, shape.head_dim)
        # Zeroed: masked-out keys still enter the score GEMM, and a NaN bit pattern left in
        # unwritten memory would turn masked scores (NaN + -inf) and the output into NaN.
        if memory is None:
            self.kv = torch.zeros(dims, dtype=shape.dtype, device=device)
        else:
            nbytes = math.prod(dims) * shape.dtype.itemsize
            self.kv = memory.map(nbytes).view(shape.dtype).view(dims).zero_()
        self.scratch = slots
        self.decoding = False
        self.packed: PackedSeqParams | None = None  # prefill: the documents of the stream
        self.write_slot: Tensor | None = None  # prefill: [T] slot of each packed token
        self.write_pos: Tensor | None = None  # prefill: [T]; decode: [b] position per row
        self.ctx = 0  # decode: keys [0, ctx) are read (a bucket >= every row's pos + 1)
        self.mask: Tensor | None = None  # decode: [b, 1, 1, ctx] keys each row may see
        # RoPE of this forward's tokens, ``[s, b, 1, rot_dim]`` cos and sin in the model dtype
        # (scaled by YaRN's factor), computed once per forward for every layer; None: no RoPE.
        self.rope: tuple[Tensor, Tensor] | None = None
        self.rotary_interleaved = False
        self.attention = "sdpa"  # decode attention: "sdpa" (masked, cuDNN) or "triton"

    def release(self) -> None:
        """Let go of the buffer, so its memory can be freed while this object is still
        referenced (a cache is not used after this)."""
        del self.kv

    def plan_prefill(self, packed: PackedSeqParams, write_slot: Tensor, write_pos: Tensor) -> None:
        self.decoding, self.packed = False, packed
        self.write_slot, self.write_pos = write_slot, write_pos

    def plan_decode(self, pos: Tensor, ctx: int) -> None:
        self.decoding, self.write_pos, self.ctx = True, pos, ctx
        # one mask for all layers: row r sees its keys [0, pos_r]
        self.mask = (torch.arange(ctx, device=pos.device)[None, :] <= pos[:, None])[:, None, None]

    def apply_rope(self, x: Tensor) -> Tensor:
        """megatron-core's unfused RoPE formula (``t * cos + rotate_half(t) * sin``, the rotary
        part first) with this forward's precomputed cos / sin: ``x [s, b, n, d]``."""
        if self.rope is None:
            return x
        return rope_reference(x, *self.rope, self.rotary_interleaved)

    def move_rows(self, src: list[int], dst: list[int], ctx: int) -> None:
        """Copy slots ``src`` to ``dst`` (the first ``ctx`` positions): compaction. One copy
        per row between views, with no temporary: a gather of every moved row (up to half the
        slots when many rows finish at once) could need half the cache again. Compaction's
        sources (rows past the new active count) are never destinations, so the order is free.
        """
        for s, d in zip(src, dst, strict=True):
            self.kv[:, :, d, :, :ctx].copy_(self.kv[:, :, s, :, :ctx])
