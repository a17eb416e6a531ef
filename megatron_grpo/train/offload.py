"""``training.offload_during_rollout``: the optimizer state and the main gradients wait in host
memory while the policy generates (colocated mode), so the engine's KV cache can have theirs.

What moves, per storage (each once, whatever views it): the torch optimizers' state tensors
(Adam's ``exp_avg`` / ``exp_avg_sq``), megatron's fp32 main parameters, their ``.grad`` if set,
and megatron DDP's gradient buffers (``main_grad``). Never the model's own parameters: the
engine decodes with them (under ``FP32Optimizer`` they are the main parameters, and stay).

A storage is copied into a pinned host buffer (kept for the next step) with non-blocking copies,
then resized to 0 bytes, which frees its device memory while every tensor and view over it
(``param.main_grad``, bucket views, the optimizer's state dict) stays the same object; the
reload resizes it back and copies the bytes in. A gradient buffer that holds only zeros (the
trainer zeroes it after every update) is not copied: it comes back zeroed. Bit-exact both ways.

``auto`` turns it on when the step's samples would not all get a KV-cache slot with the
optimizer state and gradients on the GPU, from the memory plan (``megatron/plan/memory.py``) and
the engine's own sizing rule (``rollout/kv_cache.py``), and says so in one start-up line. Left
off by the plan, it measures again before each rollout (:class:`MeasuredCheck`): the first
shortfall turns it on for the rest of the run, in one line.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.model.build import unwrap
from megatron_grpo.megatron.plan.generation import replica_bytes
from megatron_grpo.rollout.engine import kv_cache as kvc
from megatron_grpo.rollout.engine import memory_release
from megatron_grpo.train import comm
from megatron_grpo.train import optimizer_memory as om
from megatron_grpo.train.config import TrainConfig

GIB = 2**30


@dataclass
class _Moved:
    """One storage off the device: its bytes in ``host`` (None: it held zeros)."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None


