"""``rollout.task: dataset``: prompts from ``.jsonl`` / ``.parquet`` files in verl's layout.

A row holds:

* ``prompt`` (or the column ``rollout.dataset.prompt_key`` names): a string, or a list of
  ``{"role": ..., "content": ...}`` messages;
* its ground truth: ``reward_model.ground_truth`` (verl) or ``answer`` (the plain
  ``{"prompt", "answer"}`` JSONL of ``task: math``); a non-string ground truth becomes its JSON
  text (``Prompt.answer`` is a string);
* optionally ``data_source`` (a string) and ``extra_info`` (a JSON object); both reach the reward
  through :class:`~megatron_grpo.rollout.tasks.base.Prompt`. Other columns are not read.

Everything happens at start-up: the files are read, every row checked, the chat template applied
and the prompts tokenized; prompts over ``rollout.max_prompt_length`` tokens are dropped (and
reported once) or are an error (``filter_overlong_prompts: false``). An error is one line naming
the file, the row (1-based line of a JSONL file, 1-based row of a Parquet file) and the column.
Prompts are visited in a fresh seeded permutation per epoch, so prompt ``i`` is a pure function
of ``(seed, i)`` and ``--resume`` continues exactly.

The built-in reward compares the response with the ground truth: the last number when the
ground truth is a number, else the whole response, stripped, as a string.
"""

from __future__ import annotations

import json
import os
import random
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_grpo.errors import InputError
from megatron_grpo.rollout.config import DatasetConfig
from megatron_grpo.rollout.tasks.base import Prompt
from megatron_grpo.rollout.tasks.math import HFTokenizer, last_number
from megatron_grpo.rollout.tasks.prompt_checks import check_not_blank, check_unknown_tokens

SECTION = "rollout.dataset"
# How to get pyarrow when a .parquet dataset is given without it.
PYARROW_HINT = 'pip install "megatron-grpo[data]" (or pyarrow)'
# Overlong prompts listed by name in the start-up report (then "and N more").
MAX_LISTED = 10
_BATCH = 1024  # rows per call of the chat template / the tokenizer
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_COLUMNS = ("reward_model", "answer", "data_source", "extra_info")


@dataclass(frozen=True)
class Row:
    """One checked row, before templating and tokenization."""

    source: str  # "path:row"
    prompt: str | list[dict]
    answer: str
    data_source: str
    extra_info: dict | None


@dataclass(frozen=True)
class _Item:
    """One loaded prompt (ids kept compactly)."""

    ids: array
    text: str
    row: Row


def exact_match(response: str, answer: str) -> float:
    """1.0 when ``response`` matches ``answer``: by the last number in the response when the
    answer is a number (``1,234.5`` style), else as stripped strings; else 0.0."""
    if _NUMBER.fullmatch(answer.strip()):
        got, want = last_number(response), last_number(answer)
        return float(got is not None and want is not None and abs(got - want) < 1e-6)
    return float(response.strip() == answer.strip())


# ---- reading --------------------------------------------------------------------------------


