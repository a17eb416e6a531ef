"""Prompt checks of the dataset task at load: an empty prompt or message and a prompt the
tokenizer mostly cannot read are errors naming ``FILE:ROW`` (and the tokenizer), not silent
training on nothing."""

from __future__ import annotations

from typing import Any

from megatron_grpo.errors import InputError

# A prompt whose content tokens are more than this share of unknown-token ids is an error.
MAX_UNKNOWN_SHARE = 0.5
_BATCH = 1024


def check_not_blank(prompt: str | list[dict], where: str, key: str) -> None:
    """An empty (or whitespace-only) prompt string or message content is an error."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InputError(f"{where}: column {key!r} is empty (whitespace only)")
        return
    for i, message in enumerate(prompt):
        if not message["content"].strip():
            raise InputError(
                f"{where}: column '{key}[{i}].content' is empty: the {message['role']!r} "
                "message has no text"
            )


def _content(prompt: str | list[dict]) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def check_unknown_tokens(rows: list[Any], tokenizer: Any, key: str) -> None:
    """Each row's prompt text (its messages' contents, without the chat template) tokenized:
    more than ``MAX_UNKNOWN_SHARE`` unknown-token ids is an error naming the row and the
    tokenizer (probably not the model's tokenizer, or text in another script). Tokenizers
    without an unknown token (byte-level BPE) never produce one: nothing to check."""
    unk = getattr(tokenizer.hf, "unk_token_id", None)
    if unk is None:
        return
    texts = [_content(row.prompt) for row in rows]
    for lo in range(0, len(texts), _BATCH):
        chunk = rows[lo : lo + _BATCH]
        for row, ids in zip(chunk, tokenizer.encode_batch(texts[lo : lo + _BATCH]), strict=True):
            n = sum(1 for i in ids if i == unk)
            if ids and n > MAX_UNKNOWN_SHARE * len(ids):
                raise InputError(
                    f"{row.source}: column {key!r}: {n} of the prompt's {len(ids)} tokens are the "
                    f"unknown token {tokenizer.hf.unk_token!r} of the tokenizer in "
                    f"{str(tokenizer.dir)!r}: is it the model's tokenizer?"
                )
