"""Checkpoint conversion between Hugging Face (safetensors) and megatron-core (torch_dist).

Public API (the CLI is ``tools/convert_checkpoint.py``; layout in ``docs/conversion.md``)::

    hf_to_mcore(hf_dir, out_dir, *, dtype=None, verify=False, verify_tp=1, verify_tol=1e-3)
    mcore_to_hf(ckpt_dir, out_dir, *, dtype=None, hf_config_dir=None, model_config=None,
                family=None, max_shard_bytes=5 * 2**30, load_batch_bytes=2**30,
                verify=False, verify_tp=1, verify_tol=1e-3)
    verify_conversion(hf_dir, ckpt_dir, tp=1, weight_dtype=None) -> max |logit difference|
"""

from megatron_grpo.convert.errors import ConversionError
from megatron_grpo.convert.families import FAMILIES
from megatron_grpo.convert.hf_to_mcore import hf_to_mcore
from megatron_grpo.convert.layout import HF_ASSETS_DIR, MODEL_CONFIG_NAME, read_model_config
from megatron_grpo.convert.mcore_to_hf import mcore_to_hf
from megatron_grpo.convert.verify import verify_conversion

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
