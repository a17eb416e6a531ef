"""``logging.profile_step_start`` .. ``_end``: those trainer steps under torch.profiler on the
ranks of ``logging.profile_ranks``, a trace and a device-time table each."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"


def _body(rank: int, world: int, tmp: Path) -> None:
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import Trainer

    cfg = load_train_config(RECIPE, [
        "parallel.tensor_model_parallel_size=1", "training.steps=3",
        "training.mini_batches_per_step=1", "rollout.num_prompts=4", f"logging.dir={tmp}",
        "checkpoint.dir=null", "logging.profile_step_start=2", "logging.profile_ranks=[1]",
        "logging.profile_with_stack=true",
    ])  # fmt: skip
    Trainer(cfg).train()


def test_profiled_steps_leave_a_trace_and_a_table_on_the_chosen_rank(tmp_path):
    run_distributed(_body, 2, tmp_path)
    files = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert files == ["rank1_steps2-2.json.gz", "rank1_steps2-2.md"]  # rank 1, step 2 only
    table = (tmp_path / "profile" / "rank1_steps2-2.md").read_text()
    assert table.startswith("# Profile: rank 1, steps 2-2")
    assert "| collective |" in table and "aten::" in table  # CPU: leaf ops stand in for kernels
    trace = (tmp_path / "profile" / "rank1_steps2-2.json.gz").read_bytes()
    import gzip

    text = gzip.decompress(trace).decode()
    assert all(f"stage/{s}" in text for s in ("rollout", "logprob", "update"))
    # with Python stacks: tools/trace_stage.py charges the update's ops to our source lines
    sys.path.insert(0, str(RECIPE.parents[1] / "tools"))
    import trace_stage

    events = trace_stage.load(tmp_path / "profile" / "rank1_steps2-2.json.gz")
    summary = trace_stage.summarize(events, "update", top=50)
    assert "host time by the calling source line" in summary
    assert "| `megatron_grpo/" in summary.split("calling source line")[1], summary


def test_kernel_kinds_and_busy_time():
    from megatron_grpo.profiling import kind_of, union_seconds

    assert kind_of("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "collective"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kind_of("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_NNT") == "gemm"  # cuBLASLt, CUDA 13
    assert kind_of("gloo:all_reduce") == "collective"
    assert kind_of("flash_fwd_kernel") == "attention"
    assert kind_of("Memcpy DtoH (Device -> Pinned)") == "copy"
    assert kind_of("triton_per_fused_rms_norm") == "other"
    assert union_seconds([(0, 2e6), (1e6, 3e6), (5e6, 6e6)]) == pytest.approx(4.0)
    assert union_seconds([(0, 4e6), (1e6, 2e6)]) == pytest.approx(4.0)  # nested


def test_gpu_annotations_are_not_kernels():
    """The stage ranges mirrored on the GPU's timeline span the kernels they enclose: the table
    must count the kernels only (a profile of a host-bound step read 96% busy with them)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from megatron_grpo.profiling import device_events, report

    def event(name, start, end, annotation=False, device=DeviceType.CUDA):
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, device_type=device, time_range=span,
                               is_user_annotation=annotation, cpu_children=[])  # fmt: skip

    def host(name, start, end):  # a record_function range on the host
        return event(name, start, end, annotation=True, device=DeviceType.CPU)

    events = [event("stage/update", 0, 10e6, annotation=True), event("nvjet_gemm", 1e6, 2e6),
              event("triton_rms_norm", 3e6, 3.5e6), event("stage/rollout", 10e6, 12e6, True),
              host("stage/update", 0, 10e6), host("stage/rollout", 10e6, 12e6),
              host("stage/rollout", 11e6, 14e6), event("decode_attn", 11.5e6, 12.5e6),
              event("memcpy", 14.5e6, 15e6)]  # fmt: skip
    assert [e.name for e in device_events(events)] == [
        "nvjet_gemm", "triton_rms_norm", "decode_attn", "memcpy"]  # fmt: skip
    table = report(events, 15.0, 0, 2, 2)
    assert "device busy 3.000 s (20%), idle 12.000 s; kernel time 3.000 s in 4 launches" in table
    assert "stage/update" not in table
    # per stage: its span (overlapping ranges joined), the busy time and launches inside it
    assert "| update | 1 | 10.000 | 1.500 | 15 | 2 |" in table
    assert "| rollout | 2 | 4.000 | 1.000 | 25 | 1 |" in table  # the copy at 14.5 s is after


@pytest.mark.parametrize(
    "sets, match",
    [
        (["logging.profile_step_start=0"], "profile_step_start must be >= 1"),
        (["logging.profile_step_start=3", "logging.profile_step_end=2"], "profile_step_end"),
        (["logging.profile_step_end=2"], "profile_step_end and .* need profile_step_start"),
        (["logging.profile_with_stack=true"], "profile_with_stack need profile_step_start"),
        (["logging.profile_step_start=1", "logging.profile_ranks=[]"], "profile_ranks"),
    ],
)
def test_profile_settings_errors_name_the_field(sets, match):
    from megatron_grpo.train.config import load_train_config

    with pytest.raises(Exception, match=match):
        load_train_config(RECIPE, sets)
