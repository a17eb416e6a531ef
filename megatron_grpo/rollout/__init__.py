"""The rollout wing: everything that produces scored samples for the trainer.

``rollout/engine/`` generates with the Megatron policy (the KV-cached engine and the recompute
oracle, ``generate``); next to it the sources of a step's scored groups (``source.py``: the
generated and file sources, the ``RolloutSource`` protocol), partial rollouts (``partial.py``),
dynamic sampling (``dynamic_sampling.py``), reward scoring (``scoring.py``), rollout files and
batches (``files.py``, ``batch.py``), plug-in loading (``plugins.py``), evaluation
(``evaluation.py``) and the tasks (``tasks/``). The ``rollout:`` and ``evaluation:`` recipe
sections are ``config.py``'s; a component takes its section and a :class:`RolloutContext`
(``context.py``), never the trainer's root config. Nothing here imports ``megatron_grpo.train``.
"""

from __future__ import annotations

from megatron_grpo.config.lazy import lazy_getattr
from megatron_grpo.rollout.engine.options import EngineOptions
from megatron_grpo.rollout.engine.params import SamplingParams

# Imported on first use (PEP 562): the recipe's sections load without the engine's
# megatron-core imports (``python -m megatron_grpo.train --check``).
_EXPORTS = {
    "KVCacheEngine": "megatron_grpo.rollout.engine.kv_engine",
    "Generation": "megatron_grpo.rollout.engine.run_state",
    "sample": "megatron_grpo.rollout.engine.sampling",
    "generate": "megatron_grpo.rollout.engine",
}

__all__ = ["EngineOptions", "Generation", "KVCacheEngine", "SamplingParams", "generate", "sample"]


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())  # imports on first use (PEP 562)
