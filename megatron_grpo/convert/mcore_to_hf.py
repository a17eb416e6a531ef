"""megatron-core torch_dist checkpoint -> HF safetensors (+ config.json and tokenizer files)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_grpo.convert.errors import ConversionError
from megatron_grpo.convert.families import FAMILIES, Family, Rule
from megatron_grpo.convert.hf_config import (
    check_same_architecture,
    hf_config_from_model,
    model_config_from_hf,
    read_hf_config,
)
from megatron_grpo.convert.hf_to_mcore import DTYPES, layout_info
from megatron_grpo.convert.layout import (
    HF_ASSETS_DIR,
    MODEL_CONFIG_NAME,
    copy_hf_assets,
    read_model_config,
)
from megatron_grpo.convert.mcore_io import (
    Entries,
    StoredTensor,
    checkpoint_entries,
    load_tensors,
    meta_model,
    single_process_megatron,
    stored_tensors,
)
from megatron_grpo.convert.outdir import atomic_output_dir
from megatron_grpo.convert.safetensors_io import PlannedTensor, SafetensorsWriter
from megatron_grpo.convert.transforms import LayoutInfo
from megatron_grpo.megatron.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportItem:
    """Megatron entry ``name`` becomes HF tensors ``outputs`` through ``rule.transform``."""

    name: str
    rule: Rule
    outputs: list[PlannedTensor]
    nbytes: int


def plan_export(
    tensors: Entries,
    family: Family,
    info: LayoutInfo,
    stored: dict[str, StoredTensor],
    out_dtype: torch.dtype | None,
) -> list[ExportItem]:
    """HF names, shapes and dtypes of every output tensor, from meta tensors (no data read)."""
    items = []
    for name, parts in tensors.items():
        rule, fields = family.rule_for(name)
        for p in parts:
            _check_stored(p, stored.get(p.key), name, info)
        dtypes = [stored[p.key].dtype for p in parts]
        metas = [torch.empty(p.local_shape, device="meta") for p in parts]
        shapes = [tuple(t.shape) for t in rule.transform.to_hf(metas, info)]
        outputs = [
            PlannedTensor(hf, shape, out_dtype or dtypes[0])
            for hf, shape in zip(rule.hf_names(fields), shapes, strict=True)
        ]
        nbytes = sum(
            math.prod(p.local_shape) * d.itemsize for p, d in zip(parts, dtypes, strict=True)
        )
        items.append(ExportItem(name, rule, outputs, nbytes))
    return items


def _check_stored(part, stored: StoredTensor | None, name: str, info: LayoutInfo) -> None:
    """The checkpoint must hold ``part``'s tensor with the shape the model config implies
    (the vocabulary may be padded differently, e.g. for another TP, but not truncated)."""
    hint = "was the checkpoint written for a different model config?"
    if stored is None:
        raise ConversionError(f"the checkpoint has no tensor '{part.key}' (for {name}); {hint}")
    expected = tuple(part.global_shape)
    if part.allow_shape_mismatch:
        ok = stored.shape[1:] == expected[1:] and stored.shape[0] >= info.vocab_size
    else:
        ok = stored.shape == expected
    if not ok:
        raise ConversionError(
            f"checkpoint tensor '{part.key}' has shape {stored.shape}, the model config implies "
            f"{expected}; {hint}"
        )


def _batches(items: list[ExportItem], budget: int) -> list[list[ExportItem]]:
    """Consecutive items whose stored bytes stay within ``budget`` (one load call each)."""
    batches: list[list[ExportItem]] = [[]]
    size = 0
    for item in items:
        if batches[-1] and size + item.nbytes > budget:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += item.nbytes
    return batches


def _resolve_family(
    model_cfg: ModelConfig, hf_config_dir: Path | None, family_name: str | None
) -> tuple[Family, dict | None]:
    """The family and the HF config.json (None: generate one) of the export."""
    if hf_config_dir is not None and (hf_config_dir / "config.json").is_file():
        hf_cfg, family = read_hf_config(hf_config_dir)
        if family_name is not None and family_name != family.name:
            raise ConversionError(f"--family {family_name} contradicts {hf_config_dir}/config.json")
        what = f"{hf_config_dir / 'config.json'} vs {MODEL_CONFIG_NAME}"
        check_same_architecture(model_cfg, model_config_from_hf(hf_cfg, family), what)
        return family, json.loads((hf_config_dir / "config.json").read_text(encoding="utf-8"))
    if family_name is None:
        raise ConversionError(
            "no HF config.json (neither CKPT/hf/ nor --hf-config); pass --family to generate one"
        )
    if family_name not in FAMILIES:
        raise ConversionError(f"--family must be one of {sorted(FAMILIES)}, got {family_name!r}")
    return FAMILIES[family_name], None


def _write_config(out: Path, config: dict, dtype: torch.dtype) -> None:
    # transformers 5 writes "dtype", 4.x "torch_dtype"; update whichever the config uses.
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for key in keys:
        config[key] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _write_tensors(ckpt, tmp, tensors, items, info, max_shard_bytes, load_batch_bytes) -> None:
    """The planned HF tensors into safetensors shards, ``load_batch_bytes`` of Megatron tensors
    read at a time."""
    writer = SafetensorsWriter(tmp, [o for it in items for o in it.outputs], max_shard_bytes)
    for batch in _batches(items, load_batch_bytes):
        loaded = load_tensors(ckpt, tensors, [it.name for it in batch])
        for item in batch:
            hf = item.rule.transform.to_hf(loaded.pop(item.name), info)
            for planned, t in zip(item.outputs, hf, strict=True):
                writer.write(planned.name, t.to(planned.dtype))
    writer.close()


def mcore_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    hf_config_dir: str | Path | None = None,
    model_config: str | Path | None = None,
    family: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    load_batch_bytes: int = 2**30,
    verify: bool = False,
    verify_tp: int = 1,
    verify_tol: float = 1e-3,
) -> Path:
    """Convert a torch_dist checkpoint (any TP/PP/EP it was saved at) into an HF directory.

    Args:
        dtype: output dtype ("float32", "bfloat16", "float16"); default: the stored dtype.
        hf_config_dir: where the HF config.json and tokenizer files come from (default
            ``CKPT/hf``); its architecture must match the checkpoint's model config.
        model_config: the ModelConfig YAML (default ``CKPT/model_config.yaml``).
        family: HF family (llama, mistral, qwen2, qwen3, qwen3_moe) when no config.json exists.
        max_shard_bytes: size limit of one output safetensors shard.
        load_batch_bytes: bytes of Megatron tensors loaded per read; peak memory is about
            this or the largest tensor, whichever is larger.
        verify: compare logits of the exported model (transformers) and of the checkpoint
            (Megatron at tensor-parallel size ``verify_tp``, fp32; with ``dtype``, the Megatron
            weights rounded to it first) before publishing ``out_dir``; a difference above
            ``verify_tol`` is an error.

    Returns the output directory. On any error nothing is left at ``out_dir``.
    """
    ckpt = Path(ckpt_dir)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    model_cfg = read_model_config(Path(model_config or ckpt / MODEL_CONFIG_NAME))
    assets = Path(hf_config_dir) if hf_config_dir is not None else ckpt / HF_ASSETS_DIR
    fam, config = _resolve_family(model_cfg, assets, family)
    stored = stored_tensors(ckpt)
    info = layout_info(model_cfg)
    with atomic_output_dir(out_dir) as tmp, single_process_megatron():
        tensors, _ = checkpoint_entries(meta_model(model_cfg))
        items = plan_export(tensors, fam, info, stored, DTYPES.get(dtype or ""))
        _write_tensors(ckpt, tmp, tensors, items, info, max_shard_bytes, load_batch_bytes)
        if assets.is_dir():
            copy_hf_assets(assets, tmp)
        out_dtype = items[0].outputs[0].dtype
        _write_config(tmp, config or hf_config_from_model(model_cfg, fam), out_dtype)
        if verify:
            from megatron_grpo.convert.verify import check_logits

            # the exported weights are the checkpoint's cast to --dtype: Megatron's are rounded
            # the same way, so the difference is the conversion's, not the cast's
            check_logits(tmp, ckpt, verify_tp, verify_tol, DTYPES.get(dtype or ""))
    log.info("wrote %d HF tensors to %s", sum(len(it.outputs) for it in items), out_dir)
    return Path(out_dir)