def _bytes_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A ``[nbytes]`` uint8 tensor over the whole storage."""
    out = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return out.set_(storage, 0, (nbytes,), (1,))


class RolloutOffload:
    """``with offload.during_rollout(step): ...``: moves out, runs the block, moves back;
    ``seconds``: the last round trip's wall time (``perf/offload_seconds``).

    ``check``: the KV cache's room for a step's samples, measured before each rollout (None:
    memory does not decide). Where it lacks room, the training passes' CUDA graphs go first
    (``drop_graphs``, e.g. :meth:`GRPOStep.drop_graphs`, returns how many it dropped; their
    pools are memory nothing else can use, and they cost only a capture at the next pass);
    then, under ``auto`` (``pending``: left off by the plan), offload turns on for the rest of
    the run (``say``: the line that says so; ``on_enable``: called then, for what depends on
    the decision)."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        optimizer,
        enabled: bool,
        check: MeasuredCheck | None = None,
        say: Callable[[str], None] = print,
        pending: bool = False,
    ) -> None:
        self.chunks, self.optimizer, self.enabled = chunks, optimizer, enabled
        self.check, self.say = check, say
        self.pending = pending and not enabled and check is not None
        self.seconds = 0.0
        self.on_enable: Callable[[], None] | None = None
        self.drop_graphs: Callable[[], int] | None = None
        self.graph_drops = 0  # rollouts before which the graphs were dropped
        self._moved: list[_Moved] = []
        self._host: dict[tuple[int, int], torch.Tensor] = {}  # (slot, nbytes) -> pinned buffer

    @contextlib.contextmanager
    def during_rollout(self, step: int = 0) -> Iterator[None]:
        """``step``: 0-based, for the lines of a measured switch."""
        short = 0.0 if self.enabled else self._make_room(step)
        if short > 0 and self.pending:
            self.enabled, self.pending = True, False
            self.say(self.check_line(step, short))
            if self.on_enable is not None:
                self.on_enable()
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        self.offload()
        self.seconds = time.perf_counter() - start
        self._make_room(step)  # what the moves left short
        try:
            yield
        finally:
            start = time.perf_counter()
            self.reload()
            self.seconds += time.perf_counter() - start

    def _make_room(self, step: int) -> float:
        """The bytes the step's cache would lack now on the rank that lacks most (0: nothing
        measured), after dropping the training passes' graphs if it lacked any. A collective
        where measured: every rank takes the same branches."""
        if self.check is None or (self.drop_graphs is None and not self.pending):
            return 0.0
        device = self._device()
        short = self.check.short(device)
        if short <= 0 or self.drop_graphs is None:
            return short
        dropped = self.drop_graphs()
        memory_release.release(device)
        after = self.check.short(device)
        if dropped:
            self.graph_drops += 1
            if self.graph_drops == 1:
                self.say(self.drop_line(step, short, after))
        return after

    @staticmethod
    def drop_line(step: int, short: float, after: float) -> str:
        still = f"still {after / GIB:.2f} GiB short" if after > 0 else "room for all"
        return (
            f"before the rollout of step {step + 1} the KV cache would lack {short / GIB:.2f} "
            f"GiB for the step's samples: the training passes' CUDA graphs were dropped with "
            f"their memory pools ({still}); they are captured again at the next passes, and "
            "dropped again before each rollout that lacks room"
        )

    @staticmethod
    def check_line(step: int, short: float) -> str:
        return (
            f"training.offload_during_rollout=auto: on from step {step + 1} (measured before "
            f"its rollout, the KV cache would lack {short / GIB:.2f} GiB for the step's samples "
            "with the optimizer state and main grads on the GPU; the plan had left it off)"
        )

    # ------------------------------------------------------------------ the moves
    def offload(self) -> None:
        """Copy every storage out (grad buffers of zeros: none), then free it on the device."""
        if self._moved:
            raise RuntimeError("offload: the previous offload was not reloaded")
        grads = {_key(t) for t in self._grad_buffers()}
        for slot, (storage, zeros_ok) in enumerate(self._storages(grads)):
            nbytes = storage.nbytes()
            view = _bytes_view(storage, nbytes)
            host = None
            if not (zeros_ok and not bool(view.any())):
                host = self._host_buffer(slot, nbytes, view.device)
                host.copy_(view, non_blocking=True)
            self._moved.append(_Moved(storage, nbytes, host))
        device = self._device()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the host copies are complete before the frees
        for moved in self._moved:
            moved.storage.resize_(0)
        memory_release.release(device)

    def reload(self) -> None:
        """Re-allocate every moved storage and copy its bytes back (zeros: zeroed)."""
        for moved in self._moved:
            moved.storage.resize_(moved.nbytes)
            view = _bytes_view(moved.storage, moved.nbytes)
            if moved.host is None:
                view.zero_()
            else:
                view.copy_(moved.host, non_blocking=True)
        device = self._device()
        if device.type == "cuda":  # the pinned buffers are free for the next offload
            torch.cuda.synchronize(device)
        self._moved = []

    def _host_buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        key = (slot, nbytes)
        if key not in self._host:
            pin = device.type == "cuda"
            self._host[key] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        return self._host[key]

    # ------------------------------------------------------------------ what moves
    def _device(self) -> torch.device:
        return next(unwrap(self.chunks[0]).parameters()).device

    def _grad_buffers(self) -> list[torch.Tensor]:
        """megatron DDP's ``grad_data`` buffers (dense and expert-parallel); the parameters'
        ``main_grad`` where a chunk has no buffers."""
        out = []
        for chunk in self.chunks:
            buffers = getattr(chunk, "buffers", None)
            if isinstance(buffers, list):
                buffers = buffers + list(getattr(chunk, "expert_parallel_buffers", None) or [])
                out += [b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None]
            else:
                grads = (getattr(p, "main_grad", None) for p in chunk.parameters())
                out += [g for g in grads if g is not None]
        return out

    def _storages(self, grads: set[int]) -> list[tuple[torch.UntypedStorage, bool]]:
        """Distinct device storages to move, in a stable order, each with whether it is a
        gradient buffer (copied only when not all zeros); the model's parameters excluded."""
        device = self._device()
        model = {_key(p) for chunk in self.chunks for p in chunk.parameters()}
        tensors = [*om.state_tensors(self.optimizer), *om.main_params(self.optimizer)]
        tensors += [p.grad for p in om.main_params(self.optimizer) if p.grad is not None]
        tensors += self._grad_buffers()
        seen, out = set(model), []
        for t in tensors:
            key = _key(t)
            if t.device != device or key in seen or t.untyped_storage().nbytes() == 0:
                continue
            seen.add(key)
            out.append((t.untyped_storage(), key in grads))
        return out


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------- auto
def decide(cfg: TrainConfig, policy: torch.nn.Module, layout: ParallelLayout) -> tuple[bool, str]:
    """Whether to offload, and the start-up line that says why ("" where memory was not asked:
    ``false``, or ``auto`` without a KV cache sized from GPU memory).
    ``auto`` asks: would the KV cache for this rank's samples of a step (over-provisioned with
    partial rollouts) fit under ``kv_cache_fraction`` with the planned optimizer state and
    gradients on the GPU? Every rank takes the answer of the one that needs it most."""
    mode, name = cfg.training.offload_during_rollout, "training.offload_during_rollout"
    if mode is False:
        return False, ""
    if mode is True:
        return True, f"{name}=true: the optimizer state and main grads wait on the host"
    why = _auto_off(cfg, policy)
    if why:  # nothing to gain: no line
        return False, ""
    need, left, movable = _cache_room(cfg, policy, layout)
    short = need - left  # > 0: the cache would not hold every sample
    [short] = comm.all_reduce_max([float(short)])
    on = short > 0
    return on, (
        f"{name}=auto: {'on' if on else 'off'} (the KV cache for a step's samples needs "
        f"{need / GIB:.2f} GiB on this rank; {left / GIB:.2f} GiB would be free with the "
        f"optimizer state and main grads on the GPU, {(left + movable) / GIB:.2f} GiB without "
        f"their {movable / GIB:.2f} GiB of the memory plan"
        + (")" if on else "; measured again before each rollout)")
    )


