"""Build megatron-core GPTModel chunks (dense or MoE) from :class:`ModelConfig`.

``build_model`` is shared by the trainer and the checkpoint converter: one builder, one set of
parameter names. It returns a list with one module per virtual pipeline stage (a one-element
list without VPP), as ``megatron.core.pipeline_parallel.get_forward_backward_func`` and
``finalize_model_grads`` expect. Each chunk is the GPTModel, wrapped in ``Float16Module`` for
bf16/fp16 parameters and in Megatron's ``DistributedDataParallel`` when ``wrap_ddp``; use
:func:`unwrap` to reach the GPTModel.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_grpo.megatron.config import (
    ModelConfig,
    ParallelConfig,
    check_parallel,
    to_transformer_config,
)
from megatron_grpo.megatron.gpt import unwrap  # noqa: F401 (model.unwrap: a public name)
from megatron_grpo.megatron.model.layer_spec import HAVE_TE, decoder_block_spec
from megatron_grpo.megatron.moe.routing_replay import route_hooks
from megatron_grpo.megatron.parallel import cuda_compat


def padded_vocab_size(model_cfg: ModelConfig, tp: int) -> int:
    """Vocab rows of the embedding/output layer: ``vocab_size`` rounded up to a multiple of
    ``make_vocab_size_divisible_by * tp`` (Megatron's rule). Rows ``>= vocab_size`` are padding:
    pass ``vocab_size=model_cfg.vocab_size`` to the log-prob op so they are never scored."""
    multiple = model_cfg.make_vocab_size_divisible_by * tp
    return math.ceil(model_cfg.vocab_size / multiple) * multiple


def use_transformer_engine(model_cfg: ModelConfig) -> bool:
    """Whether ``transformer_impl`` resolves to Transformer Engine's spec ("auto": TE when it
    imports and a GPU is present)."""
    if model_cfg.transformer_impl == "transformer_engine":
        if not HAVE_TE:
            raise ValueError("model.transformer_impl='transformer_engine' but it does not import")
        return True
    return model_cfg.transformer_impl == "auto" and HAVE_TE and torch.cuda.is_available()


def _check_parallel_state(parallel_cfg: ParallelConfig) -> None:
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("call initialize_parallel(parallel_cfg, seed) before build_model")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if (tp, pp) != (
        parallel_cfg.tensor_model_parallel_size,
        parallel_cfg.pipeline_model_parallel_size,
    ):
        raise ValueError(
            f"parallel config (TP={parallel_cfg.tensor_model_parallel_size}, "
            f"PP={parallel_cfg.pipeline_model_parallel_size}) differs from the initialized "
            f"parallel_state (TP={tp}, PP={pp})"
        )


def build_gpt_chunk(
    model_cfg: ModelConfig, config: TransformerConfig, vp_stage: int | None
) -> GPTModel:
    """One GPTModel for this rank's pipeline (and virtual) stage, not wrapped."""
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    spec = decoder_block_spec(
        config, use_transformer_engine(model_cfg), vp_stage, model_cfg.layer_kernels
    )
    return gpt_model(model_cfg, config, spec, pre=pre, post=post, vp_stage=vp_stage)


def gpt_model(
    model_cfg: ModelConfig,
    config: TransformerConfig,
    spec,
    *,
    pre: bool = True,
    post: bool = True,
    vp_stage: int | None = None,
    groups=None,
) -> GPTModel:
    """The GPTModel of ``model_cfg`` with ``config`` and the decoder ``spec`` (the one place
    its fields are passed): ``pre`` / ``post``: it holds the embedding / the output layer;
    ``groups``: its own ``ProcessGroupCollection`` (None: megatron-core's parallel state)."""
    own = {} if groups is None else {"pg_collection": groups}  # megatron-core < 0.15: none
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(model_cfg, config.tensor_model_parallel_size),
        max_sequence_length=model_cfg.max_sequence_length,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=model_cfg.share_embeddings_and_output_weights,
        position_embedding_type=model_cfg.position_embedding_type,
        rotary_percent=model_cfg.rotary_percent,
        rotary_base=model_cfg.rotary_base,
        rope_scaling=model_cfg.rope_scaling,
        rope_scaling_factor=model_cfg.rope_scaling_factor,
        vp_stage=vp_stage,
        **own,
    )
    model.model_type = ModelType.encoder_or_decoder
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    return model


def build_model(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    *,
    wrap_ddp: bool = True,
    use_distributed_optimizer: bool = False,
    overlap_param_gather: bool = False,
    transformer_config: TransformerConfig | None = None,
) -> list[torch.nn.Module]:
    """Build this rank's model chunks after :func:`initialize_parallel`.

    Args:
        model_cfg, parallel_cfg: the architecture and the layout (checked against each other and
            against the initialized parallel_state).
        wrap_ddp: wrap each chunk in Megatron's ``DistributedDataParallel`` (needed for training
            with ``finalize_model_grads`` / Megatron optimizers; frozen reference models and
            converters pass False).
        use_distributed_optimizer: forwarded to the DDP config (ZeRO-1 style buffers).
        overlap_param_gather: forwarded to the DDP config (with the distributed optimizer: the
            updated parameters gathered by forward pre-hooks, module by module, overlapping
            the forward; the CUDA-graphed passes wait for all of them first).
        transformer_config: a prebuilt TransformerConfig to use instead of
            ``to_transformer_config(model_cfg, parallel_cfg)`` (for extra Megatron fields).

    Returns:
        One module per virtual pipeline stage. Parameters are on the current CUDA device (or
        CPU), in ``model_cfg.torch_dtype()``: float32 on CPU, bfloat16 on GPU by default.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_parallel(model_cfg, parallel_cfg, world)
    _check_parallel_state(parallel_cfg)
    config = transformer_config or to_transformer_config(model_cfg, parallel_cfg)
    vpp = parallel_cfg.virtual_pipeline_model_parallel_size
    stages = [None] if vpp is None else list(range(vpp))
    with cuda_compat():
        chunks: list[torch.nn.Module] = [build_gpt_chunk(model_cfg, config, s) for s in stages]
    if torch.cuda.is_available():
        chunks = [c.cuda(torch.cuda.current_device()) for c in chunks]
    if config.bf16 or config.fp16:
        chunks = [Float16Module(config, c) for c in chunks]
    if model_cfg.moe_enable_routing_replay:
        route_hooks(chunks)  # install the routers' replay hooks now: unsupported setups fail here
    if not wrap_ddp:
        return chunks
    _wire_grad_finalization(config, parallel_cfg)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=parallel_cfg.grad_reduce_in_fp32,
        overlap_grad_reduce=parallel_cfg.overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_param_gather=overlap_param_gather,
    )
    chunks = [
        # Bucketing only for the first chunk, as Megatron-LM does for VPP.
        DistributedDataParallel(config, ddp_config, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]
    config.no_sync_func = [c.no_sync for c in chunks]
    if parallel_cfg.overlap_grad_reduce:
        config.grad_sync_func = [c.start_grad_sync for c in chunks]
    if len(chunks) == 1:
        config.no_sync_func = config.no_sync_func[0]
        config.grad_sync_func = config.grad_sync_func and config.grad_sync_func[0]
    return chunks


def _wire_grad_finalization(config: TransformerConfig, parallel_cfg: ParallelConfig) -> None:
    """Let the schedules call ``finalize_model_grads`` (DP/SP/embedding all-reduces and the
    division by the global token count of ``calculate_per_token_loss``), as Megatron-LM does."""
    config.finalize_model_grads_func = finalize_model_grads
