"""Tensor-parallel linear layers of the portable spec with their sequence-parallel collective
overlapped with the GEMM (``LayerKernels.tp_overlap``, ``model.layer_kernels.tp_overlap``).

* :class:`OverlapColumnParallelLinear` / :class:`OverlapRowParallelLinear`: megatron-core's
  ``ColumnParallelLinear`` / ``RowParallelLinear`` (same parameters, attributes, init,
  ``sharded_state_dict`` and checkpoint keys, so DDP, the optimizer and checkpoints see
  megatron-core's layers) whose forward, where sequence parallelism is on at TP > 1, runs a
  collective-matmul: the column layer's all-gather and the row layer's reduce-scatter (and their
  backward collectives) travel chunk by chunk while other chunks' GEMMs run. Two kinds:
  - ``ring`` (:class:`RingColumnParallelLinear`, :class:`RingRowParallelLinear`): a ring of
    async NCCL send/recv per chunk (:mod:`megatron_grpo.ops.layers.ring_linear`);
  - ``symm`` (:class:`SymmColumnParallelLinear`, :class:`SymmRowParallelLinear`): torch's
    symmetric-memory fused ops, the chunks moved by the copy engines
    (:mod:`megatron_grpo.ops.layers.symm_linear`).
  The overlap applies to sequence parallelism: without it (SP off, TP 1, expert layers with
  their own communication, SP switched off for generation by ``set_model_to_sequence_parallel``)
  the layer IS megatron-core's and runs its forward.
* :func:`resolve_tp_overlap`: THE decision of what ``auto`` means; :func:`tp_linear_classes`:
  the (column, row) classes the spec builds.

``auto`` = ``off`` until a GPU run of ``tools/bench_tp_overlap.py`` shows a kind ahead of
megatron-core's collectives (``MEASURED_AHEAD``: the ring was measured behind, 0.50-0.89x at
TP 4; ``symm`` not measured yet). Not supported with either (an error when the layer is built,
naming the field): ``gradient_accumulation_fusion`` (megatron-core's APEX kernel accumulating
into ``weight.main_grad``; these layers return ``weight.grad`` like megatron-core without the
fusion) and, for the column layer, ``defer_embedding_wgrad_compute`` (the output layer's
deferral). Like megatron-core's frozen-weight path, a column layer whose weight does not require
grad gives its bias no gradient either. Transformer Engine's spec has its own overlap
(``tp_comm_overlap``, userbuffers); an explicit kind there is an error.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from megatron_grpo.ops.kernels import check_choice
from megatron_grpo.ops.layers.ring_linear import Ring, allgather_linear, linear_reduce_scatter
from megatron_grpo.ops.layers.symm_linear import (
    SymmGroup,
    symm_allgather_linear,
    symm_linear_reduce_scatter,
)

__all__ = [
    "OverlapColumnParallelLinear",
    "OverlapRowParallelLinear",
    "RingColumnParallelLinear",
    "RingRowParallelLinear",
    "SymmColumnParallelLinear",
    "SymmRowParallelLinear",
    "resolve_tp_overlap",
    "tp_linear_classes",
]

FIELD = "model.layer_kernels.tp_overlap"


# "auto" takes a kind only once a GPU run of tools/bench_tp_overlap.py shows it ahead of
# megatron-core's collectives; until then each is opt-in, as TP overlap is in Megatron-LM
# (--tp-comm-overlap) and torchtitan (async TP). The ring was measured behind (NCCL's P2P kernels
# and the GEMMs share the SMs); the symmetric-memory ops are not measured yet.
MEASURED_AHEAD: dict[str, bool] = {"ring": False, "symm": False}


def resolve_tp_overlap(choice: str, sequence_parallel: bool, tp_size: int, device_type: str) -> str:
    """ "ring", "symm" or "off": what ``choice`` (``CHOICES["tp_overlap"]``) means for a model
    with ``sequence_parallel`` at ``tp_size`` on ``device_type``. ``auto``: the kind measured
    ahead on GPU (``MEASURED_AHEAD``; symm first) with SP at TP > 1 on CUDA, else off (today:
    off). An explicit kind stays (the layers run megatron-core's forward wherever SP is off; on
    the CPU over gloo, the kind's collectives run for the tests)."""
    check_choice("tp_overlap", choice, FIELD)
    if choice != "auto":
        return choice
    could = sequence_parallel and tp_size > 1 and device_type == "cuda"
    ahead = [kind for kind in ("symm", "ring") if MEASURED_AHEAD[kind]]
    return ahead[0] if could and ahead else "off"


def tp_linear_classes(choice: str, config, use_te: bool = False) -> tuple[type, type]:
    """(column, row) linear classes of the spec for ``choice``: megatron-core's for ``off``,
    the overlap layers of the kind for ``ring`` / ``symm``. ``use_te``: Transformer Engine's
    spec, where only ``auto`` (TE's own layers) is valid."""
    if use_te:
        if check_choice("tp_overlap", choice, FIELD) != "auto":
            raise ValueError(
                f"{FIELD}={choice!r} is the portable spec's; Transformer Engine's spec overlaps "
                "through its own tp_comm_overlap (userbuffers): leave it 'auto'"
            )
        return ColumnParallelLinear, RowParallelLinear
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tp = config.tensor_model_parallel_size
    kind = resolve_tp_overlap(choice, config.sequence_parallel, tp, device)
    if kind == "off":
        return ColumnParallelLinear, RowParallelLinear
    if kind == "symm":
        return SymmColumnParallelLinear, SymmRowParallelLinear
    return RingColumnParallelLinear, RingRowParallelLinear


def _refuse_unsupported(config, layer: type, names: tuple[str, ...]) -> None:
    """A clear error where ``config`` enables one of ``names`` the overlap does not run with."""
    for name in names:
        if getattr(config, name, False):
            raise ValueError(
                f"{FIELD}={layer.KIND!r} ({layer.__name__}) does not run with "
                f"config.{name}=True: turn one of them off"
            )


class _OverlapMixin:
    """What the overlap layers share: whether the overlap applies now (building the kind's
    handle over the layer's ``tp_group`` the first time: a ring, or the symmetric-memory group)
    and megatron-core's offloading mark."""

    KIND: str  # the tp_overlap choice
    HANDLE: type  # Ring | SymmGroup

    def _overlap_applies(self) -> bool:
        """SP on (now: generation switches it off) at TP > 1, and not an expert layer that
        communicates on its own: else the layer is megatron-core's."""
        if not self.sequence_parallel or self.explicit_expert_comm:
            return False
        if self._comm is None:
            self._comm = self.HANDLE(self.tp_group)
        return self._comm.size > 1

    def _mark_offloading(self, x: torch.Tensor) -> None:
        """megatron-core's CPU activation offloading mark (Transformer Engine's contexts)."""
        ctx = getattr(self.config, "_cpu_offloading_context", None)
        if ctx is not None and ctx.inside_context is True:
            x.activation_offloading = self.config.cpu_offloading_activations


class OverlapColumnParallelLinear(_OverlapMixin, ColumnParallelLinear):
    """megatron-core's ``ColumnParallelLinear`` whose SP forward is the kind's all-gather
    linear (``ALLGATHER_LINEAR``): ``input_ [s_l, b, h] -> (output [s, b, o_l], bias [o_l] |
    None)`` (``[s, b, o]`` with ``gather_output``), the all-gather overlapped with the chunk
    GEMMs and, in backward, the input gradient's reduce-scatter with the ``d_x`` GEMMs."""

    ALLGATHER_LINEAR: staticmethod

    def __init__(self, *args, config, **kwargs) -> None:
        names = ("gradient_accumulation_fusion", "defer_embedding_wgrad_compute")
        _refuse_unsupported(config, type(self), names)  # before megatron-core's checks
        super().__init__(*args, config=config, **kwargs)
        self._comm = None  # built at the first overlapped forward (megatron's tp_group)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if not self._overlap_applies():
            return super().forward(input_, weight, runtime_gather_output)
        weight = self._checked_weight(weight)
        self._mark_offloading(input_)
        bias = None if self.skip_bias_add else self.bias
        if bias is not None and not weight.requires_grad:
            bias = bias.detach()  # megatron-core's frozen-weight path gives the bias no gradient
        output = self.ALLGATHER_LINEAR(input_, weight, bias, self._comm)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            output = gather_from_tensor_model_parallel_region(output, group=self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)

    def _checked_weight(self, weight):
        """The weight to use: ``weight`` (checked as megatron-core checks it) or the layer's."""
        if weight is None:
            if self.weight is None:
                raise RuntimeError(
                    f"{type(self).__name__}: no weight given and skip_weight_param_allocation"
                )
            return self.weight
        expected = (self.output_size_per_partition, self.input_size)
        if tuple(weight.shape) != expected:
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, not {expected}")
        return weight


class OverlapRowParallelLinear(_OverlapMixin, RowParallelLinear):
    """megatron-core's ``RowParallelLinear`` whose SP forward is the kind's linear
    reduce-scatter (``LINEAR_REDUCE_SCATTER``): ``input_ [s, b, h_l] -> (output [s_l, b, o],
    bias [o] | None)``, the reduce-scatter overlapped with the chunk GEMMs and, in backward,
    the output gradient's all-gather with the ``d_x`` GEMMs. The bias is added after the
    reduce-scatter, as megatron-core does (or returned with ``skip_bias_add``)."""

    LINEAR_REDUCE_SCATTER: staticmethod

    def __init__(self, *args, config, **kwargs) -> None:
        _refuse_unsupported(config, type(self), ("gradient_accumulation_fusion",))
        super().__init__(*args, config=config, **kwargs)
        self._comm = None  # built at the first overlapped forward (megatron's tp_group)

    def forward(self, input_):
        if not self._overlap_applies():
            return super().forward(input_)
        self._mark_offloading(input_)
        output = self.LINEAR_REDUCE_SCATTER(input_, self.weight, self._comm)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


class RingColumnParallelLinear(OverlapColumnParallelLinear):
    """``tp_overlap: ring``: :func:`~megatron_grpo.ops.layers.ring_linear.allgather_linear`."""

    KIND, HANDLE, ALLGATHER_LINEAR = "ring", Ring, staticmethod(allgather_linear)


class RingRowParallelLinear(OverlapRowParallelLinear):
    """``tp_overlap: ring``: :func:`~megatron_grpo.ops.layers.ring_linear.linear_reduce_scatter`."""

    KIND, HANDLE, LINEAR_REDUCE_SCATTER = "ring", Ring, staticmethod(linear_reduce_scatter)


class SymmColumnParallelLinear(OverlapColumnParallelLinear):
    """``tp_overlap: symm``: :func:`~megatron_grpo.ops.layers.symm_linear.symm_allgather_linear`."""

    KIND, HANDLE, ALLGATHER_LINEAR = "symm", SymmGroup, staticmethod(symm_allgather_linear)


class SymmRowParallelLinear(OverlapRowParallelLinear):
    """``tp_overlap: symm``: :mod:`megatron_grpo.ops.layers.symm_linear`'s linear
    reduce-scatter."""

    KIND, HANDLE = "symm", SymmGroup
    LINEAR_REDUCE_SCATTER = staticmethod(symm_linear_reduce_scatter)
