"""``ParallelLayout``: this rank's place in the TP / SP / CP / EP / PP / DP layout, as one value.

Every process fact the package needs: sizes, ranks and groups of each dimension (DP, DP x CP and
the MoE groups included) and the roles a rank plays (:attr:`~ParallelLayout.is_logging_rank`,
:attr:`~ParallelLayout.is_replica_writer`, :attr:`~ParallelLayout.is_last_stage`, ...). Read once
from megatron-core's ``parallel_state`` after ``initialize_parallel``
(:meth:`ParallelLayout.current`), which returns it; the trainer passes it on to batching, the
evaluator, the partial rollouts, the metrics and the step. Outside the modules that build the
layout or the model nothing reads ``parallel_state`` (``tests/test_seams.py`` checks it). From a
:class:`ParallelConfig` alone for planning before any process group exists
(:meth:`ParallelLayout.of_config`: sizes, rank 0, no groups). The padding rules of packed
micro-batches live here and nowhere else:

* :attr:`ParallelLayout.token_multiple`: under sequence parallelism the decoder splits the
  packed tokens over the TP ranks, so a packed micro-batch (and each CP rank's shard of it) is
  a multiple of TP; 1 otherwise. The same number divides the SP-split activations.
* :attr:`ParallelLayout.sequence_multiple`: under context parallelism every sequence is cut
  into ``2 * CP`` load-balanced chunks, each a multiple of :attr:`token_multiple`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from operator import mul

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_grpo.megatron.config import ParallelConfig


def sequence_multiple(cp_size: int, token_multiple: int) -> int:
    """What a sequence is padded to a multiple of: under context parallelism ``2 * CP`` chunks
    of ``token_multiple`` tokens (the load-balanced CP split); without CP, ``token_multiple``."""
    return token_multiple if cp_size == 1 else 2 * cp_size * token_multiple


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes, this rank's ranks and the groups of each parallel dimension (module docstring).

    A model-parallel group (TP, CP, EP, PP, the expert tensor-and-model group) is None where its
    size is 1 (the ops read None as "no TP / no CP"). The data-parallel groups (DP, DP x CP, the
    model-parallel group of one replica) are the groups themselves at any size, since a reduce
    over None would span the world; None only in a layout without process groups (planning,
    a single process). ``*_src_rank`` / ``pp_first_rank``: global ranks (broadcast sources).
    """

    tp_size: int = 1
    tp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    sequence_parallel: bool = False
    tp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_size: int = 1
    dp_rank: int = 0
    dp_cp_size: int = 1
    dp_cp_rank: int = 0
    dp_group: dist.ProcessGroup | None = None
    dp_cp_group: dist.ProcessGroup | None = None
    mp_group: dist.ProcessGroup | None = None
    expert_tp_ep_group: dist.ProcessGroup | None = None
    tp_src_rank: int = 0
    cp_src_rank: int = 0
    pp_first_rank: int = 0

    def __post_init__(self) -> None:
        for dim in ("tp", "cp", "ep", "pp", "dp", "dp_cp"):
            size, rank = getattr(self, f"{dim}_size"), getattr(self, f"{dim}_rank")
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{dim}_size must be an int >= 1, got {size!r}")
            if not isinstance(rank, int) or not 0 <= rank < size:
                raise ValueError(f"{dim}_rank must be in [0, {dim}_size = {size}), got {rank!r}")

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """(TP, PP, CP, EP): the sizes a process group layout is built with."""
        return self.tp_size, self.pp_size, self.cp_size, self.ep_size

    @property
    def token_multiple(self) -> int:
        """Packed micro-batch lengths are multiples of this: TP under sequence parallelism
        (the tokens are split over TP ranks), else 1."""
        return self.tp_size if self.sequence_parallel else 1

    @property
    def sequence_multiple(self) -> int:
        """Under context parallelism each sequence is padded to a multiple of this
        (:func:`sequence_multiple`)."""
        return sequence_multiple(self.cp_size, self.token_multiple)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """The last pipeline stage (virtual stages aside): it holds the logits and the loss."""
        return self.pp_rank == self.pp_size - 1

    is_pipeline_last_stage = is_last_stage

    @property
    def is_logging_rank(self) -> bool:
        """The one rank that holds the loss metrics and logs: the last pipeline stage's first
        TP and DP x CP rank."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_cp_rank == 0

    @property
    def is_replica_writer(self) -> bool:
        """The one rank of each model replica (data-parallel rank) that writes its files: the
        first TP, PP and CP rank."""
        return self.tp_rank == 0 and self.pp_rank == 0 and self.cp_rank == 0

    @staticmethod
    def current(sequence_parallel: bool) -> ParallelLayout:
        """This rank's layout from megatron-core's initialized ``parallel_state``;
        ``sequence_parallel``: the model's (``TransformerConfig.sequence_parallel``)."""
        ps = parallel_state
        tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
        ep, pp = (
            ps.get_expert_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
        )
        return ParallelLayout(
            tp_size=tp,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            cp_size=cp,
            cp_rank=ps.get_context_parallel_rank(),
            ep_size=ep,
            ep_rank=ps.get_expert_model_parallel_rank(),
            pp_size=pp,
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            sequence_parallel=bool(sequence_parallel),
            tp_group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
            cp_group=ps.get_context_parallel_group() if cp > 1 else None,
            ep_group=ps.get_expert_model_parallel_group() if ep > 1 else None,
            pp_group=ps.get_pipeline_model_parallel_group() if pp > 1 else None,
            dp_size=ps.get_data_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_cp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
            dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            dp_group=ps.get_data_parallel_group(),
            dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
            mp_group=ps.get_model_parallel_group(),
            expert_tp_ep_group=ps.get_expert_tensor_and_model_parallel_group() if ep > 1 else None,
            tp_src_rank=ps.get_tensor_model_parallel_src_rank(),
            cp_src_rank=ps.get_context_parallel_global_ranks()[0],
            pp_first_rank=ps.get_pipeline_model_parallel_first_rank(),
        )

    @staticmethod
    def of_config(par: ParallelConfig) -> ParallelLayout:
        """The layout's sizes from a config alone (rank 0, no groups): for planning."""
        return ParallelLayout(
            tp_size=par.tensor_model_parallel_size,
            cp_size=par.context_parallel_size,
            ep_size=par.expert_model_parallel_size,
            pp_size=par.pipeline_model_parallel_size,
            sequence_parallel=par.sequence_parallel,
        )