def _jsonl_records(path: str) -> Iterator[tuple[int, Any]]:
    """``(line, object)`` of each non-blank line (1-based line numbers)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(
                    f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start} of the line)"
                ) from None
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(
                    f"{path}:{lineno}: invalid JSON at column {e.colno}: {e.msg}"
                ) from None


def _pyarrow_parquet(path: str, field: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"{field}: reading {path!r} needs the 'pyarrow' package ({PYARROW_HINT}), or give "
            "the data as .jsonl"
        ) from e
    return pq


def _parquet_records(path: str, field: str, prompt_key: str) -> Iterator[tuple[int, Any]]:
    """``(row, mapping)`` of each row (1-based), with only the columns the task reads."""
    pq = _pyarrow_parquet(path, field)
    try:
        names = pq.read_schema(path).names
        wanted = [c for c in names if c == prompt_key or c in _COLUMNS]
        table = pq.read_table(path, columns=wanted)
    except Exception as e:  # pyarrow's errors (ArrowInvalid, OSError) on a damaged file
        raise InputError(f"{path}: cannot read as Parquet: {e}") from None
    if table.num_rows and prompt_key not in names:
        raise InputError(
            f"{path}:1: no column {prompt_key!r} ({SECTION}.prompt_key; columns: "
            f"{', '.join(names)})"
        )
    row = 0
    for batch in table.to_batches():
        for record in batch.to_pylist():
            row += 1
            yield row, record


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def _check_prompt(value: Any, where: str, key: str) -> str | list[dict]:
    if value is None:
        raise InputError(f"{where}: column {key!r} is null")
    if isinstance(value, str):
        if not value:
            raise InputError(f"{where}: column {key!r} is an empty string")
        check_not_blank(value, where, key)
        return value
    if not isinstance(value, list):
        raise InputError(
            f"{where}: column {key!r}: expected a string or a list of {{role, content}} "
            f"messages, got {_describe(value)}"
        )
    if not value:
        raise InputError(f"{where}: column {key!r} is an empty message list")
    for i, message in enumerate(value):
        col = f"{key}[{i}]"
        if not isinstance(message, dict):
            raise InputError(
                f"{where}: column {col!r}: expected a {{role, content}} message, got "
                f"{_describe(message)}"
            )
        for part in ("role", "content"):
            if not isinstance(message.get(part), str):
                got = "nothing" if part not in message else _describe(message[part])
                raise InputError(f"{where}: column '{col}.{part}': expected a string, got {got}")
    check_not_blank(value, where, key)
    return value


def _ground_truth(record: dict, where: str) -> str:
    if record.get("reward_model") is not None:
        rm = record["reward_model"]
        if not isinstance(rm, dict):
            raise InputError(
                f"{where}: column 'reward_model': expected an object with 'ground_truth', got "
                f"{_describe(rm)}"
            )
        if rm.get("ground_truth") is None:
            raise InputError(f"{where}: column 'reward_model.ground_truth' is missing or null")
        value, col = rm["ground_truth"], "reward_model.ground_truth"
    elif "answer" in record:
        value, col = record["answer"], "answer"
        if value is None:
            raise InputError(f"{where}: column 'answer' is null")
    else:
        raise InputError(
            f"{where}: no ground truth: expected column 'reward_model.ground_truth' (verl's "
            "layout) or 'answer'"
        )
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise InputError(f"{where}: column {col!r}: not JSON data ({e})") from None


def parse_record(record: Any, where: str, prompt_key: str = "prompt") -> Row:
    """A checked :class:`Row` of one JSON object / Parquet row; ``where`` is ``"path:row"``."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {_describe(record)}")
    if prompt_key not in record:
        present = ", ".join(sorted(map(str, record))) or "none"
        raise InputError(
            f"{where}: no column {prompt_key!r} ({SECTION}.prompt_key; columns: {present})"
        )
    prompt = _check_prompt(record[prompt_key], where, prompt_key)
    answer = _ground_truth(record, where)
    data_source = record.get("data_source")
    if data_source is None:
        data_source = ""
    elif not isinstance(data_source, str):
        raise InputError(
            f"{where}: column 'data_source': expected a string, got {_describe(data_source)}"
        )
    extra_info = record.get("extra_info")
    if isinstance(extra_info, list) and all(
        isinstance(p, tuple) and len(p) == 2 for p in extra_info
    ):  # a Parquet map column reads as (key, value) pairs
        extra_info = dict(extra_info)
    if extra_info is not None and not isinstance(extra_info, dict):
        raise InputError(
            f"{where}: column 'extra_info': expected a JSON object, got {_describe(extra_info)}"
        )
    return Row(where, prompt, answer, data_source, extra_info)


