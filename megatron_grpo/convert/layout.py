"""Checkpoint directory layout shared by the importer, the exporter and the trainer.

::

    CKPT/                       a megatron-core torch_dist checkpoint ...
      metadata.json .metadata __0_*.distcp common.pt
      model_config.yaml         ... plus the ModelConfig that built it (``model:`` section)
      hf/                       the source HF config.json, tokenizer and generation files
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from megatron_grpo.config import ConfigError, from_dict, load_yaml, to_dict
from megatron_grpo.convert.errors import ConversionError
from megatron_grpo.convert.hf_config import check_same_architecture
from megatron_grpo.megatron.config import ModelConfig

MODEL_CONFIG_NAME = "model_config.yaml"
HF_ASSETS_DIR = "hf"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Not the model's: the warnings a conversion of it logged (megatron_grpo/warning_log.py).
_NOT_ASSETS = (*_WEIGHT_INDEXES, "warnings.log")


def write_model_config(ckpt_dir: Path, model_cfg: ModelConfig) -> None:
    text = yaml.safe_dump(to_dict(model_cfg), sort_keys=False)
    (ckpt_dir / MODEL_CONFIG_NAME).write_text(text, encoding="utf-8")


def read_model_config(path: Path) -> ModelConfig:
    """A ModelConfig from ``model_config.yaml`` (or a recipe with a ``model:`` section)."""
    if not path.is_file():
        raise ConversionError(f"{path}: missing; pass --model-config with the model's config")
    data = load_yaml(path)
    if "model" in data and isinstance(data["model"], dict):
        data = data["model"]
    try:
        return from_dict(ModelConfig, data)
    except ConfigError as e:
        raise ConversionError(f"{path}: {e}") from e


def copy_hf_assets(src: Path, dst: Path) -> None:
    """Copy the non-weight files of an HF directory (config, tokenizer, generation config)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _NOT_ASSETS:
            shutil.copy2(f, dst / f.name)


def check_checkpoint_architecture(
    model: ModelConfig, ckpt_dir: str, stored: ModelConfig | None = None
) -> None:
    """Raise a ConfigError naming the field when ``ckpt_dir``'s ``model_config.yaml`` (if any)
    describes another architecture than ``model``."""
    stored = stored if stored is not None else stored_model_config(ckpt_dir)
    if stored is None:
        return
    try:
        check_same_architecture(stored, model, "model")
    except ConversionError as e:
        raise ConfigError(f"{e} (in {Path(ckpt_dir) / MODEL_CONFIG_NAME})") from e


def stored_model_config(load: str) -> ModelConfig | None:
    """The ModelConfig saved next to a converted checkpoint, or None when there is none."""
    path = Path(load) / MODEL_CONFIG_NAME
    if not path.is_file():
        return None
    try:
        return read_model_config(path)
    except ConversionError as e:
        raise ConfigError(f"checkpoint.load: {e}") from e