@dataclass(frozen=True)
class MeasuredCheck:
    """``auto`` the plan left off: the memory measured before a rollout decides, with the
    engine's own sizing rule (``kv_cache.memory_budget``). The plan does not see everything that
    stays allocated across steps: a Qwen3-8B TP4 run on 4 H100s planned 0.5 GiB to spare and its
    cache held 485 of 512 samples from step 2 (a second decode wave: rollout 28.5 s vs 21.6 s)."""

    need: float  # bytes the cache of a step's samples needs, per-slot headroom included
    fixed: float  # the headroom's fixed bytes (scratch slot, RoPE table, one prefill)
    fraction: float  # rollout.engine.kv_cache_fraction

    def short(self, device: torch.device) -> float:
        """Bytes the cache would lack now on the rank that lacks most (<= 0: none lacks)."""
        memory = kvc.device_memory(device, cached=True)
        if memory is None:
            return 0.0
        left = kvc.memory_budget(*memory, self.fraction, self.fixed)
        [short] = comm.all_reduce_max([float(self.need - left)])
        return short


def measured_check(
    cfg: TrainConfig, policy: torch.nn.Module, layout: ParallelLayout
) -> MeasuredCheck | None:
    """The per-rollout check of the cache's room (None: memory does not decide its size), for
    ``auto`` and for the graphs that yield to the cache under any setting."""
    if _auto_off(cfg, policy):
        return None
    need, fixed, _ = _cache_need(cfg, policy, layout)
    return MeasuredCheck(need, fixed, cfg.rollout.engine.kv_cache_fraction)


def _auto_off(cfg: TrainConfig, policy: torch.nn.Module) -> str:
    """Why ``auto`` is off without looking at memory ("" when memory decides)."""
    r = cfg.rollout
    if r.placement == "separate":
        return "rollout.placement: separate generates on other ranks"
    if r.input_path is not None or r.source == "files":
        return "rollouts are read from files"
    if r.source not in (None, "generate"):
        return f"rollout.source={r.source!r} generates with its own engine"
    if r.engine.kind != "kv_cache":
        return f"rollout.engine.kind={r.engine.kind}: no KV cache"
    if r.engine.kv_cache_gib is not None:
        return f"rollout.engine.kv_cache_gib={r.engine.kv_cache_gib} fixes the cache's size"
    if next(policy.parameters()).device.type != "cuda":
        return "no GPU"
    return ""


def _cache_room(
    cfg: TrainConfig, policy: torch.nn.Module, layout: ParallelLayout
) -> tuple[float, float, float]:
    """(bytes the KV cache of a step needs with its headroom, bytes the engine's sizing rule
    would leave it with the plan's optimizer state and gradients on the GPU, those bytes)."""
    need, fixed, parts = _cache_need(cfg, policy, layout)
    movable = parts["grads"] + parts["optimizer"]
    free, total = torch.cuda.mem_get_info()
    overhead = max(total - free - torch.cuda.memory_allocated(), 0)  # CUDA context, NCCL
    resident = parts["params"] + parts["reference"] + movable + overhead
    if cfg.rollout.colocated.weights == "replica":  # a copy the trainer's plan does not hold
        resident += replica_bytes(cfg.model)
    left = cfg.rollout.engine.kv_cache_fraction * total - resident - fixed
    return need, left, movable


def _cache_need(
    cfg: TrainConfig, policy: torch.nn.Module, layout: ParallelLayout
) -> tuple[float, float, dict[str, float]]:
    """(bytes the KV cache of a step's samples needs, per-slot headroom included; the
    headroom's fixed bytes; this rank's memory plan by part)."""
    from megatron_grpo.megatron.plan.memory import memory_plan
    from megatron_grpo.train.dry_run import plan_args

    r, o = cfg.rollout, cfg.rollout.engine
    plan = memory_plan(cfg.model, cfg.parallel, **plan_args(cfg, layout.dp_size))
    parts = plan.stages[layout.pp_rank].bytes
    groups = r.num_prompts // layout.dp_size
    if r.partial.enabled:  # PartialRollouts keeps its over-provisioned groups in flight
        groups += math.ceil(groups * r.partial.over_provision)
    samples = groups * r.group_size
    bucket = o.context_bucket
    longest = r.max_prompt_length + r.max_response_length
    seq = min(-(-longest // bucket) * bucket, cfg.model.max_sequence_length)
    shape = kvc.CacheShape.of(policy)
    prefill = min(o.max_prefill_tokens, samples * r.max_prompt_length)
    graphs = o.cuda_graphs if o.cuda_graphs is not None else cfg.model.num_moe_experts is None
    room = kvc.Headroom.of(policy, shape, seq, max(prefill, r.max_prompt_length), graphs)
    need = samples * (shape.bytes_per_token * seq + room.per_slot)
    return need, room.fixed, parts
