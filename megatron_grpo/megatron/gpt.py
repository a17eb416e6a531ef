"""Access to a built GPTModel: unwrapping, its output weight, hidden states instead of logits,
and the checks of the config that ``GRPOStep``'s gradients rely on.

Imports nothing else of this package, so every module (``model``, ``routing_replay``, the
step, the rollout engines) can use it without an import circle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt import GPTModel
from torch import Tensor


def unwrap(module: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not isinstance(module, GPTModel):
        if not hasattr(module, "module"):
            raise TypeError(f"no GPTModel inside {type(module).__name__}")
        module = module.module
    return module


@contextlib.contextmanager
def hidden_states_only(gpt: GPTModel) -> Iterator[None]:
    """Make GPTModel.forward return the decoder's final-normed hidden states ``[s, b, H]``
    instead of logits: its ``_postprocess`` returns early when ``post_process`` is False (the
    decoder keeps its final layernorm, chosen at construction). Works on megatron-core
    0.14..0.16, where ``GPTModel`` has no hidden-state output option."""
    saved = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = saved


def output_weight(gpt: GPTModel) -> Tensor:
    """``[V_local, H]`` output-layer weight of the last stage (the embedding when tied)."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def check_training_config(model: torch.nn.Module) -> None:
    """Raise naming the field when ``model`` (a chunk as the schedule passes it) is not set up
    the way :meth:`GRPOStep.forward_step`'s gradients rely on. ``build_model`` does all of it."""
    config = unwrap(model).config
    if not getattr(config, "calculate_per_token_loss", False):
        raise ValueError(
            "GRPOStep: the model's TransformerConfig.calculate_per_token_loss must be True: the "
            "loss is a token sum that Megatron divides by the global token count; without it "
            "gradients and the reported loss are wrong. Set config.calculate_per_token_loss = "
            "True before wrapping the model in DistributedDataParallel (build_model does)"
        )
    if torch.is_grad_enabled() and getattr(config, "finalize_model_grads_func", None) is None:
        raise ValueError(
            "GRPOStep: the model's TransformerConfig.finalize_model_grads_func is None, so "
            "nothing divides the gradients by the global token count (they come out that many "
            "times too large) or reduces them over data-parallel ranks. Set "
            "config.finalize_model_grads_func = megatron.core.distributed.finalize_model_grads "
            "(build_model does)"
        )
    for buffer in _grad_buffers(model):
        if buffer.gradient_scaling_factor != 1.0:
            raise ValueError(
                "GRPOStep: DistributedDataParallel was built while calculate_per_token_loss was "
                f"False, so it also scales gradients by {buffer.gradient_scaling_factor}; set "
                "calculate_per_token_loss = True before wrapping the model"
            )


def _grad_buffers(model: torch.nn.Module) -> list:
    """The DDP wrapper's gradient buffers (dense and expert), empty for an unwrapped model."""
    while not isinstance(model, DistributedDataParallel) and hasattr(model, "module"):
        model = model.module
    if not isinstance(model, DistributedDataParallel):
        return []
    return list(model.buffers) + list(model.expert_parallel_buffers)
