"""Math word problems from a local JSONL of ``{"prompt": ..., "answer": ...}`` rows.

The tokenizer is a Hugging Face tokenizer read from a local directory
(``AutoTokenizer.from_pretrained(dir, local_files_only=True)``): nothing is downloaded. Prompts
are visited in a fresh seeded permutation per epoch, so prompt ``i`` is a pure function of
``(seed, i)``. The built-in reward is exact match of the last number in the response.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from megatron_grpo.errors import InputError
from megatron_grpo.rollout.tasks.base import Prompt

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (``1,234.5`` style commas allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


class HFTokenizer:
    """A local Hugging Face tokenizer behind the trainer's ``Tokenizer`` protocol."""

    def __init__(self, tokenizer_dir: str, field: str = "math.tokenizer_dir") -> None:
        """``field``: the config field named in errors."""
        if not Path(tokenizer_dir).is_dir():
            raise InputError(f"{field} {tokenizer_dir!r} is not a directory")
        from transformers import AutoTokenizer

        self.dir = Path(tokenizer_dir)

        try:
            self.hf = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        except (OSError, ValueError) as e:  # no or broken tokenizer files
            why = " ".join(str(e).split())[:300] or type(e).__name__  # one line
            raise InputError(f"{field} {tokenizer_dir!r}: cannot load a tokenizer: {why}") from e
        if self.hf.eos_token_id is None:
            raise InputError(f"the tokenizer in {tokenizer_dir!r} has no eos token")

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_id(self) -> int:
        return int(self.hf.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text, in one call of the fast tokenizer."""
        return [list(ids) for ids in self.hf(texts, add_special_tokens=False)["input_ids"]]

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render_chat(
        self, conversations: list[list[dict]], add_generation_prompt: bool = True
    ) -> list[str]:
        """The chat template's text of each message list (``tokenize=False``)."""
        return list(
            self.hf.apply_chat_template(
                conversations, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """``apply_chat_template(messages, add_generation_prompt=..., tokenize=True)``: the same
        ids as ``encode_batch(render_chat([messages]))[0]`` (the template's text is tokenized
        without added special tokens)."""
        out = self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        return [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]

    def generation_eos_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` (an int or a list) of ``generation_config.json`` in the tokenizer
        directory, or () without that file or key: the ids that end the model's turns (e.g.
        ``<|im_end|>`` and ``<|endoftext|>``)."""
        path = self.dir / "generation_config.json"
        if not path.is_file():
            return ()
        try:
            value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (ValueError, AttributeError) as e:
            raise InputError(f"{path}: not a JSON object ({e})") from None
        ids = value if isinstance(value, list) else [] if value is None else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise InputError(f"{path}: eos_token_id must be an id or a list of ids, got {value!r}")
        return tuple(ids)


def read_jsonl_rows(path: str) -> list[tuple[str, str]]:
    """``(prompt, answer)`` pairs; errors name the file, line and missing field."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            for key in ("prompt", "answer"):
                if key not in row:
                    raise InputError(f"{path}:{lineno}: row has no {key!r} field")
            rows.append((str(row["prompt"]), str(row["answer"])))
    if not rows:
        raise InputError(f"math.data_path {path!r} has no rows")
    return rows


class MathTask:
    def __init__(self, data_path: str, tokenizer_dir: str, prompt_template: str, seed: int):
        if "{prompt}" not in prompt_template:
            raise InputError("math.prompt_template must contain '{prompt}'")
        self.rows = read_jsonl_rows(data_path)
        self.tokenizer = HFTokenizer(tokenizer_dir)
        self.template = prompt_template
        self.seed = seed
        self._perm: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        if self._perm is None or self._perm[0] != epoch:
            order = list(range(len(self.rows)))
            random.Random(f"{self.seed}/epoch{epoch}").shuffle(order)
            self._perm = (epoch, order)
        return self._perm[1]

    def prompts(self, start: int, n: int) -> list[Prompt]:
        out = []
        for i in range(start, start + n):
            epoch, pos = divmod(i, len(self.rows))
            prompt, answer = self.rows[self._order(epoch)[pos]]
            text = self.template.replace("{prompt}", prompt)
            out.append(Prompt(tuple(self.tokenizer.encode(text)), text, answer))
        return out

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        got = last_number(self.tokenizer.decode(list(response_ids)))
        want = last_number(prompt.answer)
        return float(got is not None and want is not None and abs(got - want) < 1e-6)
