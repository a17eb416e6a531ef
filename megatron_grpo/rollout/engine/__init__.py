"""Generation over the Megatron policy: a KV-cached engine and the recompute oracle.

``generate(model, prompts, params, generator, *, engine="kv_cache")`` samples one response per
prompt from an unwrapped GPTModel (PP = CP = 1) and returns a :class:`Generation`: response
ids (ending in a stop id unless cut at ``max_new_tokens``), the recorded log-prob of each
response token, ``log_softmax(logits / temperature)[token]`` in fp32 over the real vocabulary,
and ``routes``: with ``record_routes=True`` (MoE routing replay) per sample the routes of its
tokens, int64 ``[P + R, L, k]`` (``megatron_grpo.rollout.engine.routes``), else None.
``generator`` is a CPU generator seeded identically on every TP rank of the group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_grpo.config.lazy import lazy_getattr
from megatron_grpo.rollout.engine.options import EngineOptions
from megatron_grpo.rollout.engine.params import SamplingParams

if TYPE_CHECKING:
    import torch

    from megatron_grpo.rollout.engine.kv_engine import KVCacheEngine
    from megatron_grpo.rollout.engine.run_state import Generation

# Imported on first use (PEP 562): the recipe's sections (EngineOptions, SamplingParams) load
# without the engine's megatron-core imports (``python -m megatron_grpo.train --check``).
_EXPORTS = {
    "KVCacheEngine": "megatron_grpo.rollout.engine.kv_engine",
    "Generation": "megatron_grpo.rollout.engine.run_state",
    "sample": "megatron_grpo.rollout.engine.sampling",
}

__all__ = ["EngineOptions", "Generation", "KVCacheEngine", "SamplingParams", "generate", "sample"]

ENGINES = ("kv_cache", "recompute")


def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    generator: torch.Generator,
    *,
    engine: str | KVCacheEngine = "kv_cache",
    record_routes: bool = False,
    limits: list[int | None] | None = None,
) -> Generation:
    """Sample a response for each prompt (the model is in eval mode while sampling).

    ``engine``: ``"kv_cache"`` (a one-off :class:`KVCacheEngine`; pass an engine instance to
    reuse its CUDA graphs across calls, or another engine built for ``model`` with the same
    ``generate``, e.g. ``rollout.replica.ReplicaEngine``) or ``"recompute"`` (no cache: the
    test oracle).
    ``record_routes``: also record the routes of each sample (MoE only). ``limits``: per
    sample its own response limit (None: ``params.max_new_tokens``)."""
    import torch

    from megatron_grpo.megatron.layout import ParallelLayout
    from megatron_grpo.rollout.engine import model_io
    from megatron_grpo.rollout.engine.kv_engine import KVCacheEngine
    from megatron_grpo.rollout.engine.recompute import generate_recompute
    from megatron_grpo.rollout.engine.routes import RouteLog, recording
    from megatron_grpo.rollout.engine.run_state import Generation

    if not isinstance(engine, str):  # a KVCacheEngine, or an engine with its generate
        if engine.model is not model:
            name = type(engine).__name__
            raise ValueError(f"the {name} passed as engine was built for another model")
        return engine.generate(prompts, params, generator, record_routes, limits)
    if engine == "kv_cache":
        return KVCacheEngine(model).generate(prompts, params, generator, record_routes, limits)
    if engine != "recompute":
        raise ValueError(f"engine must be one of {ENGINES} or a KVCacheEngine, got {engine!r}")
    model_io.check_layout(ParallelLayout.current(model.config.sequence_parallel))
    model_io.check_prompts(prompts, params, model.max_sequence_length)
    uniforms = torch.rand(len(prompts), params.max_new_tokens, generator=generator)
    routes = RouteLog(model, prompts, params.max_new_tokens) if record_routes else None
    was_training = model.training
    model.eval()
    try:
        with recording(routes):
            responses, logprobs = generate_recompute(
                model, prompts, params, uniforms, routes, limits
            )
    finally:
        model.train(was_training)
    return Generation.of(responses, logprobs, routes)


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())  # imports on first use (PEP 562)
