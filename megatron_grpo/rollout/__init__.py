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

from megatron_grpo.rollout.engine import (
    EngineOptions,
    Generation,
    KVCacheEngine,
    SamplingParams,
    generate,
    sample,
)

__all__ = ["EngineOptions", "Generation", "KVCacheEngine", "SamplingParams", "generate", "sample"]
