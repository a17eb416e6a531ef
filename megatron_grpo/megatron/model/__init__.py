"""The model: the layer spec (:mod:`.layer_spec`) and building GPTModel chunks
(:mod:`.build`), the room that assembles attention/ and moe/. Its leaves sit at megatron/'s
top, below every room: the config sections (``megatron/config.py``), access to a built model
(``megatron/gpt.py``) and every write to megatron-core's private state (``megatron/compat.py``).

``from megatron_grpo.megatron.model import build_model`` (the documented path of the builder)
keeps working: the builder's public names load on first use.
"""

from __future__ import annotations

_BUILD = ("build_model", "padded_vocab_size", "unwrap")


def __getattr__(name: str) -> object:
    if name in _BUILD:
        from megatron_grpo.megatron.model import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
