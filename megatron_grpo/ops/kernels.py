"""The one road to the Triton kernels, and every kernel choice's vocabulary and resolver.

* The only module of the package that imports ``megatron_grpo.kernels`` (``kernels/`` at the
  repository's top, installed under the package): the ops reach a kernel as
  ``triton_kernels.<name>`` (the kernel package, imported once here) and its constants from here.
* :data:`CHOICES`: the names each kernel choice takes, one table for training and decode
  (``impl``: the element-wise ops, the LM-head seam and the decode step; ``rope``: packed RoPE;
  ``qk_norm_rope``: it fused with the q / k norms; ``grouped_gemm``: the MoE experts;
  ``attention``: how packed documents run through SDPA; ``decode_attention``: the decode step's
  attention; ``tp_overlap``: the sequence-parallel collectives of the TP linear layers).
* :func:`resolve_impl`: THE decision of what ``impl`` "auto" means on a device.
* :class:`LayerKernels`: the model's layer kernel choices as one frozen value, given to the
  layer spec when the model is built (a recipe's ``model.layer_kernels`` section).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

import megatron_grpo.kernels as triton_kernels
from megatron_grpo.kernels.split_accumulator import RESIDUAL_BITS
from megatron_grpo.kernels.swiglu import MAX_SCALED_F

__all__ = [
    "CHOICES",
    "IMPLS",
    "MAX_SCALED_F",
    "RESIDUAL_BITS",
    "LayerKernels",
    "check_choice",
    "resolve_impl",
    "triton_kernels",
    "triton_runs_on",
]

CHOICES: dict[str, tuple[str, ...]] = {
    # "auto": the Triton kernels on CUDA when triton imports, else the torch reference
    "impl": ("auto", "torch", "triton"),
    # "megatron": megatron-core's own per-document loop (the baseline)
    "rope": ("auto", "torch", "triton", "megatron"),
    # the attention's q / k RMSNorms and packed RoPE (attention/rope.py): "fused" = one op
    # (ops/layers/qk_norm_rope.py); "auto" = fused where both would run Triton kernels
    "qk_norm_rope": ("auto", "fused", "separate"),
    # "auto": torch's grouped_mm where it takes the operands, else the padded bmm
    "grouped_gemm": ("auto", "grouped_mm", "padded_bmm"),
    # the SDPA backends of packed documents' length buckets (attention/packed.py)
    "attention": ("plan_free", "exact"),
    # the path of packed documents (attention/choice.py): "auto" = one SDPA for documents of
    # one length, else varlen_attn where it runs, else blocked
    "packed_attention": ("auto", "varlen", "blocked", "buckets"),
    # "auto": follows the decode impl ("triton": exact row lengths; "sdpa": the masked bucket)
    "decode_attention": ("auto", "sdpa", "triton"),
    # MoE token dispatch at EP > 1 (megatron/moe/ep_dispatch.py): "auto" = the gathered one
    # where no host sync is wanted (decode steps), megatron-core's all-to-all elsewhere
    "moe_dispatch": ("auto", "alltoall", "gathered"),
    # MoE pairs by local expert (ops/layers/sort_keys.py): "counting" = one Triton launch,
    # O(N^2) compares; "auto" = counting on CUDA for decode-sized batches, else argsort
    "moe_sort": ("auto", "argsort", "counting"),
    # the next token at TP > 1 (rollout/engine/tp_sampling.py): "auto" = from the vocabulary
    # shards where the sampling allows (untruncated, greedy), else the gathered logits
    "tp_sampling": ("auto", "gathered", "vocab_parallel"),
    # the sequence-parallel linear layers' collectives (megatron/model/tp_overlap.py): "ring" =
    # chunked collective-matmul over NCCL P2P, "symm" = torch's symmetric-memory fused ops,
    # "off" = megatron-core's layers; "auto": resolve_tp_overlap
    "tp_overlap": ("auto", "off", "ring", "symm"),
    # the fused decode step's TP all-reduce (rollout/engine/tp_all_reduce.py): one-shot /
    # two-shot over symmetric memory up to a size; "auto": the tiers measured ahead of NCCL
    "tp_all_reduce": ("auto", "nccl", "one_shot", "two_shot"),
    # the fused decode step in two halves whose TP all-reduces overlap the other half's work
    # (rollout/engine/decode_overlap.py); "auto": from the row counts measured ahead
    "decode_overlap": ("auto", "off", "halves"),
    # where the engine's KV cache lives (rollout/engine/fixed_address.py): "fixed_address" =
    # one reserved range, mapped per call, so decode graphs stay valid; "auto": with graphs
    "kv_cache_memory": ("auto", "fixed_address", "allocator"),
}
IMPLS = CHOICES["impl"]


def check_choice(kind: str, value: str, field: str | None = None) -> str:
    """``value`` when it is one of ``CHOICES[kind]``, else a ValueError naming ``field`` (default:
    ``kind``), the valid names and the closest one."""
    names = CHOICES[kind]
    if value in names:
        return value
    close = difflib.get_close_matches(str(value), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"{field or kind} must be one of {names}, got {value!r}{hint}")


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_runs_on(device_type: str) -> bool:
    """Whether the Triton kernels run on ``device_type`` tensors: triton imports, and the
    tensors are on CUDA or Triton's CPU interpreter is on (``TRITON_INTERPRET=1``)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return _triton_importable() and (device_type == "cuda" or interpreted)


