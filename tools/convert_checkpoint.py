"""Convert checkpoints between Hugging Face (safetensors) and megatron-core (torch_dist).

    python tools/convert_checkpoint.py hf-to-mcore --hf DIR --out DIR [--dtype bfloat16]
                                                   [--verify [--tp 2]]
    python tools/convert_checkpoint.py mcore-to-hf --ckpt DIR --out DIR [--dtype bfloat16]
                                                   [--hf-config DIR] [--family NAME]
                                                   [--verify [--tp 2]]

Runs in one process (no torchrun); ``--verify`` spawns ``--tp`` processes. The layout of the
Megatron directory is described in docs/conversion.md.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys

from megatron_grpo.convert import FAMILIES, ConversionError, hf_to_mcore, mcore_to_hf

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20}
_UNITS["GIB"] = 2**30


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"`` or a byte count -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="dtype of the written tensors (default: the source's); --verify then compares both "
        "models with their weights rounded to it, so only the conversion is measured",
    )
    p.add_argument("--verify", action="store_true", help="compare logits with transformers")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size for --verify")
    p.add_argument("--verify-tol", type=float, default=1e-3, help="max |logit diff| for --verify")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("hf-to-mcore", help="HF safetensors -> torch_dist checkpoint")
    imp.add_argument("--hf", required=True, help="HF checkpoint directory")
    _add_common(imp)
    exp = sub.add_parser("mcore-to-hf", help="torch_dist checkpoint -> HF safetensors")
    exp.add_argument("--ckpt", required=True, help="torch_dist checkpoint directory")
    exp.add_argument("--hf-config", help="HF config.json + tokenizer dir (default: CKPT/hf)")
    exp.add_argument("--model-config", help="ModelConfig YAML (default: CKPT/model_config.yaml)")
    exp.add_argument("--family", choices=sorted(FAMILIES), help="when no HF config.json exists")
    exp.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"))
    _add_common(exp)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    verify = dict(verify=args.verify, verify_tp=args.tp, verify_tol=args.verify_tol)
    try:
        if args.command == "hf-to-mcore":
            out = hf_to_mcore(args.hf, args.out, dtype=args.dtype, **verify)
        else:
            out = mcore_to_hf(
                args.ckpt,
                args.out,
                dtype=args.dtype,
                hf_config_dir=args.hf_config,
                model_config=args.model_config,
                family=args.family,
                max_shard_bytes=args.max_shard_size,
                **verify,
            )
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
