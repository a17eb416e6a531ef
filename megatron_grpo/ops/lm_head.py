"""The chunked vocab-parallel LM head shared by the log-prob op and the fused GRPO path.

Rows (tokens) are processed in chunks of ``chunk_size``; each chunk's ``[C, V_local]`` fp32
logits are the only vocabulary-sized tensor alive. The three GEMMs (logits, d_hidden, d_weight)
run through torch (cuBLAS on GPU) with fp32 results; the per-chunk softmax work goes through
the kernel seam (:mod:`megatron_grpo.ops.reference` or ``megatron_grpo.kernels``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from megatron_grpo.ops.comm import TPInfo
from megatron_grpo.ops.dispatch import Kernels, resolve_kernels

# Budget of one fp32 [C, V_local] logits chunk when chunk_size is None.
DEFAULT_CHUNK_BYTES = 256 * 2**20
_CHUNK_ALIGN = 64


@cache
def _has_out_dtype_mm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(..., out_dtype=float32)`` runs for ``dtype`` inputs on this device."""
    try:
        a = torch.zeros(2, 2, dtype=dtype, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def mm_f32(a: Tensor, b: Tensor, acc: Tensor | None = None) -> Tensor:
    """``a @ b`` accumulated and returned in fp32; ``acc += a @ b`` in place when given.

    Low-precision operands use the out_dtype GEMM (fp32 accumulator written out as fp32) where
    torch provides it, else they are upcast (exact products, more memory: CPU and old torch).
    """
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.mm(a, b) if acc is None else acc.addmm_(a, b)
    if a.dtype == b.dtype and _has_out_dtype_mm(a.device.type, a.dtype):
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    if acc is None:
        return torch.mm(a.float(), b.float())
    return acc.addmm_(a.float(), b.float())


def default_chunk_size(v_local: int) -> int:
    """Rows per chunk so that one fp32 [C, V_local] chunk stays near ``DEFAULT_CHUNK_BYTES``."""
    rows = DEFAULT_CHUNK_BYTES // (4 * max(v_local, 1))
    return max(_CHUNK_ALIGN, rows // _CHUNK_ALIGN * _CHUNK_ALIGN)


@dataclass(frozen=True)
class LMHead:
    """A validated vocab-parallel LM head shard and how to run it chunk by chunk.

    ``weight`` is this rank's [V_local, H] shard: rows ``[vocab_start, vocab_start + V_local)``
    of the padded vocabulary, of which the first ``n_valid`` are real tokens.
    """

    weight: Tensor
    tp: TPInfo
    sequence_parallel: bool
    vocab_size: int
    vocab_start: int
    n_valid: int
    inv_temperature: float
    chunk_size: int
    kernels: Kernels

    def logits(self, h: Tensor) -> Tensor:
        """[C, H] -> raw fp32 logits [C, V_local] (temperature is applied by the kernels)."""
        return mm_f32(h, self.weight.t())

    def stats(self, logits: Tensor, t_local: Tensor, with_entropy: bool):
        """Local row stats (m, s, zt, b) of a chunk; see ``reference.logits_row_stats``."""
        return self.kernels.logits_row_stats(
            logits, t_local, self.n_valid, self.inv_temperature, with_entropy
        )

    def dlogits(
        self,
        logits: Tensor,
        t_local: Tensor,
        lse: Tensor,
        g_logp: Tensor,
        g_ent: Tensor | None,
        pz: Tensor | None,
    ) -> Tensor:
        """d loss / d logits of a chunk in the GEMM dtype (the weight's), [C, V_local].

        fp32 weights: written in place over ``logits``. Low precision: rounded to the weight
        dtype like the input of any bf16 GEMM; the GEMMs then accumulate in fp32.
        """
        out = logits if self.weight.dtype == torch.float32 else None
        if out is None:
            out = torch.empty(logits.shape, dtype=self.weight.dtype, device=logits.device)
        return self.kernels.logits_grad(
            logits, t_local, self.n_valid, self.inv_temperature, lse, g_logp, g_ent, pz, out=out
        )

    def grad_gemms(
        self, dlogits: Tensor, h: Tensor, dw_acc: Tensor | None, want_dh: bool
    ) -> Tensor | None:
        """``dw_acc += dlogits^T @ h`` (fp32) and returns fp32 ``dlogits @ W`` [C, H]."""
        if dw_acc is not None:
            mm_f32(dlogits.t(), h, acc=dw_acc)
        return mm_f32(dlogits, self.weight) if want_dh else None


def build_lm_head(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    tp: TPInfo,
    sequence_parallel: bool,
    temperature: float,
    vocab_size: int | None,
    chunk_size: int | None,
    impl: str,
) -> LMHead:
    """Validates the op's inputs (errors name the argument) and describes this rank's shard."""
    _check_shapes(hidden, weight, targets, tp, sequence_parallel)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    v_local = weight.shape[0]
    padded = v_local * tp.size
    if vocab_size is None:
        vocab_size = padded
    if not 1 <= vocab_size <= padded:
        raise ValueError(
            f"vocab_size must be in [1, V_local * TP = {padded}] (padded rows excluded), "
            f"got {vocab_size}"
        )
    if chunk_size is None:
        chunk_size = default_chunk_size(v_local)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    start = tp.rank * v_local
    return LMHead(
        weight=weight,
        tp=tp,
        sequence_parallel=sequence_parallel and tp.size > 1,
        vocab_size=vocab_size,
        vocab_start=start,
        n_valid=min(max(vocab_size - start, 0), v_local),
        inv_temperature=1.0 / float(temperature),
        chunk_size=chunk_size,
        kernels=resolve_kernels(impl, hidden.device),
    )


def _check_shapes(
    hidden: Tensor, weight: Tensor, targets: Tensor, tp: TPInfo, sequence_parallel: bool
) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [T_local, H] and weight [V_local, H], got {list(hidden.shape)} "
            f"and {list(weight.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden H={hidden.shape[1]} != weight H={weight.shape[1]}")
    if hidden.dtype != weight.dtype or hidden.device != weight.device:
        raise ValueError(
            f"hidden ({hidden.dtype}, {hidden.device}) and weight ({weight.dtype}, "
            f"{weight.device}) must share dtype and device"
        )
    if not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden must be floating point, got {hidden.dtype}")
    if targets.dim() != 1 or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(
            f"targets must be an integer [T] tensor, got {targets.dtype} {list(targets.shape)}"
        )
    if targets.device != hidden.device:
        raise ValueError(f"targets is on {targets.device}, hidden on {hidden.device}")
    t_total = hidden.shape[0] * (tp.size if sequence_parallel else 1)
    if targets.shape[0] != t_total:
        sp = f" (sequence_parallel: T_local {hidden.shape[0]} x TP {tp.size})" * sequence_parallel
        raise ValueError(f"targets has {targets.shape[0]} rows, expected T = {t_total}{sp}")


def select_rows(rows: Tensor | None, targets: Tensor, vocab_size: int) -> Tensor | None:
    """Indices [R] of the active rows of a bool ``rows`` [T] (None = all T), targets checked."""
    t_total = targets.shape[0]
    idx = None
    if rows is not None:
        if rows.dtype != torch.bool or rows.shape != (t_total,) or rows.device != targets.device:
            raise ValueError(
                f"rows must be a bool [T={t_total}] tensor on {targets.device}, got {rows.dtype} "
                f"{list(rows.shape)} on {rows.device}"
            )
        idx = rows.nonzero().squeeze(1)
    check_targets(targets, idx, vocab_size)
    return idx


def check_targets(targets: Tensor, idx: Tensor | None, vocab_size: int) -> None:
    """Raises naming the first active position whose target is outside [0, vocab_size)."""
    t_sel = targets if idx is None else targets[idx]
    bad = (t_sel < 0) | (t_sel >= vocab_size)
    if t_sel.numel() and bool(bad.any()):  # one host sync
        first = int(bad.nonzero()[0, 0])
        pos = first if idx is None else int(idx[first])
        raise ValueError(
            f"targets[{pos}] = {int(t_sel[first])} is outside [0, vocab_size={vocab_size}) at an "
            "active row (mask such rows out with `rows`)"
        )


def take_rows(x: Tensor, idx: Tensor | None, start: int, stop: int) -> Tensor:
    """Rows ``start:stop`` of the active rows of x ([T, ...] -> [stop - start, ...])."""
    return x[start:stop] if idx is None else x[idx[start:stop]]