# ---- the global ranks of every group, from a config alone (the dry run's layout)


def orthogonal_groups(sizes: list[int], members: list[bool]) -> list[list[int]]:
    """Rank groups of a mixed-radix layout (first dimension fastest): each group varies the
    ``members`` dimensions and fixes the others; groups and ranks in ascending order."""
    strides = [reduce(mul, sizes[:i], 1) for i in range(len(sizes))]

    def offsets(dims: list[tuple[int, int]]) -> list[int]:
        out = [0]
        for size, stride in dims:
            out = [o + i * stride for i in range(size) for o in out]
        return out

    inner = [(n, st) for n, st, m in zip(sizes, strides, members, strict=True) if m]
    outer = [(n, st) for n, st, m in zip(sizes, strides, members, strict=True) if not m]
    return [[base + o for o in offsets(inner)] for base in offsets(outer)]


ORDER = ("tp", "cp", "ep", "dp", "pp")  # Megatron's default order "tp-cp-ep-dp-pp"
DENSE_GROUPS = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",), "dp-cp": ("cp", "dp")}
EXPERT_GROUPS = {"ep": ("ep",), "etp": ("tp",), "edp": ("dp",)}


@dataclass(frozen=True)
class RankLayout:
    sizes: dict[str, int]  # tp, cp, pp, dp, ep, etp, edp
    groups: dict[str, list[list[int]]]
    verified: str


def rank_layout(par: ParallelConfig, world_size: int) -> RankLayout:
    """The global ranks of every TP / CP / DP / PP / DP-CP and EP / expert-TP / expert-DP group
    (computed arithmetically; compared with megatron-core's ``RankGenerator`` when it exists)."""
    tp, cp = par.tensor_model_parallel_size, par.context_parallel_size
    pp, ep = par.pipeline_model_parallel_size, par.expert_model_parallel_size
    etp = par.expert_tensor_size
    dp, edp = par.data_parallel_size(world_size), par.expert_data_parallel_size(world_size)
    dense = dict(tp=tp, cp=cp, ep=1, dp=dp, pp=pp)
    expert = dict(tp=etp, cp=1, ep=ep, dp=edp, pp=pp)
    groups = {}
    for table, dims in ((DENSE_GROUPS, dense), (EXPERT_GROUPS, expert)):
        for name, varying in table.items():
            sizes = [dims[d] for d in ORDER]
            groups[name] = orthogonal_groups(sizes, [d in varying for d in ORDER])
    sizes = dict(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, edp=edp)
    return RankLayout(sizes, groups, _verify(groups, dense, expert))


def _verify(groups: dict, dense: dict, expert: dict) -> str:
    try:
        RankGenerator = parallel_state.RankGenerator  # noqa: N806

        order = "-".join(ORDER)
        for table, dims in ((DENSE_GROUPS, dense), (EXPERT_GROUPS, expert)):
            gen = RankGenerator(dims["tp"], dims["ep"], dims["dp"], dims["pp"], dims["cp"], order)
            for name, varying in table.items():
                token = "-".join(d for d in ORDER if d in varying)
                if gen.get_ranks(token) != groups[name]:
                    raise RuntimeError(f"{name} groups differ from megatron's RankGenerator")
    except (AttributeError, TypeError) as e:  # older/newer megatron-core without this API
        return f"not verified against megatron-core ({type(e).__name__}: {e})"
    return "matches megatron.core.parallel_state.RankGenerator"
