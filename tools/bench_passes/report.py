"""What the benchmark prints and writes: the rows' markdown table, the before/after comparison,
the profiles' kernel tables, the model line and the run's info (device, versions, git head)."""

from __future__ import annotations

import platform
import subprocess
import time
from pathlib import Path

from .dist import WORLD


def label(args, experts: str, rope: str) -> str:
    """A row's variant: the rope variant, prefixed with the expert implementation (--moe)."""
    return f"{experts}:{rope}" if args.moe else rope


def _g(v, spec=".3g") -> str:
    return "-" if v is None else format(v, spec)


def print_rows(rows: list[dict]) -> None:
    print("\n| L | docs/mb | rope | logprob ms | logprob tok/s | logprob MFU | logprob x floor "
          "| fwd+bwd ms | fwd+bwd tok/s | fwd+bwd MFU | fwd+bwd x floor | peak GiB logprob "
          "| peak GiB fwd+bwd |")  # fmt: skip
    print("|" + "---|" * 13)
    for r in rows:
        cells = [str(r["L"]), str(r["docs_per_mb"]), r["rope"]]
        for p in (r["logprob"], r["train"]):
            cells += [f"{p['ms']:.1f}", f"{p['tokens_per_s']:.4g}", f"{100 * p['mfu']:.3g}%",
                      f"{p['x_floor']:.2f}"]  # fmt: skip
        cells += [_g(r["logprob"]["peak_gib"], ".2f"), _g(r["train"]["peak_gib"], ".2f")]
        print("| " + " | ".join(cells) + " |", flush=True)


def print_row_line(row: dict) -> None:
    """The progress line of a row, printed as soon as it is measured."""
    print(
        f"L={row['L']} {row['rope']}: logprob {row['logprob']['ms']:.1f} ms, fwd+bwd "
        f"{row['train']['ms']:.1f} ms, loss {_g(row['loss'])}, log-probs vs the first "
        f"variant: max abs {row['logp_max_abs_vs_first']:.3g}",
        flush=True,
    )


def comparison(rows: list[dict], impls: list[str]) -> list[dict]:
    """Each impl after the first against the first (the "before"), per L and pass."""
    by = {(r["L"], r["rope"]): r for r in rows}
    out = []
    for L in dict.fromkeys(r["L"] for r in rows):
        before = by.get((L, impls[0]))
        for impl in impls[1:]:
            after = by.get((L, impl))
            if before is None or after is None:
                continue
            for name in ("logprob", "train"):
                b, a = before[name]["ms"], after[name]["ms"]
                out.append(dict(L=L, pass_=name, before=impls[0], after=impl, before_ms=b,
                                after_ms=a, ratio=a / b, speedup=b / a))  # fmt: skip
    return out


def print_comparison(comp: list[dict]) -> None:
    if not comp:
        return
    print("\n| L | pass | before | after | before ms | after ms | after/before | speedup |")
    print("|" + "---|" * 8)
    for c in comp:
        name = "fwd+bwd" if c["pass_"] == "train" else c["pass_"]
        print(f"| {c['L']} | {name} | {c['before']} | {c['after']} | {c['before_ms']:.1f} | "
              f"{c['after_ms']:.1f} | {c['ratio']:.3f} | {c['speedup']:.2f}x |")  # fmt: skip


def print_profile(r: dict, dev) -> None:
    unit, busy = ("kernels", "GPU") if dev.type == "cuda" else ("leaf CPU ops", "CPU ops")
    name = "fwd+bwd" if r["pass_"] == "train" else r["pass_"]
    print(
        f"\n== profile L={r['L']} rope={r['rope']} {name}: wall {r['wall_ms']:.1f} ms, "
        f"{busy} busy {r['busy_ms']:.1f} ms ({100 * r['busy_ms'] / r['wall_ms']:.0f}% of wall), "
        f"{r['launches']} {unit} + {r['memcpy_memset']} memcpy/memset; trace {r['trace']}"
    )
    print("| kernel | calls | total ms | % GPU time |\n|---|---|---|---|")
    for k in r["top"]:
        print(f"| `{k['name'][:100]}` | {k['calls']} | {k['ms']:.2f} | {k['pct']:.1f}% |")


def print_model(args, experts: str, model: dict) -> None:
    """The model line: shape, parameters, matmul weights per token, the run's layout."""
    moe = f", {args.num_experts} experts top-{args.topk} FFN {args.moe_ffn} ({experts})"
    matmul = model["decoder_matmul_params"] + model["head_params"]
    print(f"model: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, heads "
          f"{args.heads}/{args.kv_heads}x{args.head_dim}, vocab {args.vocab}"
          f"{moe if args.moe else ''}, {'tied' if args.tied else 'untied'}, "
          f"{model['dtype']}, {model['params'] / 1e6:.1f}M "
          f"params ({matmul / 1e6:.1f}M matmul per token incl. the head); "
          f"{args.micro_batches} x {args.tokens} tokens; TP {args.tp_size}"
          f"{' + SP' if args.tp_size > 1 else ''}; logprob_path {args.logprob_path}; "
          f"log-prob pass merged to {args.logprob_merge or 'no'} tokens; fwd+bwd without "
          "optimizer step", flush=True)  # fmt: skip


def _git_head() -> str | None:
    cmd = ["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def run_info(args, dev) -> dict:
    import megatron.core
    import torch
    import triton

    name = torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu"
    return dict(device=name, device_type=dev.type, args=vars(args), tp=args.tp_size,
                world_size=WORLD, torch=torch.__version__,
                megatron_core=megatron.core.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, git_head=_git_head(),
                time=time.strftime("%Y-%m-%d %H:%M:%S"))  # fmt: skip
