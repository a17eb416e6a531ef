"""Checkpoint conversion between Hugging Face (safetensors) and megatron-core (torch_dist).

Public API (the CLI is ``tools/convert_checkpoint.py``; layout in ``docs/conversion.md``)::

    hf_to_mcore(hf_dir, out_dir, *, dtype=None, verify=False, verify_tp=1, verify_tol=1e-3)
    mcore_to_hf(ckpt_dir, out_dir, *, dtype=None, hf_config_dir=None, model_config=None,
                family=None, max_shard_bytes=5 * 2**30, load_batch_bytes=2**30,
                verify=False, verify_tp=1, verify_tol=1e-3)
    verify_conversion(hf_dir, ckpt_dir, tp=1, weight_dtype=None) -> max |logit difference|
"""

import sys
import types
from typing import Any

from megatron_grpo.config.lazy import lazy_getattr

# Imported on first use (PEP 562): a recipe reads ``convert.layout`` / ``convert.hf_config``
# without the converters' megatron-core imports (``python -m megatron_grpo.train --check``).
_EXPORTS = {
    "ConversionError": "megatron_grpo.convert.errors",
    "FAMILIES": "megatron_grpo.convert.families",
    "hf_to_mcore": "megatron_grpo.convert.hf_to_mcore",
    "HF_ASSETS_DIR": "megatron_grpo.convert.layout",
    "MODEL_CONFIG_NAME": "megatron_grpo.convert.layout",
    "read_model_config": "megatron_grpo.convert.layout",
    "mcore_to_hf": "megatron_grpo.convert.mcore_to_hf",
    "verify_conversion": "megatron_grpo.convert.verify",
}


__all__ = [
    "FAMILIES",
    "HF_ASSETS_DIR",
    "MODEL_CONFIG_NAME",
    "ConversionError",
    "hf_to_mcore",
    "mcore_to_hf",
    "read_model_config",
    "verify_conversion",
]


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())  # imports on first use (PEP 562)


class _Package(types.ModuleType):
    """The functions ``hf_to_mcore`` / ``mcore_to_hf`` share their modules' names: the import
    system's binding of such a submodule to this package is skipped, so the name stays the
    function (as it was when this package imported them eagerly)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _EXPORTS:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
