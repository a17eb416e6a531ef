"""The model: config sections (:mod:`.config`), the layer spec (:mod:`.layer_spec`), building
GPTModel chunks (:mod:`.build`), access to a built model (:mod:`.gpt`) and every write to
megatron-core's private state (:mod:`.compat`).

``from megatron_grpo.megatron.model import build_model`` (the documented path of the builder)
keeps working: the builder's public names load on first use, so importing ``model.config``
does not build the layer spec.
"""

from __future__ import annotations

_BUILD = ("build_model", "padded_vocab_size", "unwrap")


def __getattr__(name: str) -> object:
    if name in _BUILD:
        from megatron_grpo.megatron.model import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
