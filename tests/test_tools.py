"""The benchmark and profiling tools' CPU dry runs (tiny shapes, Triton in its interpreter): the
scripts behind docs/benchmarks.md must keep running and keep printing the plan each method ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def run_tool(script: str, *args: str, out: Path, nproc: int = 0) -> str:
    """stdout of ``python tools/<script> --device cpu ... --out out`` (``nproc``: under torchrun
    with that many processes); fails on a non-zero exit. TRITON_INTERPRET is left for the script
    to set (its ``--device cpu`` must)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    launch = [sys.executable]
    if nproc:
        launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd = [*launch, script, "--device", "cpu", *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=TOOLS, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_bench_logprobs_dry_run(tmp_path):
    methods = ["floor", "triton", "fused_grpo", "unfused_grpo", "fused_gspo"]
    stdout = run_tool("bench_logprobs.py", "--tiny", "--T", "96", "--methods", *methods,
                      out=tmp_path)  # fmt: skip
    assert "plan: fused_single_pass (requested)" in stdout  # --tiny forces the single pass
    assert "plan: fused_tiled (loss.ratio_level 'sequence'" in stdout  # GSPO's path
    (result,) = tmp_path.glob("bench_single_*.json")
    rows = json.loads(result.read_text())["results"]["96"]
    for name in methods[1:]:  # bf16 inputs against the fp32 reference: Megatron's is 2.4e-3
        assert rows[name]["logp_max_abs"] < 1e-4, (name, rows[name])
        assert max(rows[name]["dh_rel"], rows[name]["dw_rel"]) < 5e-3, (name, rows[name])
        assert rows[name]["plan"], name


def test_bench_logprobs_tp_dry_run(tmp_path):
    """TP 2 over gloo: each method's TP2 results against its TP1 run on the same rank."""
    methods = ["floor", "triton", "fused_grpo_sp"]
    run_tool("bench_logprobs.py", "--tp", "--tiny", "--T", "96", "--methods", *methods,
             out=tmp_path, nproc=2)  # fmt: skip
    rows = json.loads((tmp_path / "bench_tp2_T96.json").read_text())["rows"]
    assert {r["method"] for r in rows} == set(methods)
    for r in rows:
        if r["method"] != "floor":
            tpn = r["tpn"]
            assert tpn["plan"] and tpn["logp_vs_tp1"] < 1e-5, r
            assert max(tpn["dh_vs_tp1"], tpn["dw_vs_tp1"]) < 1e-3, r


def test_profile_lm_head_dry_run(tmp_path):
    stdout = run_tool(
        "profile_lm_head.py", "--T", "96", "--H", "64", "--V", "1000", "--reps", "1",
        "--warmup", "1", "--profiled-steps", "1", "--seq-len", "32",
        "--methods", "fused_grpo", "triton", "--fused-path", "fused_single_pass",
        "--chunk-sizes", "64", out=tmp_path,
    )  # fmt: skip
    assert "plan: fused_single_pass (requested)" in stdout
    assert "plan: op (requested); triton kernels" in stdout
    assert "fused single pass C=    64:" in stdout
    profile = json.loads((tmp_path / "profile_T96.json").read_text())
    assert set(profile["methods"]) == {"fused_grpo", "triton"}
    assert (tmp_path / "trace_fused_grpo_T96.json").exists()


def test_bench_packed_attention_plan_cost_dry_run(tmp_path):
    """--mixed: a row per (method, buckets), each with its count of distinct bucket shapes."""
    stdout = run_tool(
        "bench_packed_attention.py", "--tokens", "256", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--mixed", "10-60", "--layouts", "6", "--methods",
        "default,flash", out=tmp_path,
    )  # fmt: skip
    rows = json.loads((tmp_path / "bench_packed_attention_mixed.json").read_text())
    runs = {(r["method"], r["buckets"]): r for r in rows}
    assert list(runs) == [("default", "plan_free"), ("default", "exact"), ("flash", "exact")]
    assert all(r["distinct_shapes"] >= 1 for r in rows)
    assert all(r["cold_ms"] > 0 and r["warm_ms"] > 0 for r in rows)
    assert "| default | plan_free |" in stdout


def test_bench_train_passes_dry_run(tmp_path):
    """The trainer's log-prob and fwd+bwd passes, megatron-core's packed RoPE against ours, on a
    tiny model: a row per (L, rope), the before/after table, the profile's kernel tables."""
    stdout = run_tool(
        "bench_train_passes.py", "--tiny", "--rope", "megatron,auto", "--doc-lens", "256,32",
        "--mixed", "20-90", "--profile", "--host-profile", "--top", "5", out=tmp_path,
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["L"], r["rope"]): r for r in result["rows"]}
    assert set(rows) == {(L, rope) for L in (256, 32, "20-90") for rope in ("megatron", "auto")}
    for (L, rope), r in rows.items():
        if L != "20-90":
            assert f"| {L} | {256 // L} | {rope} |" in stdout  # the markdown table's row
        else:  # new random lengths in each micro-batch, the first batch's count in the table
            assert (
                256 / 90 <= r["docs_per_mb"] <= 256 / 20 + 1 and r["logp_max_abs_vs_first"] < 1e-4
            )
        for name in ("logprob", "train"):
            p = r[name]
            assert min(p["ms"], p["tokens_per_s"], p["mfu"], p["x_floor"]) > 0, (L, rope, p)
        assert r["flops"]["total"] > r["flops"]["attention"] > 0
        assert r["loss"] is not None and r["grad_norm"] > 0, r
        assert r["logp_max_abs_vs_first"] < 1e-4, r  # same weights and batches
    assert [(c["L"], c["pass_"]) for c in result["comparison"]] == [
        (256, "logprob"), (256, "train"), (32, "logprob"), (32, "train"),
        ("20-90", "logprob"), ("20-90", "train"),
    ]  # fmt: skip
    for name in ("logprob", "train"):  # cProfile's table of each pass
        assert f"== host profile L=32 rope=auto {name}:" in stdout
    assert stdout.count("Ordered by: internal time") == 2
    assert all(c["ratio"] > 0 for c in result["comparison"])
    assert "| L | pass | before | after |" in stdout
    profile = result["profile"]
    assert [(p["rope"], p["pass_"]) for p in profile] == [
        ("megatron", "logprob"), ("megatron", "train"), ("auto", "logprob"), ("auto", "train"),
    ]  # fmt: skip
    for p in profile:
        assert p["launches"] > 0 and p["top"] and (tmp_path / p["trace"]).exists()


