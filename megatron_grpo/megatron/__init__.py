"""Megatron-Core integration: config, model builder, portable layer spec, packed batches and
the GRPO ``forward_step`` for Megatron's pipeline schedules.

Typical use (see docs/megatron_usage.md)::

    layout = initialize_parallel(parallel_cfg, seed=1234)
    chunks = build_model(model_cfg, parallel_cfg)
    step = GRPOStep(loss_cfg, vocab_size=model_cfg.vocab_size, layout=layout)
    get_forward_backward_func()(forward_step_func=step.forward_step, ...)

Your own GPTModel: ``decoder_block_spec(config, use_te=False)`` (or ``portable_layer_spec`` per
layer) is the portable spec, which takes packed batches without Transformer Engine.
"""

from megatron_grpo.megatron.batch.packing import (
    PackedBatch,
    pack_sequences,
    packed_seq_params,
    split_for_context_parallel,
    thd_partition_index,
)
from megatron_grpo.megatron.config import (
    ModelConfig,
    ParallelConfig,
    check_parallel,
    to_transformer_config,
)
from megatron_grpo.megatron.gpt import (
    check_training_config,
    hidden_states_only,
    output_weight,
    unwrap,
)
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.model.build import build_model, padded_vocab_size
from megatron_grpo.megatron.model.layer_spec import decoder_block_spec, portable_layer_spec
from megatron_grpo.megatron.parallel import (
    cuda_compat,
    destroy_parallel,
    initialize_parallel,
    seed_everything,
)
from megatron_grpo.megatron.step.forward import GRPOStep, get_forward_backward_func

__all__ = [
    "GRPOStep",
    "ModelConfig",
    "PackedBatch",
    "ParallelConfig",
    "ParallelLayout",
    "build_model",
    "check_parallel",
    "check_training_config",
    "cuda_compat",
    "decoder_block_spec",
    "destroy_parallel",
    "get_forward_backward_func",
    "hidden_states_only",
    "initialize_parallel",
    "output_weight",
    "pack_sequences",
    "packed_seq_params",
    "padded_vocab_size",
    "portable_layer_spec",
    "seed_everything",
    "split_for_context_parallel",
    "thd_partition_index",
    "to_transformer_config",
    "unwrap",
]
