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

from __future__ import annotations

from megatron_grpo.config.lazy import lazy_getattr

_EXPORTS = {
    "PackedBatch": "megatron_grpo.megatron.batch.packing",
    "pack_sequences": "megatron_grpo.megatron.batch.packing",
    "packed_seq_params": "megatron_grpo.megatron.batch.packing",
    "split_for_context_parallel": "megatron_grpo.megatron.batch.packing",
    "thd_partition_index": "megatron_grpo.megatron.batch.packing",
    "ModelConfig": "megatron_grpo.megatron.config",
    "ParallelConfig": "megatron_grpo.megatron.config",
    "check_parallel": "megatron_grpo.megatron.config",
    "to_transformer_config": "megatron_grpo.megatron.config",
    "check_training_config": "megatron_grpo.megatron.gpt",
    "hidden_states_only": "megatron_grpo.megatron.gpt",
    "output_weight": "megatron_grpo.megatron.gpt",
    "unwrap": "megatron_grpo.megatron.gpt",
    "ParallelLayout": "megatron_grpo.megatron.layout",
    "build_model": "megatron_grpo.megatron.model.build",
    "padded_vocab_size": "megatron_grpo.megatron.model.build",
    "decoder_block_spec": "megatron_grpo.megatron.model.layer_spec",
    "portable_layer_spec": "megatron_grpo.megatron.model.layer_spec",
    "cuda_compat": "megatron_grpo.megatron.parallel",
    "destroy_parallel": "megatron_grpo.megatron.parallel",
    "initialize_parallel": "megatron_grpo.megatron.parallel",
    "seed_everything": "megatron_grpo.megatron.parallel",
    "GRPOStep": "megatron_grpo.megatron.step.forward",
    "get_forward_backward_func": "megatron_grpo.megatron.step.forward",
}

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


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())  # imports on first use (PEP 562)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
