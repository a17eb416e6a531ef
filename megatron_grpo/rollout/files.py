"""Rollout batches to and from files, for users with their own generation fleet.

One row per sample, the same columns in both formats:

=================== ======================= ==========================================
column              type                    meaning
=================== ======================= ==========================================
``prompt_ids``      list[int]               prompt token ids
``response_ids``    list[int]               response token ids (incl. a final eos)
``rollout_logprobs`` list[float], optional  generator log-prob of each response token
``reward``          float, optional         the sample's scalar reward
``group_id``        int                     samples of one prompt share it
``routed_experts``  list[list[list[int]]],  MoE routing replay: ``[N][L][k]`` top-k expert
                    optional                ids per token and MoE layer
=================== ======================= ==========================================

``routed_experts`` follows vLLM's ``enable_return_routed_experts`` layout ``(tokens, layers,
top_k)``: row ``j`` is the selection made for token ``j`` of ``prompt_ids + response_ids`` as
the router's input. ``N`` may be ``P + R`` (every token), ``P + R - 1`` (vLLM: the final
sampled token is never fed back) or ``R`` (response tokens only). Tokens without a row, and rows
of -1, are routed live when replayed (so a response-only file replays the response tokens and
routes the prompt with the trainer's router). Written files hold ``P + R`` rows. Whether the
routes fit the model (layers, top-k, expert count) is checked when training with
``model.moe_enable_routing_replay`` (errors name ``file:line``); with the switch off they are
ignored, so the same files can be trained with and without replay.

``.jsonl`` (one JSON object per line) needs nothing extra; ``.parquet`` needs ``pyarrow``.
Rows are checked when read (int ids >= 0, a finite numeric reward, numeric log-probs, one per
response token) and, by the trainer, against the model (:meth:`RolloutFileSource.
check_against_model`); every error names the file and line (or parquet row) and the field.
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_grpo.errors import InputError
from megatron_grpo.rollout.batch import RolloutBatch

SUFFIXES = (".jsonl", ".parquet")


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as e:
        raise ImportError(
            "reading or writing .parquet rollouts needs the 'pyarrow' package "
            "(pip install pyarrow), or use .jsonl"
        ) from e
    return pyarrow


def _rows(batch: RolloutBatch) -> list[dict[str, Any]]:
    rows = []
    for i in range(len(batch)):
        row: dict[str, Any] = {
            "prompt_ids": list(batch.prompt_ids[i]),
            "response_ids": list(batch.response_ids[i]),
            "group_id": int(batch.group_ids[i]),
        }
        if batch.rollout_logprobs is not None:
            row["rollout_logprobs"] = [float(x) for x in batch.rollout_logprobs[i]]
        if batch.rewards is not None:
            row["reward"] = float(batch.rewards[i])
        if batch.routed_experts is not None:
            row["routed_experts"] = batch.routed_experts[i].tolist()
        rows.append(row)
    return rows


def _routes(value: Any, prompt: int, response: int, where: str) -> Tensor:
    """One row's ``routed_experts`` as int64 ``[P + R, L, k]`` (-1 where the file has none)."""
    try:
        r = torch.tensor(value, dtype=torch.long)
    except (TypeError, ValueError) as e:
        raise InputError(f"{where}: routed_experts is not a [tokens][layers][top_k] list") from e
    full = prompt + response
    if r.dim() != 3 or r.shape[0] not in (full, full - 1, response):
        raise InputError(
            f"{where}: routed_experts has {r.shape[0] if r.dim() else 0} tokens (shape "
            f"{list(r.shape)}); expected [{full}, L, k] (prompt + response), {full - 1} "
            f"(without the final token) or {response} (response only)"
        )
    out = torch.full((full, *r.shape[1:]), -1, dtype=torch.long)
    start = prompt if r.shape[0] == response and response != full - 1 else 0
    out[start : start + r.shape[0]] = r
    return out


