"""The portable spec's MoE experts: every local expert of a layer in two grouped GEMMs.

megatron-core without Transformer Engine builds ``SequentialMLP`` for the experts: a Python loop
over the local experts, three GEMMs each, in every layer, micro-batch, backward and decode step
(launch-bound: ~0.3 ms per expert on an H200 whatever the token count). :class:`GroupedExperts`
is its drop-in (same constructor, forward contract and checkpoint): the local experts' weights
are two stacked parameters and the forward is

    h = grouped_mm(x, weight1, ends)         # [M, 2F/ETP]  gate and up halves, as linear_fc1
    h = swiglu(h) * probs                    # [M, F/ETP]   megatron-core's order and roundings
    y = grouped_mm(h, weight2, ends)         # [M, H]       partial sums over expert-TP ranks

on the rows the token dispatcher permuted (sorted by local expert; ``ends`` their cumulative
counts). As in megatron-core's expert MLPs, no communication happens here: the dispatcher
gathers the tokens and reduces the expert-TP partial sums (and orders them by local expert with
one gather: ``moe.permute``, installed with the first GroupedExperts). ``gemm_impl`` picks the
grouped GEMM (``ops.layers.grouped_mm``), ``impl`` the SwiGLU kernel: ``LayerKernels``'
``grouped_gemm`` and ``elementwise``, given by the layer spec.

Checkpoints: :meth:`sharded_state_dict` writes exactly SequentialMLP's tensors (keys, global
shapes, expert and TP offsets, swiglu halves, replica ids: ``expert_checkpoint``), so
torch_dist checkpoints move between the two layouts in both directions, and plain state dicts
of SequentialMLP (``local_experts.<e>.linear_fc<n>.weight``) load into the stacked parameters.
"""

from __future__ import annotations

import re
from copy import deepcopy

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.megatron.compat import use_index_chunk_sort
from megatron_grpo.megatron.moe.expert_checkpoint import (
    ExpertShards,
    expert_extra_states,
    stacked_expert_factory,
)
from megatron_grpo.megatron.moe.permute import sort_chunks_by_index
from megatron_grpo.ops.kernels import check_choice
from megatron_grpo.ops.layers.grouped_mm import grouped_mm
from megatron_grpo.ops.layers.swiglu import swiglu

_LEGACY_KEY = re.compile(r"local_experts\.(\d+)\.linear_fc([12])\.(weight|_extra_state)")


def grouped_experts_unsupported(config: TransformerConfig) -> str | None:
    """Why :class:`GroupedExperts` cannot compute this config's experts, or None. It computes
    bias-free SwiGLU (Qwen3-MoE, Mixtral, DeepSeek) or a plain activation, in bf16/fp16/fp32."""
    checks = (
        (config.add_bias_linear, "model.add_bias_linear (expert biases)"),
        (
            config.gated_linear_unit and config.activation_func is not F.silu,
            "a GLU other than SwiGLU",
        ),
        (getattr(config, "activation_func_clamp_value", None) is not None, "activation clamping"),
        (getattr(config, "glu_linear_offset", 0.0) != 0.0, "glu_linear_offset"),
        (config.fp8 is not None or getattr(config, "fp4", None) is not None, "FP8 / FP4 experts"),
        (getattr(config, "delay_wgrad_compute", False), "delay_wgrad_compute"),
    )
    found = [what for bad, what in checks if bad]
    return ", ".join(found) or None


def _expert_groups(pg_collection, expert_groups: tuple | None) -> tuple:
    """(expert-TP, EP, expert-DP) groups: the layer's collection (megatron-core >= 0.15), else
    the ones the layer spec gives (older versions pass no collection)."""
    if pg_collection is not None and hasattr(pg_collection, "expt_tp"):
        return pg_collection.expt_tp, pg_collection.ep, pg_collection.expt_dp
    if expert_groups is None:
        raise ValueError("GroupedExperts needs its expert groups (pg_collection or expert_groups)")
    return expert_groups


