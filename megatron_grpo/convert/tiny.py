"""A seeded stand-in for a real Hugging Face model: ``tiny-hf --family qwen3 --out DIR --seed 0``.

Writes a random 2-layer, hidden-64 model of one of the families the converter supports, with a
22-token word-level tokenizer (Qwen's three special tokens, the words of the toy task of
``docs/byo_task.md``, the digits), a Qwen-style chat template and a ``generation_config.json``
listing Qwen's two stop ids. Nothing is downloaded, and the same ``seed`` writes the same
weights (drawn here from a seeded generator, not from transformers' initializers), so the docs'
numbers can be reproduced. It stands in for e.g. ``/models/Qwen3-0.6B`` in docs and tests; a
model this small and random learns nothing useful.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_grpo.convert.errors import ConversionError
from megatron_grpo.convert.families import FAMILIES

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["<unk>", "system", "user", "assistant", "what", "is", "plus", "minus", "?"]
# Qwen's chat layout (<|im_start|>role\ncontent<|im_end|>\n), without its tool / thinking parts.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# Per family (transformers model_type = our family name): what differs from _SHAPE.
_FAMILY_SHAPE: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": _MOE,
    "qwen2_moe": {**_MOE, "shared_expert_intermediate_size": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
}
INIT_STD = 0.02  # transformers' initializer_range


def save_chat_tokenizer(out: Path) -> Any:
    """The 22-token word-level tokenizer with the chat template; eos ``<|im_end|>``."""
    import tokenizers
    import transformers

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS + [str(d) for d in range(10)])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [tokenizers.pre_tokenizers.Whitespace(), tokenizers.pre_tokenizers.Digits(True)]
    )
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIAL])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _randomize(model: Any, seed: int) -> None:
    """Norm gains 1, biases 0, every other weight N(0, INIT_STD) from a generator seeded with
    ``seed``, in parameter order: the same seed gives the same model."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * INIT_STD)


def save_tiny_hf(family: str, out: str | Path, seed: int = 0) -> Path:
    """Write the seeded stand-in of ``family`` (a key of ``FAMILIES``) to ``out`` (must not exist
    or be empty): safetensors weights, config.json, generation_config.json, tokenizer files."""
    if family not in FAMILIES:
        raise ConversionError(f"--family {family!r}: not one of {', '.join(sorted(FAMILIES))}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"--out {out}: exists and is not an empty directory")
    try:
        from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    except ImportError as e:
        raise ConversionError(
            f"tiny-hf needs transformers (pip install -e '.[tools]'): {e}"
        ) from None
    tok = save_chat_tokenizer(out)
    shape = {**_SHAPE, **_FAMILY_SHAPE[family]}
    cfg = CONFIG_MAPPING[family](vocab_size=len(tok), eos_token_id=tok.eos_token_id, **shape)
    model = AutoModelForCausalLM.from_config(cfg)
    _randomize(model, seed)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(["<|im_end|>", SPECIAL[0]])
    model.save_pretrained(out)
    return out
