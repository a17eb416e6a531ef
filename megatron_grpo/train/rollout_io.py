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
=================== ======================= ==========================================

``.jsonl`` (one JSON object per line) needs nothing extra; ``.parquet`` needs ``pyarrow``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
        rows.append(row)
    return rows


def _batch(rows: list[dict[str, Any]], source: str) -> RolloutBatch:
    for key in ("prompt_ids", "response_ids", "group_id"):
        missing = [i for i, r in enumerate(rows) if r.get(key) is None]
        if missing:
            raise ValueError(f"{source}: rows {missing[:8]} have no {key!r}")

    def optional(key: str):
        have = [r.get(key) is not None for r in rows]
        if any(have) and not all(have):
            raise ValueError(f"{source}: {key!r} is present in some rows but not all")
        return [r[key] for r in rows] if rows and all(have) else None

    logprobs = optional("rollout_logprobs")
    rewards = optional("reward")
    return RolloutBatch(
        prompt_ids=[[int(t) for t in r["prompt_ids"]] for r in rows],
        response_ids=[[int(t) for t in r["response_ids"]] for r in rows],
        group_ids=[int(r["group_id"]) for r in rows],
        rollout_logprobs=None if logprobs is None else [[float(x) for x in lp] for lp in logprobs],
        rewards=None if rewards is None else [float(x) for x in rewards],
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
        rows = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from e
    else:
        rows = _pyarrow().parquet.read_table(path).to_pylist()
    return _batch(rows, str(path))


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
