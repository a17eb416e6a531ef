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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_grpo.train.rollout_batch import RolloutBatch

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
        raise ValueError(f"{where}: routed_experts is not a [tokens][layers][top_k] list") from e
    full = prompt + response
    if r.dim() != 3 or r.shape[0] not in (full, full - 1, response):
        raise ValueError(
            f"{where}: routed_experts has {r.shape[0] if r.dim() else 0} tokens (shape "
            f"{list(r.shape)}); expected [{full}, L, k] (prompt + response), {full - 1} "
            f"(without the final token) or {response} (response only)"
        )
    out = torch.full((full, *r.shape[1:]), -1, dtype=torch.long)
    start = prompt if r.shape[0] == response and response != full - 1 else 0
    out[start : start + r.shape[0]] = r
    return out


def _batch(rows: list[dict[str, Any]], source: str, origins: list[str]) -> RolloutBatch:
    for key in ("prompt_ids", "response_ids", "group_id"):
        missing = [origins[i] for i, r in enumerate(rows) if r.get(key) is None]
        if missing:
            raise ValueError(f"{', '.join(missing[:8])}: no {key!r}")

    def optional(key: str):
        have = [r.get(key) is not None for r in rows]
        if any(have) and not all(have):
            raise ValueError(f"{source}: {key!r} is present in some rows but not all")
        return [r[key] for r in rows] if rows and all(have) else None

    logprobs = optional("rollout_logprobs")
    rewards = optional("reward")
    routes = optional("routed_experts")
    if routes is not None:
        routes = [
            _routes(x, len(r["prompt_ids"]), len(r["response_ids"]), where)
            for x, r, where in zip(routes, rows, origins, strict=True)
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


def _check_suffix(path: Path) -> None:
    if path.suffix not in SUFFIXES:
        raise ValueError(f"rollout file {str(path)!r} must end in one of {list(SUFFIXES)}")


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
    """Read one ``.jsonl`` / ``.parquet`` rollout file."""
    path = Path(path)
    _check_suffix(path)
    if path.suffix == ".jsonl":
        rows, origins = [], []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from e
                    origins.append(f"{path}:{lineno}")
    else:
        rows = _pyarrow().parquet.read_table(path).to_pylist()
        origins = [f"{path}:row {i + 1}" for i in range(len(rows))]
    return _batch(rows, str(path), origins)


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
                raise ValueError(f"rollout.input_path {str(path)!r} holds no .jsonl/.parquet files")
        elif path.exists():
            files = [path]
        else:
            raise ValueError(f"rollout.input_path {str(path)!r} does not exist")
        self.groups: list[tuple[RolloutBatch, list[int]]] = []
        for f in files:
            batch = read_rollouts(f)
            members: dict[int, list[int]] = {}
            for i, gid in enumerate(batch.group_ids):
                members.setdefault(gid, []).append(i)
            self.groups += [(batch, idx) for idx in members.values()]

    def __len__(self) -> int:
        return len(self.groups)

    def take(self, start: int, n: int) -> RolloutBatch:
        if start + n > len(self.groups):
            raise ValueError(
                f"rollout input has {len(self.groups)} groups; groups {start}..{start + n} "
                "were requested"
            )
        parts = []
        for new_id, (batch, idx) in enumerate(self.groups[start : start + n]):
            part = batch.select(idx)
            part.group_ids = [new_id] * len(idx)
            parts.append(part)
        return RolloutBatch.concat(parts)