def read_rows(path: str, field: str, prompt_key: str = "prompt") -> list[Row]:
    """The checked rows of one ``.jsonl`` / ``.parquet`` file; ``field`` (e.g.
    ``rollout.dataset.train_files[0]``) is named when the file is missing or empty."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{field}: no such file {path!r}")
    if not p.is_file():
        raise InputError(f"{field}: {path!r} is not a file")
    if path.endswith(".parquet"):
        records = _parquet_records(path, field, prompt_key)
    else:
        records = _jsonl_records(path)
    rows = [parse_record(rec, f"{path}:{row}", prompt_key) for row, rec in records]
    if not rows:
        raise InputError(f"{field}: {path!r} has no rows")
    return rows


# ---- templating and tokenization -----------------------------------------------------------


def _messages(prompt: str | list[dict]) -> list[dict]:
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


class PromptEncoder:
    """Rows -> ``(text, ids)`` with the chat-template rule of ``rollout.dataset``."""

    def __init__(self, tokenizer: HFTokenizer, cfg: DatasetConfig) -> None:
        self.tokenizer, self.cfg = tokenizer, cfg
        has = tokenizer.has_chat_template
        if cfg.chat_template is True and not has:
            raise InputError(
                f"{SECTION}.chat_template is true but the tokenizer in {cfg.tokenizer_dir!r} has "
                "no chat template"
            )
        self.templated = has and cfg.chat_template is not False

    def texts(self, rows: list[Row]) -> list[str]:
        """The prompt text of each row: the chat template's output, or the raw string."""
        if not self.templated:
            for row in rows:
                if isinstance(row.prompt, list):
                    why = (
                        f"{SECTION}.chat_template is false"
                        if self.cfg.chat_template is False
                        else f"the tokenizer in {self.cfg.tokenizer_dir!r} has none"
                    )
                    raise InputError(
                        f"{row.source}: column {self.cfg.prompt_key!r}: a message list needs a "
                        f"chat template and {why}"
                    )
            return [str(row.prompt) for row in rows]
        out: list[str] = []
        add = self.cfg.add_generation_prompt
        for lo in range(0, len(rows), _BATCH):
            chunk = rows[lo : lo + _BATCH]
            try:
                out += self.tokenizer.render_chat([_messages(r.prompt) for r in chunk], add)
            except Exception:  # find the row: render one by one
                for row in chunk:
                    try:
                        self.tokenizer.render_chat([_messages(row.prompt)], add)
                    except Exception as e:
                        raise InputError(
                            f"{row.source}: column {self.cfg.prompt_key!r}: the chat template "
                            f"failed: {type(e).__name__}: {' '.join(str(e).split())}"
                        ) from None
                raise
        return out

    def encode(self, rows: list[Row]) -> list[tuple[str, list[int]]]:
        check_unknown_tokens(rows, self.tokenizer, self.cfg.prompt_key)
        texts = self.texts(rows)
        ids: list[list[int]] = []
        for lo in range(0, len(texts), _BATCH):
            ids += self.tokenizer.encode_batch(texts[lo : lo + _BATCH])
        for row, row_ids in zip(rows, ids, strict=True):
            if not row_ids:
                raise InputError(
                    f"{row.source}: column {self.cfg.prompt_key!r}: the prompt encodes to no tokens "
                    f"(tokenizer {self.cfg.tokenizer_dir!r})"
                )
        return list(zip(texts, ids, strict=True))


# ---- the task -------------------------------------------------------------------------------


def _is_rank0() -> bool:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"  # torchrun's ranks before the process group


def overlong_report(
    dropped: list[tuple[str, int]], counts: dict[str, tuple[int, int]], limit: int
) -> str:
    """The one line reporting dropped overlong prompts: per file, their rows (at most
    ``MAX_LISTED``, then "and N more"). ``dropped``: ``("path:row", tokens)``; ``counts``:
    split -> (dropped, read)."""
    by_file: dict[str, list[str]] = {}
    for source, _ in dropped[:MAX_LISTED]:
        path, _, row = source.rpartition(":")
        by_file.setdefault(path, []).append(row)
    listed = "; ".join(
        f"{path} row{'s' if len(rows) > 1 else ''} {', '.join(rows)}"
        for path, rows in by_file.items()
    )
    more = f" and {len(dropped) - MAX_LISTED} more" if len(dropped) > MAX_LISTED else ""
    split = ", ".join(f"{d} of {n} {name}" for name, (d, n) in counts.items() if d)
    longest = max(n for _, n in dropped)
    return (
        f"{SECTION}: dropped {split} prompts over rollout.max_prompt_length={limit} tokens "
        f"(filter_overlong_prompts; longest {longest}): {listed}{more}"
    )