def resolve_impl(impl: str, device_type: str) -> str:
    """The kernel implementation ``impl`` means on ``device_type`` tensors: "torch" or "triton".

    ``auto`` = triton on CUDA when triton imports, else torch. ``triton`` on CPU tensors only
    works under ``TRITON_INTERPRET=1``: anything else is an error rather than a silent switch to
    the torch path. The one resolver of the LM-head plan, the layer ops and the decode plan.
    """
    check_choice("impl", impl)
    if impl == "torch":
        return "torch"
    if impl == "auto":
        return "triton" if device_type == "cuda" and _triton_importable() else "torch"
    if not _triton_importable():
        raise ImportError("impl='triton' needs the triton package")
    if not triton_runs_on(device_type):
        raise ValueError(
            f"impl='triton' on {device_type} tensors needs TRITON_INTERPRET=1 (or use impl='torch')"
        )
    return "triton"


@dataclass(frozen=True)
class LayerKernels:
    """The kernels of the portable spec's layers, chosen once when the model is built.

    Attributes (each one of :data:`CHOICES` of its kind; errors name the field):
        elementwise: RMSNorm, SwiGLU (dense MLP and grouped experts) and the MoE
            dispatches' row sums (``ops.layers.gather_sum``): ``impl`` names.
        grouped_gemm: the MoE experts' two grouped GEMMs: ``grouped_gemm`` names.
        rope: packed (THD) RoPE: ``rope`` names ("megatron": megatron-core's loop).
        attention: how packed documents' length buckets run: ``attention`` names.
        packed_attention: which path runs packed documents: ``packed_attention`` names.
        moe_dispatch: the MoE token dispatch at EP > 1: ``moe_dispatch`` names ("gathered"
            needs every rank of the expert group to bring the same token count: the engine's).
        moe_sort: how the MoE dispatches sort (token, slot) pairs by expert: ``moe_sort``
            names (``ops.layers.sort_keys.resolve_moe_sort``).
        tp_overlap: the TP linear layers' sequence-parallel all-gather / reduce-scatter:
            ``tp_overlap`` names ("ring" / "symm": overlapped with the GEMMs chunk by chunk,
            over NCCL P2P / torch's symmetric memory, where SP is on; without SP the layers are
            megatron-core's; "auto": megatron-core's until a kind is measured ahead on GPU,
            ``tp_overlap.resolve_tp_overlap``). The portable spec's; Transformer Engine's spec
            takes only "auto".
        qk_norm_rope: whether packed RoPE and the q / k RMSNorms before it run as one op
            (``ops.layers.qk_norm_rope``): ``qk_norm_rope`` names ("auto": fused where the norms'
            and RoPE's kernels both resolve to Triton, ``attention.rope.fuses_qk_norm``).
    """

    elementwise: str = "auto"
    grouped_gemm: str = "auto"
    rope: str = "auto"
    attention: str = "plan_free"
    packed_attention: str = "auto"
    moe_dispatch: str = "auto"
    moe_sort: str = "auto"
    tp_overlap: Literal["auto", "off", "ring", "symm"] = "auto"  # a recipe's bare off: "off"
    qk_norm_rope: str = "auto"  # last: the fields before it keep their positions

    def __post_init__(self) -> None:
        check_choice("impl", self.elementwise, "elementwise")
        check_choice("grouped_gemm", self.grouped_gemm)
        check_choice("rope", self.rope)
        check_choice("qk_norm_rope", self.qk_norm_rope)
        check_choice("attention", self.attention)
        check_choice("packed_attention", self.packed_attention)
        check_choice("moe_dispatch", self.moe_dispatch)
        check_choice("moe_sort", self.moe_sort)
        check_choice("tp_overlap", self.tp_overlap)
