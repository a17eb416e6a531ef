"""``bench_train_passes.py --tp 1,2,4``: the same rows at several tensor-parallel sizes, one
torchrun per size (data-parallel size 1 each: no gradient all-reduce in the timings), and a
table of each size's MFU per GPU next to the first size's (issue 42).

Each size runs ``python -m torch.distributed.run --standalone --nproc-per-node N
bench_train_passes.py <the same arguments> --tp N --out OUT/tpN`` in turn (sequence parallelism
on for N > 1, as the recipes run TP); this module reads their ``results.json`` and writes
``OUT/results_tp.json``. MFU per GPU = model FLOPs / (time * N * peak).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PASSES = (("logprob", "log-prob"), ("train", "fwd+bwd"))


def parse_sizes(text: str) -> list[int]:
    """ "1,2,4" -> [1, 2, 4] (positive, distinct)."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise SystemExit(f"--tp: a comma list of distinct positive sizes, got {text!r}")
    return sizes


def _child_argv(argv: list[str]) -> list[str]:
    """``argv`` without its ``--tp`` and ``--out`` (each child gets its own)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--tp", "--out"):
            skip = True
        elif not arg.startswith(("--tp=", "--out=")):
            out.append(arg)
    return out


def sweep(script: str, argv: list[str], sizes: list[int], out: Path) -> int:
    """Run every size under torchrun, then print and write the comparison; the exit status."""
    results = {}
    for n in sizes:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={n}", script, *_child_argv(argv), "--tp", str(n),
               "--out", str(out / f"tp{n}")]  # fmt: skip
        print(f"\n== TP {n}: {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd, env=os.environ.copy()).returncode
        if rc:
            print(f"TP {n} failed with exit status {rc}", file=sys.stderr)
            return rc
        results[n] = json.loads((out / f"tp{n}" / "results.json").read_text())
    rows = compare(results)
    print_table(rows, sizes)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results_tp.json").write_text(json.dumps(dict(sizes=sizes, rows=rows), indent=1))
    print(f"\nwrote {out / 'results_tp.json'}")
    return 0


def compare(results: dict[int, dict]) -> list[dict]:
    """One row per (L, variant): each size's ms and MFU per GPU per pass, and the MFU over the
    first size's."""
    sizes = list(results)
    base = {(r["L"], r["rope"]): r for r in results[sizes[0]]["rows"]}
    rows = []
    for key, first in base.items():
        row = dict(L=key[0], rope=key[1], sizes={})
        for n in sizes:
            r = next((x for x in results[n]["rows"] if (x["L"], x["rope"]) == key), None)
            if r is None:
                continue
            row["sizes"][n] = {
                name: dict(
                    ms=r[name]["ms"],
                    mfu=r[name]["mfu"],
                    mfu_vs_first=r[name]["mfu"] / first[name]["mfu"],
                )  # fmt: skip
                for name, _ in PASSES
            }
        rows.append(row)
    return rows


def print_table(rows: list[dict], sizes: list[int]) -> None:
    head = ["L", "variant"]
    for _, label in PASSES:
        head += [f"{label} MFU TP{n}" for n in sizes] + [f"{label} ms TP{n}" for n in sizes]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        cells = [str(row["L"]), row["rope"]]
        for name, _ in PASSES:
            got = [row["sizes"].get(n, {}).get(name) for n in sizes]
            cells += [
                "-" if g is None else f"{100 * g['mfu']:.3g}% ({g['mfu_vs_first']:.2f}x)"
                for g in got
            ]
            cells += ["-" if g is None else f"{g['ms']:.1f}" for g in got]
        print("| " + " | ".join(cells) + " |", flush=True)
