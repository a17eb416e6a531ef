"""The reports of tools/bench_logprobs.py: the targets, the verdicts against them, the tables on
stdout (per method as it finishes, the single-GPU summary, the TP table) and the JSON files.

Pure formatting of the result dicts the harness builds (``run_method``'s keys: ``ms``,
``floor_ms``, ``peak_extra_gib``, ``over_grads_gib``, errors vs the fp32 reference, the plan's
``path`` / ``plan``); nothing here runs a method. Imported by the harness the way it imports
``bench_methods`` (the script's folder is on ``sys.path``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TARGETS = {"fused_ratio": 1.10, "op_ratio": 1.40, "over_grads_gib": 0.5, "logp": 1e-4, "grad": 2e-3}
TP_TARGETS = {2: 0.97, 4: 0.93}

# ----------------------------------------------------------------------------- single GPU


def annotate(results: dict) -> None:
    """Ratio to the floor and the issue's targets (PASS / MISS by how much)."""
    for res in results.values():
        run_floor = res.get("floor", {}).get("ms")
        for name, r in res.items():
            if name in ("floor", "gemm_options") or "ms" not in r:
                continue
            checks = []
            floor = r.get("floor_ms", run_floor)  # the floor timed around this method
            if floor:
                r["x_floor"] = r["ms"] / floor
                lim = TARGETS["fused_ratio"] if name.startswith("fused") else TARGETS["op_ratio"]
                if name in ("triton", "torch", "fused_grpo", "triton_entropy"):
                    checks.append(("x_floor", r["x_floor"], lim))
            if name in ("triton", "fused_grpo", "triton_entropy", "torch"):
                checks += [("over_grads_gib", r.get("over_grads_gib"), TARGETS["over_grads_gib"]),
                           ("logp_max_abs", r.get("logp_max_abs"), TARGETS["logp"]),
                           ("dh_rel", r.get("dh_rel"), TARGETS["grad"]),
                           ("dw_rel", r.get("dw_rel"), TARGETS["grad"])]  # fmt: skip
            r["targets"] = {
                k: ("PASS" if v <= lim else f"MISS by {v / lim:.2f}x") + f" ({v:.3g} vs {lim:g})"
                for k, v, lim in checks
                if v is not None
            }


def _fmt(v, spec=".3g") -> str:
    return "-" if v is None else format(v, spec)


def print_row(T, name: str, r: dict, floor: dict | None) -> None:
    if "error" in r:
        print(f"T={T:<6} {name:<20} ERROR {r['error']}", flush=True)
        return
    base = r.get("floor_ms", floor.get("ms") if floor else None)
    x = r["ms"] / base if base else None
    print(
        f"T={T:<6} {name:<20} {r['ms']:9.2f} ms  x{_fmt(x, '.3f'):>6}  "
        f"peak {_fmt(r.get('peak_extra_gib'), '.2f'):>6} GiB (over grads "
        f"{_fmt(r.get('over_grads_gib'), '.2f')})  logp {_fmt(r.get('logp_max_abs'))}  "
        f"dh {_fmt(r.get('dh_rel'))}  dw {_fmt(r.get('dw_rel'))}"
        + (f"  [{r['path']}]" if "path" in r else ""),
        flush=True,
    )
    if "plan" in r:
        print(f"{'':<28}plan: {r['plan']}", flush=True)


def print_summary(results: dict, main_grad: bool) -> None:
    counted = "h.grad; fp32 w.main_grad preallocated" if main_grad else "h.grad + w.grad"
    print("\n== summary (ms fwd+bwd; x floor; peak extra GiB incl. grads; errors vs fp32 ref)")
    print(f"== gradients counted in 'over grads': {counted}")
    for T, res in results.items():
        for name, r in res.items():
            if name != "gemm_options":
                print_row(T, name, r, res.get("floor"))
                for k, v in r.get("targets", {}).items():
                    print(f"{'':<28}target {k}: {v}")
        for name, r in res.get("gemm_options", {}).items():
            line = (
                r.get("error")
                or f"{r['ms']:8.3f} ms {r['tflops']:6.0f} TF/s  rel_err {r['rel_err']:.2e}"
            )
            print(f"T={T:<6} gemm {name:<48} {line}")


# ----------------------------------------------------------------------------- tensor parallel


_CMP_KEYS = ("logp_vs_tp1", "dh_vs_tp1", "dw_vs_tp1")


def print_tp(rows: list[dict]) -> None:
    print(f"{'T':>6} {'TP':>3} {'method':<16} {'TP1 ms':>9} {'per-GPU ms':>11} {'TP1/TP':>8} "
          f"{'eff (min rank)':>14}  target  logp/dh/dw vs TP1")  # fmt: skip
    keys = sorted({(r["T"], r["method"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for T, name in keys:
        rs = [r for r in rows if r["T"] == T and r["method"] == name]
        errs = [r["tpn"].get("error") or r["tp1"].get("error") for r in rs]
        if any(errs):
            print(f"{T:>6} {rs[0]['tp']:>3} {name:<16} ERROR {next(e for e in errs if e)}")
            continue
        tp = rs[0]["tp"]
        ms1 = max(r["tp1"]["ms"] for r in rs)
        msn = max(r["tpn"]["ms"] for r in rs)  # a TP step is as slow as its slowest rank
        eff = ms1 / tp / msn
        lim = TP_TARGETS.get(tp)
        verdict = "-" if lim is None else ("PASS" if eff >= lim else f"MISS({lim:.0%})")
        cmp = [max(r["tpn"].get(k, -1.0) for r in rs) for k in _CMP_KEYS]
        path = rs[0]["tpn"].get("path")
        paths = "" if path is None else f"  [TP1 {rs[0]['tp1']['path']}; TP{tp} {path}]"
        print(f"{T:>6} {tp:>3} {name:<16} {ms1:9.2f} {msn:11.2f} {ms1 / tp:8.2f} {eff:14.1%}  "
              f"{verdict:<6}  {'/'.join('-' if c < 0 else f'{c:.2g}' for c in cmp)}{paths}")  # fmt: skip


# ----------------------------------------------------------------------------- JSON


def run_info(args, dev) -> dict:
    """The JSON's "info": the arguments, the torch / Triton versions, the device (and GPU)."""
    info = {"args": vars(args), "torch": torch.__version__, "device": str(dev)}
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def jsonable(obj):
    """`obj` without the keys starting with "_" (tensors kept for comparisons), recursively."""
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [jsonable(v) for v in obj]
    return obj


def write_single(path: Path, info: dict, results: dict) -> None:
    """The single-GPU run's JSON: run info, the targets, the results per T and method."""
    doc = {"info": info, "targets": TARGETS, "results": jsonable(results)}
    path.write_text(json.dumps(doc, indent=1))


def write_tp(path: Path, info: dict, rows: list[dict]) -> None:
    """The TP run's JSON: run info, the TP efficiency targets, the rows of every rank."""
    doc = {"info": info, "tp_targets": TP_TARGETS, "rows": jsonable(rows)}
    path.write_text(json.dumps(doc, indent=1))
