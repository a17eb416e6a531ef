"""HF safetensors -> megatron-core torch_dist checkpoint (+ model_config.yaml, hf/ assets)."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_grpo.convert.errors import ConversionError
from megatron_grpo.convert.families import Family, Rule
from megatron_grpo.convert.hf_config import model_config_from_hf, read_hf_config
from megatron_grpo.convert.layout import HF_ASSETS_DIR, copy_hf_assets, write_model_config
from megatron_grpo.convert.mcore_io import (
    Entries,
    checkpoint_entries,
    meta_model,
    save_checkpoint,
    set_data,
    single_process_megatron,
)
from megatron_grpo.convert.outdir import atomic_output_dir
from megatron_grpo.convert.safetensors_io import SafetensorsReader
from megatron_grpo.convert.transforms import LayoutInfo
from megatron_grpo.megatron.config import ModelConfig
from megatron_grpo.megatron.model.build import padded_vocab_size

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layout_info(model_cfg: ModelConfig) -> LayoutInfo:
    """The transforms' sizes; the checkpoint holds the TP=1 padded vocabulary."""
    return LayoutInfo(
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups or model_cfg.num_attention_heads,
        head_dim=model_cfg.head_dim,
        vocab_size=model_cfg.vocab_size,
        padded_vocab_size=padded_vocab_size(model_cfg, 1),
    )


@dataclass(frozen=True)
class ImportItem:
    """Megatron entry ``name`` is made from HF tensors ``hf_names`` by ``rule.transform``."""

    name: str
    rule: Rule
    hf_names: list[str]


def _check_shapes(item: ImportItem, parts: list, reader: SafetensorsReader, info: LayoutInfo):
    """Run the transform on meta tensors: shape errors surface before any data is read."""
    metas = [torch.empty(reader.infos[n].shape, device="meta") for n in item.hf_names]
    try:
        outs = item.rule.transform.to_mcore(metas, info, len(parts))
    except ConversionError as e:
        raise ConversionError(f"{', '.join(item.hf_names)}: {e}") from e
    for out, part in zip(outs, parts, strict=True):
        if tuple(out.shape) != tuple(part.local_shape):
            shapes = [reader.infos[n].shape for n in item.hf_names]
            raise ConversionError(
                f"{', '.join(item.hf_names)} with shape(s) {shapes} give {tuple(out.shape)} for "
                f"Megatron {item.name}, but config.json implies {tuple(part.local_shape)}"
            )


def plan_import(
    tensors: Entries, family: Family, reader: SafetensorsReader, info: LayoutInfo, tied: bool
) -> list[ImportItem]:
    """Map every Megatron entry to its HF tensors; every HF tensor must be used exactly once."""
    items, used = [], set()
    for name, parts in tensors.items():
        rule, fields = family.rule_for(name)
        item = ImportItem(name, rule, rule.hf_names(fields))
        missing = [n for n in item.hf_names if n not in reader]
        if missing:
            raise ConversionError(f"missing HF tensor(s) {missing} (for Megatron {name})")
        _check_shapes(item, parts, reader, info)
        used.update(item.hf_names)
        items.append(item)
    unused = [
        n
        for n in reader.names()
        if n not in used and not family.is_ignored(n) and not (tied and n == "lm_head.weight")
    ]
    if unused:
        shown = ", ".join(unused[:6]) + (", ..." if len(unused) > 6 else "")
        raise ConversionError(
            f"{len(unused)} HF tensor(s) have no Megatron counterpart: {shown} (a feature the "
            f"{family.name} map does not support, or config.json disagrees with the weights)"
        )
    return items


class StagingFile:
    """Append-only scratch file for transformed tensors, handed back memory-mapped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "wb")

    def put(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().contiguous()
        if t.numel() == 0:
            return t
        self._file.write(b"\0" * (-self._file.tell() % 64))
        offset = self._file.tell()
        self._file.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._file.flush()
        raw = np.memmap(self.path, dtype=np.uint8, mode="c", offset=offset, shape=(t.nbytes,))
        return torch.from_numpy(raw).view(t.dtype).reshape(t.shape)

    def close(self) -> None:
        self._file.close()


@contextlib.contextmanager
def staging_file(parent: Path) -> Iterator[StagingFile]:
    tmp = Path(tempfile.mkdtemp(prefix=".convert-staging-", dir=parent))
    staging = StagingFile(tmp / "tensors.bin")
    try:
        yield staging
    finally:
        staging.close()
        shutil.rmtree(tmp, ignore_errors=True)


def fill_entries(
    items: list[ImportItem],
    tensors: Entries,
    reader: SafetensorsReader,
    info: LayoutInfo,
    dtype: torch.dtype | None,
    staging: StagingFile,
) -> None:
    """Set each ShardedTensor's data: HF memory maps as-is, transformed tensors via staging."""
    for item in items:
        hf = [reader.get(n) for n in item.hf_names]
        cast = [t if dtype is None or t.dtype == dtype else t.to(dtype) for t in hf]
        parts = item.rule.transform.to_mcore(cast, info, len(tensors[item.name]))
        for sharded, part in zip(tensors[item.name], parts, strict=True):
            set_data(sharded, part if any(part is t for t in hf) else staging.put(part))


def hf_to_mcore(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    verify: bool = False,
    verify_tp: int = 1,
    verify_tol: float = 1e-3,
) -> Path:
    """Convert the HF checkpoint in ``hf_dir`` into a torch_dist checkpoint at ``out_dir``.

    Args:
        dtype: tensor dtype in the checkpoint ("float32", "bfloat16", "float16"); default: keep
            each HF tensor's dtype.
        verify: compare logits of transformers and of the converted Megatron model (at
            tensor-parallel size ``verify_tp``, fp32; with ``dtype``, the transformers weights
            rounded to it as well) before publishing ``out_dir``; a max absolute difference above
            ``verify_tol`` is an error.

    Returns the output directory. On any error nothing is left at ``out_dir``.
    """
    hf_dir = Path(hf_dir)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    hf_cfg, family = read_hf_config(hf_dir)
    model_cfg = model_config_from_hf(hf_cfg, family)
    reader = SafetensorsReader(hf_dir)
    info = layout_info(model_cfg)
    with atomic_output_dir(out_dir) as tmp, single_process_megatron():
        tensors, others = checkpoint_entries(meta_model(model_cfg))
        tied = model_cfg.share_embeddings_and_output_weights
        items = plan_import(tensors, family, reader, info, tied)
        with staging_file(tmp.parent) as staging:
            fill_entries(items, tensors, reader, info, DTYPES.get(dtype or ""), staging)
            log.info("writing %d tensors to %s", len(items), out_dir)
            save_checkpoint(tensors, others, tmp)
        del tensors
        write_model_config(tmp, model_cfg)
        copy_hf_assets(hf_dir, tmp / HF_ASSETS_DIR)
        if verify:
            from megatron_grpo.convert.verify import check_logits

            # against transformers with the weights as the checkpoint holds them (--dtype)
            check_logits(hf_dir, tmp, verify_tp, verify_tol, DTYPES.get(dtype or ""))
    return Path(out_dir)
