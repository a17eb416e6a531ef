"""The table of ``bash tools/gpu_e2e.sh full8`` (tools/gpu_full8.sh): per run directory
``full8_<row>_<path>`` under WORK (its ``metrics.jsonl`` and the trainer's resolved
``config.yaml``), the means over steps >= 2 of the step split and tokens/s per GPU (whole step
and update), the update's MFU per GPU (tools/scale8b_table.py's FLOPs: for MoE the active
weights, router and top-k experts), the measured peak per rank (the trainer's
``perf/peak_memory_gib``, torch's max_memory_allocated, the max over ranks and steps) next to the
dry run's planned peak per rank for the same config (tools/full8_plan.py) and nvidia-smi's
largest memory.used of a GPU (``WORK/<run>.smi``, when sampled). The model shape, layout and
document length (prompt + response maximum: synthetic and ignore_eos rollouts are that long)
come from each run's config.yaml. Usage::

    python tools/full8_table.py WORK OUT.md --gpus 8 --device-memory-gib 79.1 [--peak-tflops 989]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import full8_plan  # noqa: E402
import scale8b_table as st  # noqa: E402


def model_shape(model: dict) -> dict:
    """tools/scale8b_table.py's shape dict of a config.yaml ``model`` section."""
    shape = dict(
        layers=model["num_layers"],
        hidden=model["hidden_size"],
        ffn=model["ffn_hidden_size"],
        heads=model["num_attention_heads"],
        kv_heads=model.get("num_query_groups") or model["num_attention_heads"],
        head_dim=model.get("kv_channels") or model["hidden_size"] // model["num_attention_heads"],
        vocab=model["vocab_size"],
    )
    if model.get("num_moe_experts"):
        shape.update(
            experts=model["num_moe_experts"],
            topk=model["moe_router_topk"],
            moe_ffn=model.get("moe_ffn_hidden_size") or model["ffn_hidden_size"],
        )
    return shape


def layout(parallel: dict, gpus: int) -> str:
    """``TP2+SP DP4 EP8`` of a config.yaml ``parallel`` section on ``gpus`` ranks."""
    tp, pp = parallel["tensor_model_parallel_size"], parallel["pipeline_model_parallel_size"]
    dp = gpus // (tp * pp * parallel["context_parallel_size"])
    text = f"TP{tp}{'+SP' if parallel['sequence_parallel'] else ''}"
    text += f" PP{pp}" if pp > 1 else ""
    text += f" DP{dp}"
    ep = parallel["expert_model_parallel_size"]
    return text + (f" EP{ep}" if ep > 1 else "")


def smi_peak_mib(run: Path) -> int | None:
    """The largest memory.used (MiB) of any GPU that nvidia-smi sampled during ``run``."""
    smi = run.parent / f"{run.name}.smi"
    used = [int(x) for x in smi.read_text().split() if x.isdigit()] if smi.exists() else []
    return max(used) if used else None


def row(run: Path, gpus: int, peak_tflops: float, device_gib: float) -> dict:
    """One run's cells (means over steps >= 2: step 1 is warm-up)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    every = [json.loads(x) for x in lines]
    steps = every[1:]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    shape = model_shape(cfg["model"])
    doc = cfg["rollout"]["max_prompt_length"] + cfg["rollout"]["max_response_length"]
    out = {"row": run.name[len("full8_") :].rsplit("_", 1)[0], "steps": len(steps)}
    out["layout"] = layout(cfg["parallel"], gpus)
    out["layers"] = shape["layers"]
    out.update({k: st._mean(steps, f"perf/{k}_seconds") for k in st.STAGES})
    tps, train = st._mean(steps, "perf/tokens_per_s"), st._mean(steps, "perf/train_tokens_per_s")
    out["tok_s_gpu"] = None if tps is None else tps / gpus
    out["train_tok_s_gpu"] = None if train is None else train / gpus
    out["update_mfu"] = None if train is None else st.mfu(train, doc, gpus, peak_tflops, shape)
    peaks = [s["perf/peak_memory_gib"] for s in every if s.get("perf/peak_memory_gib")]
    out["peak_gib"] = max(peaks) if peaks else None
    plan = full8_plan.plan(run / "config.yaml", [], gpus, device_gib)
    out["plan_gib"], out["recompute"] = plan.peak_gib, plan.recompute
    out["smi_mib"] = smi_peak_mib(run)
    return out


def table(rows: list[dict], gpus: int) -> str:
    def fmt(v, spec=".2f"):
        return "n/a" if v is None else format(v, spec)

    lines = [
        "| row | layout | layers | steps (after warm-up) | step s | rollout s | log-prob s | "
        "update s | tok/s/GPU (step) | tok/s/GPU (update) | update MFU | peak GiB (torch, max) "
        "| planned peak GiB | nvidia-smi MiB | recompute |",
        "|---" * 15 + "|",
    ]
    for r in rows:
        cells = [r["row"], r["layout"], r["layers"], r["steps"],
                 *(fmt(r[k]) for k in st.STAGES), fmt(r["tok_s_gpu"], ".0f"),
                 fmt(r["train_tok_s_gpu"], ".0f"), fmt(r["update_mfu"], ".3f"),
                 fmt(r["peak_gib"], ".1f"), fmt(r["plan_gib"], ".1f"),
                 fmt(r["smi_mib"], "d"), r["recompute"]]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return f"## Issue 40's runs on {gpus} GPUs\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--device-memory-gib", type=float, required=True)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    a = ap.parse_args(argv)
    runs = sorted(p for p in a.work.glob("full8_*_*") if (p / "metrics.jsonl").exists())
    rows = [row(p, a.gpus, a.peak_tflops, a.device_memory_gib) for p in runs]
    text = table(rows, a.gpus)
    a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
