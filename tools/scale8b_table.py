"""The table of ``bash tools/gpu_e2e.sh scale8b`` (tools/gpu_scale8b.sh): per run directory
``scale8b_<row>_<path>`` under WORK, the means over steps >= 2 of the step split, tokens/s per
GPU (whole step and update) and the update's MFU per GPU.

MFU = model FLOPs of the update / (update seconds x GPUs x peak): per token 3 x forward, forward
= 2 x the matmul weights (decoder layers + LM head, every token; MoE: the active ones, router
and top-k experts) + causal attention 2 x 2 x heads x head_dim x (L + 1) / 2 per layer for
documents of L tokens (recompute not counted, as MFU conventions go). Usage::

    python tools/scale8b_table.py WORK OUT.md --gpus 4 [--peak-tflops 989]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Qwen3-8B (recipes/qwen3_8b_long_sp.yaml)
QWEN3_8B = dict(layers=36, hidden=4096, ffn=12288, heads=32, kv_heads=8, head_dim=128,
                vocab=151936)  # fmt: skip
# Qwen3-30B-A3B (recipes/qwen3_30b_a3b_moe.yaml): 128 experts, top-8, MoE in every layer
QWEN3_30B_A3B = dict(layers=48, hidden=2048, ffn=6144, heads=32, kv_heads=4, head_dim=128,
                     vocab=151936, experts=128, topk=8, moe_ffn=768)  # fmt: skip
# Document length (prompt + response) of each row of tools/gpu_scale8b.sh.
ROW_DOC_TOKENS = {"a": 264 + 1024, "b": 2048 + 30720, "c": 256 + 3840}
STAGES = ("step", "rollout", "logprob", "update")


def matmul_params(m: dict) -> int:
    """Matmul weights a token meets: per layer QKV, output projection and the SwiGLU MLP, or
    with ``experts`` (MoE in every layer) the router and ``topk`` experts' SwiGLU of width
    ``moe_ffn`` (the active weights); the LM head."""
    h, d = m["hidden"], m["head_dim"]
    attn = h * (m["heads"] + 2 * m["kv_heads"]) * d + m["heads"] * d * h
    if m.get("experts"):
        mlp = h * m["experts"] + m["topk"] * 3 * h * m["moe_ffn"]
    else:
        mlp = 3 * h * m["ffn"]
    return m["layers"] * (attn + mlp) + m["vocab"] * h


def train_flops_per_token(m: dict, doc_tokens: int) -> float:
    """Forward + backward model FLOPs per token of documents of ``doc_tokens`` tokens."""
    attention = 2 * 2 * m["heads"] * m["head_dim"] * (doc_tokens + 1) / 2 * m["layers"]
    return 3 * (2 * matmul_params(m) + attention)


def mfu(tokens_per_s: float, doc_tokens: int, gpus: int, peak_tflops: float, m=QWEN3_8B) -> float:
    """Model FLOP utilization per GPU of ``tokens_per_s`` tokens/s over ``gpus`` GPUs."""
    if gpus < 1 or peak_tflops <= 0:
        raise ValueError(f"gpus and peak_tflops must be positive, got {gpus}, {peak_tflops}")
    return tokens_per_s * train_flops_per_token(m, doc_tokens) / (gpus * peak_tflops * 1e12)


def _mean(steps: list[dict], key: str) -> float | None:
    values = [s[key] for s in steps if s.get(key) is not None]
    return sum(values) / len(values) if values else None


def row(run: Path, gpus: int, peak: float) -> dict:
    """One run's means over steps >= 2 (step 1 is warm-up)."""
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][1:]
    tag = run.name.split("_")[1]
    out = {"row": tag, "run": run.name, "steps": len(steps)}
    out.update({k: _mean(steps, f"perf/{k}_seconds") for k in STAGES})
    tps, train = _mean(steps, "perf/tokens_per_s"), _mean(steps, "perf/train_tokens_per_s")
    out["tok_s_gpu"] = None if tps is None else tps / gpus
    out["train_tok_s_gpu"] = None if train is None else train / gpus
    doc = ROW_DOC_TOKENS.get(tag)
    out["update_mfu"] = None if train is None or doc is None else mfu(train, doc, gpus, peak)
    out["peak_gib"] = _mean(steps, "perf/peak_memory_gib")
    return out


def table(rows: list[dict]) -> str:
    def fmt(v, spec=".2f"):
        return "n/a" if v is None else format(v, spec)

    lines = [
        "| row | steps (after warm-up) | step s | rollout s | log-prob s | update s | "
        "tok/s/GPU (step) | tok/s/GPU (update) | update MFU | peak GiB |",
        "|---" * 10 + "|",
    ]
    for r in rows:
        cells = [r["row"], r["steps"], *(fmt(r[k]) for k in STAGES), fmt(r["tok_s_gpu"], ".0f"),
                 fmt(r["train_tok_s_gpu"], ".0f"), fmt(r["update_mfu"], ".3f"),
                 fmt(r["peak_gib"], ".1f")]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "## Qwen3-8B on 4 GPUs (TP4 + SP)\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    a = ap.parse_args(argv)
    runs = sorted(p for p in a.work.glob("scale8b_*_*") if (p / "metrics.jsonl").exists())
    text = table([row(p, a.gpus, a.peak_tflops) for p in runs])
    a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
