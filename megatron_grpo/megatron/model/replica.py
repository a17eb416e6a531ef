"""A generation replica: a TP = EP = 1 copy of the policy on each rank of a sharded run.

``rollout.colocated.weights: replica`` generates on such copies: every rank of a TP group holds
the whole model and decodes its own share of the group's samples (generation as data
parallelism over the TP ranks), instead of every rank running the same rows through its shards
(``rollout/replica.py``; the weights are gathered into it by
``rollout/weight_sync/replica_copy.py``). It is built beside the trained model, so it cannot use
megatron-core's parallel state (that holds the trainer's groups): every module is given a
``ProcessGroupCollection`` of single-rank groups instead (megatron-core >= 0.15).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import Float16Module

from megatron_grpo.megatron.config import ModelConfig, ParallelConfig, to_transformer_config
from megatron_grpo.megatron.model.build import gpt_model, use_transformer_engine
from megatron_grpo.megatron.model.layer_spec import decoder_block_spec
from megatron_grpo.megatron.moe.routing_replay import route_hooks
from megatron_grpo.megatron.parallel import cuda_compat

# every group a GPTModel's modules read from a ProcessGroupCollection (hcp: a list)
GROUP_FIELDS = (
    "tp pp mp embd pos_embd cp tp_cp ep expt_tp tp_ep tp_ep_pp tp_dp_cp dp dp_cp expt_dp "
    "intra_dp_cp intra_expt_dp"
).split()


def single_rank_groups():
    """A ``ProcessGroupCollection`` whose every group is this rank alone. A collective over the
    world (``new_subgroups`` creates every rank's group on every rank)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    one, _ = dist.new_subgroups(group_size=1)
    return ProcessGroupCollection(**dict.fromkeys(GROUP_FIELDS, one), hcp=[one])


def check_replica_support(model_cfg: ModelConfig) -> str | None:
    """Why this model cannot have a generation replica here (None: it can)."""
    if "pg_collection" not in inspect.signature(GPTModel.__init__).parameters:
        return "megatron-core < 0.15 builds models only on its parallel state (no pg_collection)"
    if use_transformer_engine(model_cfg):
        return "the replica is built from the portable spec (model.transformer_impl: local)"
    return None


def build_replica(model_cfg: ModelConfig) -> GPTModel:
    """This rank's TP = EP = PP = CP = 1 copy of ``model_cfg``'s GPTModel, unwrapped, in the
    model dtype, on the current device, its weights uninitialized (copy them in). A collective:
    every rank of the world calls it. megatron-core's token dispatcher is built as
    ``allgather`` (at EP 1 it only runs where the local dispatch does not apply, and it
    builds on any host)."""
    reason = check_replica_support(model_cfg)
    if reason is not None:
        raise ValueError(f"rollout.colocated.weights: replica: {reason}")
    # generation only: no activations kept, so no recompute ("auto" may still be unresolved)
    model_cfg = dataclasses.replace(
        model_cfg,
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        recompute_modules=None,
    )
    config = to_transformer_config(model_cfg, ParallelConfig())
    config.perform_initialization = False
    if config.num_moe_experts:
        config.moe_token_dispatcher_type = "allgather"
    groups = single_rank_groups()
    spec = decoder_block_spec(config, False, None, model_cfg.layer_kernels, groups)
    with cuda_compat():
        model = gpt_model(model_cfg, config, spec, groups=groups)
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    if config.bf16 or config.fp16:
        model = Float16Module(config, model).module  # the parameters cast as the trainer's
    if model_cfg.moe_enable_routing_replay:
        route_hooks([model])  # generation records the replica's routes
    return model.eval()