class DatasetTask:
    """Prompts of ``rollout.dataset`` (see the module docstring).

    ``stop_ids``: token ids that end a response besides ``tokenizer.eos_id``: the
    ``eos_token_id`` of ``generation_config.json`` in ``tokenizer_dir`` (rollout_source adds them
    to ``rollout.sampling.stop_ids``). ``val_prompts()``: the validation prompts in file order.
    """

    def __init__(self, cfg: DatasetConfig, max_prompt_length: int, seed: int) -> None:
        if not cfg.train_files:
            raise InputError(f"{SECTION}.train_files is empty")
        if not cfg.tokenizer_dir:
            raise InputError(f"{SECTION}.tokenizer_dir is required")
        self.cfg, self.seed, self.max_prompt_length = cfg, seed, max_prompt_length
        self.tokenizer = HFTokenizer(cfg.tokenizer_dir, field=f"{SECTION}.tokenizer_dir")
        eos = self.tokenizer.eos_id
        self.stop_ids: tuple[int, ...] = tuple(
            i for i in dict.fromkeys(self.tokenizer.generation_eos_ids()) if i != eos
        )
        encoder = PromptEncoder(self.tokenizer, cfg)
        dropped: list[tuple[str, int]] = []
        counts: dict[str, tuple[int, int]] = {}
        self._train = self._load(encoder, "train_files", dropped, counts)
        self._val = self._load(encoder, "val_files", dropped, counts)
        if dropped and _is_rank0():
            print(overlong_report(dropped, counts, max_prompt_length), flush=True)
        if not self._train:
            raise InputError(
                f"{SECTION}.train_files: all {counts['train'][1]} prompts are longer than "
                f"rollout.max_prompt_length={max_prompt_length} tokens"
            )
        self._perms: dict[int, list[int]] = {}

    def _load(
        self,
        encoder: PromptEncoder,
        name: str,
        dropped: list[tuple[str, int]],
        counts: dict[str, tuple[int, int]],
    ) -> list[_Item]:
        items: list[_Item] = []
        read, before = 0, len(dropped)
        for i, path in enumerate(getattr(self.cfg, name)):
            rows = read_rows(path, f"{SECTION}.{name}[{i}]", self.cfg.prompt_key)
            read += len(rows)
            for row, (text, ids) in zip(rows, encoder.encode(rows), strict=True):
                if len(ids) > self.max_prompt_length:
                    if not self.cfg.filter_overlong_prompts:
                        raise InputError(
                            f"{row.source}: column {self.cfg.prompt_key!r}: the prompt has "
                            f"{len(ids)} tokens > rollout.max_prompt_length="
                            f"{self.max_prompt_length} (after the chat template; "
                            f"{SECTION}.filter_overlong_prompts: true drops such prompts)"
                        )
                    dropped.append((row.source, len(ids)))
                    continue
                items.append(_Item(array("i", ids), text, row))
        counts[name.removesuffix("_files")] = (len(dropped) - before, read)
        return items

    def __len__(self) -> int:
        """Training prompts per epoch (after filtering)."""
        return len(self._train)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            if len(self._perms) >= 4:  # extra rounds of dynamic sampling may jump epochs
                self._perms.pop(next(iter(self._perms)))
            order = list(range(len(self._train)))
            random.Random(f"{self.seed}/epoch{epoch}").shuffle(order)
            self._perms[epoch] = order
        return self._perms[epoch]

    @staticmethod
    def _prompt(item: _Item) -> Prompt:
        r = item.row
        return Prompt(tuple(item.ids), item.text, r.answer, r.data_source, r.extra_info, r.source)

    def prompts(self, start: int, n: int) -> list[Prompt]:
        out = []
        for i in range(start, start + n):
            epoch, pos = divmod(i, len(self._train))
            out.append(self._prompt(self._train[self._order(epoch)[pos]]))
        return out

    def val_prompts(self) -> list[Prompt]:
        """Every validation prompt (``val_files``, after filtering), in file order."""
        return [self._prompt(item) for item in self._val]

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        return exact_match(self.tokenizer.decode(list(response_ids)), prompt.answer)