def _batch(rows: list[dict[str, Any]], source: str, where: list[str] | None = None) -> RolloutBatch:
    """Rows -> batch; ``where[i]`` names row i in errors (``file:line`` / ``file row N``)."""
    where = where or [f"{source} row {i + 1}" for i in range(len(rows))]
    origins = where
    for key in ("prompt_ids", "response_ids", "group_id"):
        missing = [origins[i] for i, r in enumerate(rows) if r.get(key) is None]
        if missing:
            raise InputError(f"{', '.join(missing[:8])}: no {key!r}")

    def optional(key: str):
        have = [r.get(key) is not None for r in rows]
        if any(have) and not all(have):
            raise InputError(f"{source}: {key!r} is present in some rows but not all")
        return [r[key] for r in rows] if rows and all(have) else None

    for row, loc in zip(rows, where, strict=True):
        _check_row(row, loc)
    logprobs = optional("rollout_logprobs")
    rewards = optional("reward")
    routes = optional("routed_experts")
    if routes is not None:
        routes = [
            _routes(x, len(r["prompt_ids"]), len(r["response_ids"]), loc)
            for x, r, loc in zip(routes, rows, origins, strict=True)
        ]
    return RolloutBatch(
        prompt_ids=[[int(t) for t in r["prompt_ids"]] for r in rows],
        response_ids=[[int(t) for t in r["response_ids"]] for r in rows],
        group_ids=[int(r["group_id"]) for r in rows],
        rollout_logprobs=None if logprobs is None else [[float(x) for x in lp] for lp in logprobs],
        rewards=None if rewards is None else [float(x) for x in rewards],
        routed_experts=routes,
        origins=origins,
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_row(row: dict[str, Any], where: str) -> None:
    """Types and the model-independent ranges of one row; errors name ``where`` and the field."""
    for key in ("prompt_ids", "response_ids"):
        ids = row[key]
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InputError(f"{where}: {key} must be a non-empty list of token ids")
        for j, t in enumerate(ids):
            if not _is_int(t) or t < 0:
                raise InputError(f"{where}: {key}[{j}] = {t!r} is not a token id (an int >= 0)")
    if not _is_int(row["group_id"]):
        raise InputError(f"{where}: group_id = {row['group_id']!r} is not an int")
    reward = row.get("reward")
    if reward is not None and not (_is_number(reward) and math.isfinite(reward)):
        raise InputError(f"{where}: reward = {reward!r} is not a finite number")
    logprobs = row.get("rollout_logprobs")
    if logprobs is not None:  # non-finite values are kept: the trainer skips and reports them
        if not isinstance(logprobs, (list, tuple)) or len(logprobs) != len(row["response_ids"]):
            raise InputError(
                f"{where}: rollout_logprobs must be a list of one number per response token"
            )
        bad = [j for j, x in enumerate(logprobs) if not _is_number(x)]
        if bad:
            raise InputError(
                f"{where}: rollout_logprobs[{bad[0]}] = {logprobs[bad[0]]!r} is not a number"
            )


def check_against_model(
    batch: RolloutBatch, where: list[str], vocab_size: int, max_sequence_length: int
) -> None:
    """Token ids below ``vocab_size`` and prompt + response within ``max_sequence_length``
    (beyond either, the embedding fails with a bare IndexError naming no file)."""
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids, strict=True)):
        for key, ids in (("prompt_ids", p), ("response_ids", r)):
            top = max(ids)
            if top >= vocab_size:
                raise InputError(
                    f"{where[i]}: {key}[{ids.index(top)}] = {top} is not below "
                    f"model.vocab_size = {vocab_size}"
                )
        if len(p) + len(r) > max_sequence_length:
            raise InputError(
                f"{where[i]}: prompt_ids + response_ids = {len(p)} + {len(r)} tokens exceed "
                f"model.max_sequence_length = {max_sequence_length}"
            )


def _check_suffix(path: Path) -> None:
    if path.suffix not in SUFFIXES:
        raise InputError(f"rollout file {str(path)!r} must end in one of {list(SUFFIXES)}")


def write_rollouts(batch: RolloutBatch, path: str | Path) -> None:
    """Write ``batch`` to ``path`` (format by suffix); written aside, then renamed into place."""
    path = Path(path)
    _check_suffix(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    rows = _rows(batch)
    if path.suffix == ".jsonl":
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    else:
        pa = _pyarrow()
        pa.parquet.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)


def read_rollouts(path: str | Path) -> RolloutBatch:
    """Read one ``.jsonl`` / ``.parquet`` rollout file (rows checked, errors name the line)."""
    return read_rollouts_located(path)[0]


def read_rollouts_located(path: str | Path) -> tuple[RolloutBatch, list[str]]:
    """:func:`read_rollouts` plus where each sample came from (``file:line`` / ``file row N``)."""
    path = Path(path)
    _check_suffix(path)
    if path.suffix == ".jsonl":
        rows, where = [], []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise InputError(f"{path}:{lineno}: invalid JSON: {e}") from e
                    if not isinstance(rows[-1], dict):
                        raise InputError(f"{path}:{lineno}: a row must be a JSON object")
                    where.append(f"{path}:{lineno}")
    else:
        rows = _pyarrow().parquet.read_table(path).to_pylist()
        where = [f"{path} row {i + 1}" for i in range(len(rows))]
    return _batch(rows, str(path), where), where


class RolloutFileSource:
    """Groups from a rollout file or a directory of them (sorted by name), in file order.

    ``take(start, n)`` returns groups ``start .. start + n`` as one batch with group ids
    renumbered ``0 .. n - 1``; a group is identified by (file, ``group_id``).
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES)
            if not files:
                raise InputError(f"rollout.input_path {str(path)!r} holds no .jsonl/.parquet files")
        elif path.exists():
            files = [path]
        else:
            raise InputError(f"rollout.input_path {str(path)!r} does not exist")
        self.groups: list[tuple[RolloutBatch, list[int]]] = []
        self.files: list[tuple[RolloutBatch, list[str]]] = []
        for f in files:
            batch, where = read_rollouts_located(f)
            self.files.append((batch, where))
            members: dict[int, list[int]] = {}
            for i, gid in enumerate(batch.group_ids):
                members.setdefault(gid, []).append(i)
            self.groups += [(batch, idx) for idx in members.values()]

    def __len__(self) -> int:
        return len(self.groups)

    def check_against_model(self, vocab_size: int, max_sequence_length: int) -> None:
        """Every sample's ids and length against the model (errors name file and line)."""
        for batch, where in self.files:
            check_against_model(batch, where, vocab_size, max_sequence_length)

    def take(self, start: int, n: int) -> RolloutBatch:
        if start + n > len(self.groups):
            raise InputError(
                f"rollout input has {len(self.groups)} groups; groups {start}..{start + n} "
                "were requested"
            )
        parts = []
        for new_id, (batch, idx) in enumerate(self.groups[start : start + n]):
            part = batch.select(idx)
            part.group_ids = [new_id] * len(idx)
            parts.append(part)
        return RolloutBatch.concat(parts)
