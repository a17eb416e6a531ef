"""Streaming safetensors I/O: memory-mapped reads, tensor-at-a-time sharded writes.

:class:`SafetensorsReader` parses the shard headers itself and maps each tensor as its own
``numpy.memmap`` (copy-on-write), so a tensor costs address space, not resident memory, until
its pages are touched, and its storage is exactly its own bytes (writers that clone views
leave it alone). :class:`SafetensorsWriter` lays the shards out from a plan of names, shapes
and dtypes first, then writes each tensor's bytes straight to its file: peak memory is one
tensor, not one shard.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from megatron_grpo.convert.errors import ConversionError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``shape``/``dtype`` and its byte range in ``path``."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _read_header(path: Path) -> dict[str, TensorInfo]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConversionError(f"{path}: truncated safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ConversionError(f"{path}: header length {n} exceeds the file size {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConversionError(f"{path}: corrupt safetensors header ({e})") from e
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise ConversionError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        begin, end = meta["data_offsets"]
        if not 0 <= begin <= end <= size - 8 - n:
            raise ConversionError(f"{path}: tensor {name} lies outside the file (truncated?)")
        dtype, shape = _DTYPES[meta["dtype"]], tuple(meta["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ConversionError(f"{path}: tensor {name} size does not match its shape {shape}")
        out[name] = TensorInfo(path, dtype, shape, 8 + n + begin, end - begin)
    return out


def _weight_files(hf_dir: Path) -> dict[str, list[str] | None]:
    """Shard file -> expected tensor names (None: whatever the file holds)."""
    index = hf_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ConversionError(f"{index}: not a safetensors index ({e})") from e
        files: dict[str, list[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)  # type: ignore[union-attr]
        return files
    if (hf_dir / SINGLE_NAME).is_file():
        return {SINGLE_NAME: None}
    if list(hf_dir.glob("*.bin")) or list(hf_dir.glob("*.pt")):
        raise ConversionError(f"{hf_dir}: only safetensors checkpoints are supported (found .bin)")
    raise ConversionError(f"{hf_dir}: no {SINGLE_NAME} or {INDEX_NAME}")


class SafetensorsReader:
    """All tensors of an HF checkpoint directory (single file or index + shards)."""

    def __init__(self, hf_dir: str | Path) -> None:
        hf_dir = Path(hf_dir)
        files = _weight_files(hf_dir)
        missing = sorted(f for f in files if not (hf_dir / f).is_file())
        if missing:
            raise ConversionError(f"{hf_dir}: missing shard file(s) {', '.join(missing)}")
        self.infos: dict[str, TensorInfo] = {}
        for file, expected in files.items():
            header = _read_header(hf_dir / file)
            absent = sorted(set(expected or ()) - set(header))
            if absent:
                raise ConversionError(f"{hf_dir / file}: the index lists absent tensors {absent}")
            for name in expected if expected is not None else header:
                self.infos[name] = header[name]

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def names(self) -> list[str]:
        return list(self.infos)

    def get(self, name: str) -> torch.Tensor:
        """The tensor, memory-mapped (copy-on-write: writing to it never touches the file)."""
        info = self.infos.get(name)
        if info is None:
            raise ConversionError(f"tensor {name} is not in the checkpoint")
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        raw = np.memmap(
            info.path, dtype=np.uint8, mode="c", offset=info.offset, shape=(info.nbytes,)
        )
        return torch.from_numpy(raw).view(info.dtype).reshape(info.shape)


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _header_bytes(tensors: list[PlannedTensor]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class SafetensorsWriter:
    """Writes planned tensors, in plan order, into HF-style shards plus an index.

    ``plan`` fixes every tensor's name, shape and dtype up front; :meth:`write` must then be
    called once per tensor in the same order. Shards are ``model-0000i-of-0000n.safetensors``
    (or ``model.safetensors`` when one suffices) of at most ``max_shard_bytes`` each (a larger
    single tensor gets its own shard).
    """

    def __init__(self, out_dir: str | Path, plan: list[PlannedTensor], max_shard_bytes: int):
        self.out_dir = Path(out_dir)
        self.shards: list[list[PlannedTensor]] = [[]]
        size = 0
        for t in plan:
            if self.shards[-1] and size + t.nbytes > max_shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append(t)
            size += t.nbytes
        n = len(self.shards)
        self.files = [
            SINGLE_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)
        ]
        self._queue = [(s, t) for s, tensors in enumerate(self.shards) for t in tensors]
        self._pos = 0
        self._shard = -1
        self._file: BinaryIO | None = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._pos >= len(self._queue):
            raise RuntimeError(f"tensor {name} is not in the write plan")
        shard, planned = self._queue[self._pos]
        if (name, tuple(tensor.shape), tensor.dtype) != (
            planned.name,
            planned.shape,
            planned.dtype,
        ):
            raise RuntimeError(
                f"write order/shape mismatch: got {name} {tuple(tensor.shape)} {tensor.dtype}, "
                f"planned {planned}"
            )
        if shard != self._shard:
            self._open(shard)
        data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))  # type: ignore[union-attr]
        self._pos += 1

    def _open(self, shard: int) -> None:
        self._close_file()
        self._shard = shard
        self._file = open(self.out_dir / self.files[shard], "wb")
        self._file.write(_header_bytes(self.shards[shard]))

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def close(self) -> None:
        """Finish the last shard and write the index (for more than one shard)."""
        self._close_file()
        if self._pos != len(self._queue):
            raise RuntimeError(f"only {self._pos} of {len(self._queue)} planned tensors written")
        if len(self.files) == 1:
            return
        weight_map = {t.name: f for f, ts in zip(self.files, self.shards, strict=True) for t in ts}
        total = sum(t.nbytes for ts in self.shards for t in ts)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2), encoding="utf-8")
