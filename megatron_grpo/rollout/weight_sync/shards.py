"""Where each parameter of a GPTModel sits in its TP=EP=1 (global) tensor, read from the model.

A :class:`SyncTensor` is one global tensor as a rank holds it: its global key and shape, the
rank's local tensor (the parameter, or for megatron-core's ``SequentialMLP`` the stack of its
local experts' parameters ``[E_local, ...]``) and the :class:`AxisShard` rules that map local to
global indices. The rules come from megatron-core's own tensor-parallel attributes
(``tensor_model_parallel``, ``partition_dim``) and module types, as its ``sharded_state_dict``
does, not from a table of names:

* TP-sharded (``tensor_model_parallel``): one contiguous block along ``partition_dim`` per TP
  rank (column-parallel rows, row-parallel columns, vocab-parallel rows, ``linear_qkv``, whose
  rank blocks are whole query groups). A gated ``linear_fc1`` (``gated_linear_unit``) holds two
  blocks per rank: its gate rows, then its up rows (megatron-core's swiglu split).
* Routed experts (``SequentialMLP`` or :class:`GroupedExperts`): the global tensor is
  ``<layer>.mlp.experts.linear_fc<n>.weight`` ``[E, ...]`` (megatron-core's checkpoint key):
  experts along axis 0 by EP rank, each expert TP-sharded over the expert-TP group.
* Everything else is replicated: the rank's copy is the global tensor.

The vocabulary rows (embedding, output layer) are padded per TP size (``padded_vocab_size``):
their global row count may differ between two layouts; rows past the shorter are padding.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.transformer.moe.experts import SequentialMLP
from torch import Tensor

from megatron_grpo.megatron.gpt import unwrap
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.moe.grouped_experts import GroupedExperts

Index = tuple[slice, ...]
EXPERT_MODULES = (SequentialMLP, GroupedExperts)


@dataclass(frozen=True)
class Coords:
    """A rank's place in each dimension a tensor can be sharded over: (rank, size) of TP,
    EP and expert-TP (``etp``)."""

    tp: tuple[int, int] = (0, 1)
    ep: tuple[int, int] = (0, 1)
    etp: tuple[int, int] = (0, 1)

    @staticmethod
    def of(model: torch.nn.Module, layout: ParallelLayout) -> Coords:
        """TP from the layout; EP and expert-TP from the model's expert modules' groups (the
        groups they were built with)."""
        ep, etp = (0, 1), (0, 1)
        for module in unwrap(model).modules():
            if isinstance(module, EXPERT_MODULES):
                ep, etp = _group_coords(module, "ep_group"), _group_coords(module, "tp_group")
                break
        return Coords((layout.tp_rank, layout.tp_size), ep, etp)


def _group_coords(module: torch.nn.Module, name: str) -> tuple[int, int]:
    group = getattr(module, name, None)
    if group is None:
        raise ValueError(
            f"weight sync: {type(module).__name__} has no {name} (megatron-core < 0.15?); the "
            "expert layout cannot be read from it"
        )
    return group.rank(), group.size()


@dataclass(frozen=True)
class AxisShard:
    """Axis ``dim`` of the local tensor is block ``rank`` of ``size`` along the global axis
    (``dim_of``: "tp", "ep" or "etp"); ``glu``: two half blocks (gate, up) instead of one."""

    dim: int
    dim_of: str
    glu: bool = False

    def pairs(self, local: int, rank: int, size: int) -> list[tuple[slice, slice]]:
        """``(local slice, global slice)`` pairs of this axis for a rank."""
        if not self.glu:
            return [(slice(0, local), slice(rank * local, (rank + 1) * local))]
        half = local // 2
        return [
            (slice(0, half), slice(rank * half, (rank + 1) * half)),
            (slice(half, local), slice((size + rank) * half, (size + rank + 1) * half)),
        ]


@dataclass(frozen=True)
class Piece:
    """A block of the local tensor (``local``) and where it lies in the global one (``glob``)."""

    local: Index
    glob: Index


@dataclass
class SyncTensor:
    """One global tensor as this rank holds it (module docstring)."""

    key: str
    params: list[Tensor]  # the live parameters: one, or a SequentialMLP layer's local experts
    stacked: bool  # params are the [E_local] slices of the local tensor (SequentialMLP)
    axes: tuple[AxisShard, ...]
    vocab: bool = False
    local_shape: tuple[int, ...] = field(init=False)
    kind: str = field(init=False)

    def __post_init__(self) -> None:
        p = self.params[0]
        self.local_shape = (len(self.params), *p.shape) if self.stacked else tuple(p.shape)
        names = {a.dim_of for a in self.axes}
        self.kind = "expert" if names & {"ep", "etp"} else ("tp" if names else "replicated")

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    def local(self) -> Tensor:
        """The local tensor ``local_shape`` (a stacked copy for SequentialMLP experts)."""
        return torch.stack(self.params) if self.stacked else self.params[0]

    def global_shape(self, coords: Coords) -> tuple[int, ...]:
        shape = list(self.local_shape)
        for a in self.axes:
            shape[a.dim] *= getattr(coords, a.dim_of)[1]
        return tuple(shape)

    def pieces(self, coords: Coords) -> list[Piece]:
        """The blocks of the local tensor of a rank at ``coords`` (any rank of the layout)."""
        per_axis = []
        for a in self.axes:
            rank, size = getattr(coords, a.dim_of)
            per_axis.append((a.dim, a.pairs(self.local_shape[a.dim], rank, size)))
        out = []
        for combo in itertools.product(*(pairs for _, pairs in per_axis)):
            local = [slice(0, n) for n in self.local_shape]
            glob = list(local)
            for (dim, _), (loc, glo) in zip(per_axis, combo, strict=True):
                local[dim], glob[dim] = loc, glo
            out.append(Piece(tuple(local), tuple(glob)))
        return out


def one_chunk(model: torch.nn.Module | list[torch.nn.Module]) -> torch.nn.Module:
    """The model chunk of ``build_model``'s list (one: no virtual pipeline stages)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(f"weight sync needs one model chunk (no VPP), got {len(model)}")
        return model[0]
    return model


