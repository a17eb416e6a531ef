"""Convert checkpoints between Hugging Face (safetensors) and megatron-core (torch_dist).

    python tools/convert_checkpoint.py hf-to-mcore --hf DIR --out DIR [--dtype bfloat16]
                                                   [--verify [--tp 2]]
    python tools/convert_checkpoint.py mcore-to-hf --ckpt DIR --out DIR [--dtype bfloat16]
                                                   [--hf-config DIR] [--family NAME]
                                                   [--verify [--tp 2]]
    python tools/convert_checkpoint.py tiny-hf --family qwen3 --out DIR [--seed 0]

``tiny-hf`` writes a seeded random tiny HF model + chat tokenizer of a supported family: a
stand-in for a real model in docs and tests (``megatron_grpo/convert/tiny.py``).

Runs in one process (no torchrun); ``--verify`` spawns ``--tp`` processes. The layout of the
Megatron directory is described in docs/conversion.md.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

# Only this before main(): megatron-core's import warnings must reach the WarningLog (so must
# those of a --verify worker, which imports this file again as its main module).
from megatron_grpo.warning_log import WarningLog

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
    from megatron_grpo.convert import FAMILIES

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
    tiny = sub.add_parser("tiny-hf", help="a seeded random tiny HF model + tokenizer")
    tiny.add_argument("--family", required=True, choices=sorted(FAMILIES))
    tiny.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    tiny.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 an error (one ``error:`` line; nothing is written)."""
    # Our progress lines, bare; the libraries' warnings go to OUT.warnings.log beside the output
    # directory (count printed): an HF folder stays exactly what is uploaded.
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    with WarningLog() as log:
        args = build_parser().parse_args(argv)
        from megatron_grpo.convert import ConversionError

        _quiet_progress_bars()
        try:
            out = _run(args)
        except ConversionError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if log.count:
            log.attach(warnings_path(Path(out)))
            print(log.count_line())
    print(f"wrote {out}")
    return 0


def warnings_path(out: Path) -> Path:
    """``OUT.warnings.log``, beside the output directory ``OUT`` (never inside it)."""
    return out.parent / f"{out.resolve().name}.warnings.log"


def _quiet_progress_bars() -> None:
    """transformers' per-file progress bars (save, load) are noise for models of a few files."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # mcore-to-hf without --verify needs no transformers
        return
    hf_logging.disable_progress_bar()


def _run(args: argparse.Namespace) -> Path:
    from megatron_grpo.convert import hf_to_mcore, mcore_to_hf
    from megatron_grpo.convert.tiny import save_tiny_hf

    if args.command == "tiny-hf":
        return save_tiny_hf(args.family, args.out, args.seed)
    verify = dict(verify=args.verify, verify_tp=args.tp, verify_tol=args.verify_tol)
    if args.command == "hf-to-mcore":
        return hf_to_mcore(args.hf, args.out, dtype=args.dtype, **verify)
    return mcore_to_hf(
        args.ckpt,
        args.out,
        dtype=args.dtype,
        hf_config_dir=args.hf_config,
        model_config=args.model_config,
        family=args.family,
        max_shard_bytes=args.max_shard_size,
        **verify,
    )


if __name__ == "__main__":
    sys.exit(main())
