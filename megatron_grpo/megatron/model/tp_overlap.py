"""Tensor-parallel linear layers of the portable spec with their sequence-parallel collective
overlapped with the GEMM (``LayerKernels.tp_overlap``, ``model.layer_kernels.tp_overlap``).

* :class:`RingColumnParallelLinear` / :class:`RingRowParallelLinear`: megatron-core's
  ``ColumnParallelLinear`` / ``RowParallelLinear`` (same parameters, attributes, init,
  ``sharded_state_dict`` and checkpoint keys, so DDP, the optimizer and checkpoints see
  megatron-core's layers) whose forward, where sequence parallelism is on at TP > 1, runs the
  ring collective-matmul of :mod:`megatron_grpo.ops.layers.ring_linear`: the column layer's
  all-gather and the row layer's reduce-scatter (and their backward collectives) travel chunk by
  chunk while the other chunks' GEMMs run. The ring applies to sequence parallelism: without it
  (SP off, TP 1, expert layers with their own communication, SP switched off for generation by
  ``set_model_to_sequence_parallel``) the layer IS megatron-core's and runs its forward.
* :func:`resolve_tp_overlap`: THE decision of what ``auto`` means; :func:`tp_linear_classes`:
  the (column, row) classes the spec builds.

``auto`` = ``ring`` where it has something to hide (SP on, TP > 1) on CUDA, where NCCL runs the
P2P transfers on its own stream beside the GEMMs; ``off`` elsewhere (on CPU/gloo the ring only
adds steps). The GPU speed-up is not measured yet (``tools/bench_tp_overlap.py``).

Not supported with ``ring`` (an error when the layer is built, naming the field):
``gradient_accumulation_fusion`` (megatron-core's APEX kernel accumulating into
``weight.main_grad``; the ring returns ``weight.grad`` like megatron-core without the fusion)
and, for the column layer, ``defer_embedding_wgrad_compute`` (the output layer's deferral).
Like megatron-core's frozen-weight path, a column layer whose weight does not require grad gives
its bias no gradient either. Transformer Engine's spec has its own overlap
(``tp_comm_overlap``, userbuffers); an explicit ``ring`` there is an error.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from megatron_grpo.ops.kernels import check_choice
from megatron_grpo.ops.layers.ring_linear import Ring, allgather_linear, linear_reduce_scatter

__all__ = [
    "RingColumnParallelLinear",
    "RingRowParallelLinear",
    "resolve_tp_overlap",
    "tp_linear_classes",
]

FIELD = "model.layer_kernels.tp_overlap"


# "auto" takes the ring only once a GPU run of tools/bench_tp_overlap.py shows it ahead of
# megatron-core's collectives (NCCL's P2P kernels and the GEMMs share the SMs); until then it is
# opt-in, as TP overlap is in Megatron-LM (--tp-comm-overlap) and torchtitan (async TP).
RING_MEASURED_AHEAD = False


def resolve_tp_overlap(choice: str, sequence_parallel: bool, tp_size: int, device_type: str) -> str:
    """ "ring" or "off": what ``choice`` (``CHOICES["tp_overlap"]``) means for a model with
    ``sequence_parallel`` at ``tp_size`` on ``device_type``. ``auto``: off (the ring is opt-in
    until measured ahead on GPU: ``RING_MEASURED_AHEAD``; then ring with SP at TP > 1 on CUDA).
    An explicit ``ring`` stays ring (the layers run megatron-core's forward wherever SP is
    off)."""
    check_choice("tp_overlap", choice, FIELD)
    if choice != "auto":
        return choice
    could = sequence_parallel and tp_size > 1 and device_type == "cuda"
    return "ring" if could and RING_MEASURED_AHEAD else "off"


def tp_linear_classes(choice: str, config, use_te: bool = False) -> tuple[type, type]:
    """(column, row) linear classes of the spec for ``choice``: megatron-core's for ``off``,
    the ring layers for ``ring``. ``use_te``: Transformer Engine's spec, where only ``auto``
    (TE's own layers) is valid."""
    if use_te:
        if check_choice("tp_overlap", choice, FIELD) != "auto":
            raise ValueError(
                f"{FIELD}={choice!r} is the portable spec's; Transformer Engine's spec overlaps "
                "through its own tp_comm_overlap (userbuffers): leave it 'auto'"
            )
        return ColumnParallelLinear, RowParallelLinear
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tp = config.tensor_model_parallel_size
    if resolve_tp_overlap(choice, config.sequence_parallel, tp, device) == "off":
        return ColumnParallelLinear, RowParallelLinear
    return RingColumnParallelLinear, RingRowParallelLinear


def _refuse_unsupported(config, layer: str, names: tuple[str, ...]) -> None:
    """A clear error where ``config`` enables one of ``names`` the ring does not run with."""
    for name in names:
        if getattr(config, name, False):
            raise ValueError(
                f"{FIELD}='ring' ({layer}) does not run with config.{name}=True: "
                f"turn one of them off"
            )


class _RingMixin:
    """What the two ring layers share: whether the ring applies now (building the ring over the
    layer's ``tp_group`` the first time) and megatron-core's offloading mark."""

    def _ring_applies(self) -> bool:
        """SP on (now: generation switches it off) at TP > 1, and not an expert layer that
        communicates on its own: else the layer is megatron-core's."""
        if not self.sequence_parallel or self.explicit_expert_comm:
            return False
        if self._ring is None:
            self._ring = Ring(self.tp_group)
        return self._ring.size > 1

    def _mark_offloading(self, x: torch.Tensor) -> None:
        """megatron-core's CPU activation offloading mark (Transformer Engine's contexts)."""
        ctx = getattr(self.config, "_cpu_offloading_context", None)
        if ctx is not None and ctx.inside_context is True:
            x.activation_offloading = self.config.cpu_offloading_activations


class RingColumnParallelLinear(_RingMixin, ColumnParallelLinear):
    """megatron-core's ``ColumnParallelLinear`` whose SP forward is :func:`allgather_linear`:
    ``input_ [s_l, b, h] -> (output [s, b, o_l], bias [o_l] | None)`` (``[s, b, o]`` with
    ``gather_output``), the all-gather overlapped with the chunk GEMMs and, in backward, the
    input gradient's reduce-scatter with the ``d_x`` GEMMs."""

    def __init__(self, *args, config, **kwargs) -> None:
        names = ("gradient_accumulation_fusion", "defer_embedding_wgrad_compute")
        _refuse_unsupported(config, type(self).__name__, names)  # before megatron-core's checks
        super().__init__(*args, config=config, **kwargs)
        self._ring: Ring | None = None  # built at the first ring forward (megatron's tp_group)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if not self._ring_applies():
            return super().forward(input_, weight, runtime_gather_output)
        weight = self._checked_weight(weight)
        self._mark_offloading(input_)
        bias = None if self.skip_bias_add else self.bias
        if bias is not None and not weight.requires_grad:
            bias = bias.detach()  # megatron-core's frozen-weight path gives the bias no gradient
        output = allgather_linear(input_, weight, bias, self._ring)
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


class RingRowParallelLinear(_RingMixin, RowParallelLinear):
    """megatron-core's ``RowParallelLinear`` whose SP forward is :func:`linear_reduce_scatter`:
    ``input_ [s, b, h_l] -> (output [s_l, b, o], bias [o] | None)``, the reduce-scatter a ring
    of partial sums overlapped with the chunk GEMMs and, in backward, the output gradient's
    all-gather with the ``d_x`` GEMMs. The bias is added after the reduce-scatter, as
    megatron-core does (or returned with ``skip_bias_add``)."""

    def __init__(self, *args, config, **kwargs) -> None:
        names = ("gradient_accumulation_fusion",)
        _refuse_unsupported(config, type(self).__name__, names)  # before megatron-core's checks
        super().__init__(*args, config=config, **kwargs)
        self._ring: Ring | None = None  # built at the first ring forward (megatron's tp_group)

    def forward(self, input_):
        if not self._ring_applies():
            return super().forward(input_)
        self._mark_offloading(input_)
        output = linear_reduce_scatter(input_, self.weight, self._ring)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None