def sync_tensors(model: torch.nn.Module) -> list[SyncTensor]:
    """Every parameter of the GPTModel inside ``model`` (a chunk, wrapped or not; one pipeline
    stage) as :class:`SyncTensor`, in module order; keys are unique."""
    gpt = unwrap(model)
    trained = [n for n, b in gpt.named_buffers() if n.endswith("expert_bias") and b is not None]
    if trained:  # the only buffer training changes (aux-loss-free balancing): not carried
        raise ValueError(
            f"weight sync carries parameters only, not the router buffer {trained[0]} "
            "(moe_router_enable_expert_bias)"
        )
    out: list[SyncTensor] = []
    experts: set[str] = set()
    for prefix, module in gpt.named_modules():
        if any(prefix.startswith(e + ".") for e in experts):
            continue
        dot = f"{prefix}." if prefix else ""
        if isinstance(module, EXPERT_MODULES):
            experts.add(prefix)
            out += _expert_tensors(dot, module)
            continue
        vocab = isinstance(module, VocabParallelEmbedding) or module is getattr(
            gpt, "output_layer", None
        )
        for name, p in module.named_parameters(recurse=False):
            axes = _dense_axes(module, prefix.rpartition(".")[2], name, p)
            out.append(SyncTensor(dot + name, [p], False, axes, vocab))
    keys = [t.key for t in out]
    if len(set(keys)) != len(keys):
        raise ValueError(f"weight sync: duplicate tensor keys in the model: {sorted(keys)}")
    return out


def _dense_axes(
    module: torch.nn.Module, module_name: str, name: str, p: Tensor
) -> tuple[AxisShard, ...]:
    if not getattr(p, "tensor_model_parallel", False):
        return ()
    glu = _is_glu(module, module_name, name)
    if getattr(p, "partition_stride", 1) not in (1, 2 if glu else 1):
        raise ValueError(
            f"weight sync: {type(module).__name__}.{name} has partition_stride "
            f"{p.partition_stride}; only contiguous TP blocks (stride 1) are supported"
        )
    return (AxisShard(p.partition_dim, "tp", glu),)


def _is_glu(module: torch.nn.Module, module_name: str, name: str) -> bool:
    """A gated ``linear_fc1`` keeps gate and up halves per TP rank (megatron-core's MLP
    ``sharded_state_dict`` rule: ``gated_linear_unit`` and the ``linear_fc1`` submodule)."""
    glu = bool(getattr(getattr(module, "config", None), "gated_linear_unit", False))
    return glu and module_name == "linear_fc1" and name in ("weight", "bias")


def _expert_tensors(dot: str, module: torch.nn.Module) -> list[SyncTensor]:
    """A layer's routed experts as ``<dot>linear_fc<n>.<weight|bias>`` tensors ``[E, ...]``."""
    glu = bool(module.config.gated_linear_unit)
    if isinstance(module, GroupedExperts):
        return [
            SyncTensor(
                f"{dot}linear_fc{n}.weight",
                [w],
                False,
                (AxisShard(0, "ep"), AxisShard(w.partition_dim, "etp", glu and n == 1)),
            )
            for n, w in ((1, module.weight1), (2, module.weight2))
        ]
    out = []
    first = module.local_experts[0]
    for name, p in first.named_parameters():
        params = [dict(e.named_parameters())[name] for e in module.local_experts]
        axes = [AxisShard(0, "ep")]
        if getattr(p, "tensor_model_parallel", False):
            fc1 = name.startswith("linear_fc1.") and name.rsplit(".", 1)[1] in ("weight", "bias")
            axes.append(AxisShard(p.partition_dim + 1, "etp", glu and fc1))
        out.append(SyncTensor(dot + name, params, True, tuple(axes)))
    return out