def test_bench_train_passes_tp_dry_run(tmp_path):
    """--tp 2 under torchrun (gloo, SP on): one row per rope variant, MFU per GPU of the TP
    group, the packed attention path as the variant's 4th part and the SP linears'
    collectives (symmetric memory's ops, their definitions on the CPU) as its 7th; rank 0 writes
    the report."""
    variant = "auto/auto/plan_free/blocked///symm"
    stdout = run_tool(
        "bench_train_passes.py", "--tiny", "--tp", "2", "--doc-lens", "32", "--micro-batches",
        "1", "--warmup", "0", "--rope", variant, out=tmp_path, nproc=2,
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["tp"] == 2 and result["world_size"] == 2
    (row,) = result["rows"]
    assert row["rope"] == variant and row["loss"] is not None
    flops, train = row["flops"]["total"], row["train"]
    assert abs(train["mfu"] - 3 * flops / (train["ms"] / 1e3) / (989e12 * 2)) < 1e-9 * train["mfu"]
    assert stdout.count(f"| 32 | 8 | {variant} |") == 1  # rank 0 prints


def test_bench_tp_comparison_table(capsys):
    """tools/bench_tp.py: each size's MFU next to the first size's; the child's arguments."""
    sys.path.insert(0, str(TOOLS))
    try:
        import bench_tp
    finally:
        sys.path.remove(str(TOOLS))

    def result(mfu: float, ms: float) -> dict:
        p = dict(ms=ms, mfu=mfu)
        return dict(rows=[dict(L=32, rope="auto", logprob=p, train=dict(p, mfu=mfu / 2))])

    rows = bench_tp.compare({1: result(0.5, 10.0), 4: result(0.4, 3.0)})
    assert rows[0]["sizes"][4]["logprob"]["mfu_vs_first"] == 0.4 / 0.5
    assert rows[0]["sizes"][4]["train"]["mfu"] == 0.2
    bench_tp.print_table(rows, [1, 4])
    assert "| 32 | auto | 50% (1.00x) | 40% (0.80x) | 10.0 | 3.0 |" in capsys.readouterr().out
    argv = ["--dense8b", "--tp", "1,2", "--out", "x", "--tp=4", "--out=y", "--iters", "2"]
    assert bench_tp._child_argv(argv) == ["--dense8b", "--iters", "2"]
    assert bench_tp.parse_sizes("1,2,4") == [1, 2, 4]
    for bad in ("0", "1,1", "a", ""):
        with pytest.raises(SystemExit, match="--tp"):
            bench_tp.parse_sizes(bad)


def test_bench_moe_sort_dry_run(tmp_path):
    """Tiny shapes in the interpreter: the counting sort and argsort agree; the table prints."""
    args = ("--pairs", "7,300", "--experts", "8:2", "--tiles", "8x512,4x16")
    stdout = run_tool("bench_moe_sort.py", *args, out=tmp_path)
    assert "| 300 | 8 | 2 (4) | - | - | - | True |" in stdout, stdout
    rows = json.loads((tmp_path / "bench_moe_sort.json").read_text())["rows"]
    assert [r["pairs"] for r in rows] == [7, 300] and all(r["equal"] for r in rows)


def test_bench_nonfinite_runs_on_cpu(capsys, monkeypatch):
    """tools/bench_nonfinite.py: both paths of the gradient check agree (finite) and time."""
    sys.path.insert(0, str(TOOLS))
    try:
        import bench_nonfinite

        argv = ["bench_nonfinite.py", "--elements", "5000", "--iters", "1", "--device", "cpu"]
        monkeypatch.setattr(sys, "argv", argv)
        bench_nonfinite.main()
    finally:
        sys.path.remove(str(TOOLS))
    assert "225 parameters, 5,000 elements: per parameter" in capsys.readouterr().out


def test_install_tree_brings_the_trees_own_kernels(tmp_path):
    """tools/gpu_env.sh ``install_tree``: another source tree (a before / after's base) installed
    on its own imports its own ``megatron_grpo.kernels``; with the tree only on PYTHONPATH they
    came from this checkout's editable install (setup.py maps the top-level kernels/)."""
    root = TOOLS.parent
    tree = tmp_path / "tree"
    tree.mkdir()
    for part in ("setup.py", "README.md", "megatron_grpo", "kernels"):  # the package's sources
        subprocess.run(["cp", "-r", str(root / part), str(tree)], check=True)
    marker = tree / "kernels" / "tree_marker.py"
    marker.write_text("WHERE = 'the tree'\n")
    script = f". {TOOLS / 'gpu_env.sh'}; install_tree {tree}"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    site = proc.stdout.strip().splitlines()[-1]
    code = "import megatron_grpo.kernels.tree_marker as m, megatron_grpo as g; print(m.WHERE, g.__file__)"
    env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONPATH=site)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, text=True,
                         capture_output=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("the tree " + site), out.stdout