class GroupedExperts(MegatronModule):
    """All local experts of an MoE layer as grouped GEMMs; drop-in for ``SequentialMLP``.

    Parameters: ``weight1 [E_local, 2F/ETP, H]`` (each expert's ``linear_fc1.weight``: its
    gate rows, then its up rows) and ``weight2 [E_local, H, F/ETP]`` (``linear_fc2.weight``).
    ``gemm_impl`` / ``impl``: the grouped GEMM and the SwiGLU kernel (``LayerKernels``);
    ``expert_groups``: (expert-TP, EP, expert-DP) where megatron-core passes no collection.
    """

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules=None,
        pg_collection=None,
        name: str | None = None,
        gemm_impl: str = "auto",
        impl: str = "auto",
        expert_groups: tuple | None = None,
    ) -> None:
        why = grouped_experts_unsupported(config)
        if why:
            raise ValueError(
                f"grouped MoE experts do not support {why}: set model.moe_grouped_gemm=false "
                "(megatron-core's SequentialMLP)"
            )
        if config.moe_ffn_hidden_size != config.ffn_hidden_size:  # as SequentialMLP does
            config = deepcopy(config)
            config.ffn_hidden_size = config.moe_ffn_hidden_size
        super().__init__(config=config)
        self.num_local_experts = num_local_experts
        self.gemm_impl = check_choice("grouped_gemm", gemm_impl, "GroupedExperts gemm_impl")
        self.impl = check_choice("impl", impl, "GroupedExperts impl")  # its SwiGLU
        groups = _expert_groups(pg_collection, expert_groups)
        self.tp_group, self.ep_group, self.dp_group = groups
        etp = self.tp_group.size()
        if config.moe_ffn_hidden_size % etp:
            raise ValueError(
                f"model.moe_ffn_hidden_size={config.moe_ffn_hidden_size} is not divisible by "
                f"parallel.expert_tensor_parallel_size={etp}"
            )
        ffn = config.moe_ffn_hidden_size // etp
        fc1_rows = 2 * ffn if config.gated_linear_unit else ffn
        self.weight1 = self._weight((num_local_experts, fc1_rows, config.hidden_size), 1)
        self.weight2 = self._weight((num_local_experts, config.hidden_size, ffn), 2)
        self._initialize()
        self._register_load_state_dict_pre_hook(_stack_legacy_keys, with_module=True)
        use_index_chunk_sort(sort_chunks_by_index)  # the dispatcher's split + cat, one gather

    def _weight(self, shape: tuple[int, int, int], partition_dim: int) -> torch.nn.Parameter:
        cfg = self.config
        # as megatron-core's linear layers: CPU initialization follows the default device
        # (meta under ``with torch.device("meta")``), else the current GPU
        device = None if cfg.use_cpu_initialization else torch.cuda.current_device()
        w = torch.nn.Parameter(torch.empty(shape, dtype=cfg.params_dtype, device=device))
        # megatron-core's expert linear layers' attributes: TP-sharded (norms count it on every
        # TP rank) along the per-expert dim, and expert-DP reduced when experts are EP-sharded
        w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, partition_dim, 1
        w.allreduce = not cfg.expert_model_parallel_size > 1
        return w

    def _initialize(self) -> None:
        """The values SequentialMLP's experts get from the same seed: expert by expert, fc1 then
        fc2, through megatron-core's CPU (a full master weight from the global generator, this
        expert-TP rank's stride chunks kept) or GPU (the expert-parallel RNG stream) path. A
        loop over the experts, at construction only."""
        cfg = self.config
        if not cfg.perform_initialization or self.weight1.device.type == "meta":
            return
        glu, ffn, hidden = cfg.gated_linear_unit, cfg.moe_ffn_hidden_size, cfg.hidden_size
        fc1 = ((2 if glu else 1) * ffn, hidden, cfg.init_method, 0, 2 if glu else 1)
        fc2 = (hidden, ffn, cfg.output_layer_init_method, 1, 1)
        for e in range(self.num_local_experts):
            for weight, (rows, cols, init, dim, stride) in (
                (self.weight1, fc1),
                (self.weight2, fc2),
            ):
                if cfg.use_cpu_initialization:
                    weight.data[e].copy_(self._cpu_shard(rows, cols, init, dim, stride))
                else:
                    with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                        init(weight.data[e])

    def _cpu_shard(self, rows: int, cols: int, init, dim: int, stride: int) -> torch.Tensor:
        """megatron-core's ``_initialize_affine_weight_cpu``: the full ``[rows, cols]`` master
        weight initialized in fp32, cast, cut in ``stride`` chunks per expert-TP rank."""
        master = torch.empty(rows, cols, dtype=torch.float)
        init(master)
        master = master.to(self.config.params_dtype)
        size = (rows if dim == 0 else cols) // self.tp_group.size() // stride
        chunks = torch.split(master, size, dim=dim)[self.tp_group.rank() :: self.tp_group.size()]
        return torch.cat(chunks, dim=dim)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """``[M, H]`` rows sorted by local expert, ``tokens_per_expert [E_local]`` (host or
        device), ``permuted_probs [M]`` -> (``[M, H]`` partial over expert-TP, no bias)."""
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # top-1 only (megatron-core checks it)
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = None
        ends = torch.cumsum(host_to_device(tokens_per_expert, x.device), 0)
        h = grouped_mm(x, self.weight1, ends, impl=self.gemm_impl)
        if self.config.gated_linear_unit:  # scaled by the probs in the same kernel
            h = swiglu(h, impl=self.impl, probs=probs)
        else:
            h = self.config.activation_func(h)
            if probs is not None:  # megatron-core's MLP: scale in the probs' dtype, round
                h = (h * probs.unsqueeze(-1)).to(h.dtype)
        return grouped_mm(h, self.weight2, ends, impl=self.gemm_impl), None

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """SequentialMLP's checkpoint tensors, built from the stacked weights on save and
        stacked back on load (``expert_checkpoint``)."""
        shards = ExpertShards(
            num_local=self.num_local_experts,
            ep_rank=self.ep_group.rank(),
            ep_size=self.ep_group.size(),
            tp_rank=self.tp_group.rank(),
            tp_size=self.tp_group.size(),
            dp_rank=self.dp_group.rank(),
            singleton=bool((metadata or {}).get("singleton_local_shards", False)),
        )
        glu = self.config.gated_linear_unit
        return {
            **expert_extra_states(prefix, shards, sharded_offsets),
            f"{prefix}weight1": stacked_expert_factory(
                f"{prefix}experts.linear_fc1.weight",
                self.weight1,
                shards,
                sharded_offsets,
                tp_axis=0,
                glu=glu,
            ),
            f"{prefix}weight2": stacked_expert_factory(
                f"{prefix}experts.linear_fc2.weight",
                self.weight2,
                shards,
                sharded_offsets,
                tp_axis=1,
                glu=False,
            ),
        }

    def backward_dw(self) -> None:
        raise RuntimeError("GroupedExperts computes weight gradients in backward (no delay)")


def _stack_legacy_keys(module, state_dict, prefix, *args, **kwargs) -> None:
    """Load hook: SequentialMLP's ``local_experts.<e>.linear_fc<n>.weight`` entries become
    the stacked ``weight<n>`` (a plain state dict written before grouped experts)."""
    found: dict[str, dict[int, torch.Tensor]] = {"1": {}, "2": {}}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        match = _LEGACY_KEY.fullmatch(key[len(prefix) :])
        if match and match.group(3) == "_extra_state":
            state_dict.pop(key)  # megatron-core's local linear layers keep none
        elif match:
            found[match.group(2)][int(match.group(1))] = state_dict.pop(key)
    for n, experts in found.items():
        if experts:
            if sorted(experts) != list(range(module.num_local_experts)):
                raise KeyError(
                    f"{prefix}local_experts: expected experts 0..{module.num_local_experts - 1} "
                    f"of linear_fc{n}, got {sorted(experts)}"
                )
            state_dict[f"{prefix}weight{n}"] = torch.stack([experts[e] for e in sorted(experts)])
