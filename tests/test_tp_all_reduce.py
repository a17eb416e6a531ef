"""The fused decode step's TP all-reduce (rollout/engine/tp_all_reduce.py).

On CPU: the one decision (``reduce_tiers``) and its errors; the NCCL path (gloo here) sums.
On 2 GPUs: one-shot and two-shot over symmetric memory equal NCCL's all-reduce bit for bit (a + b
is one rounding either way), eagerly and replayed in a CUDA graph; a TP2 engine decodes the same
greedy tokens and log-probs with each. On 4 GPUs: within rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_grpo.rollout.engine import tp_all_reduce as tar
from tests.dist_utils import run_distributed


def test_tp1_and_nccl_need_no_group_and_tp1_refuses_kernels():
    assert tar.reduce_tiers("auto", None, torch.device("cuda")) == ()
    assert tar.reduce_tiers("nccl", None, torch.device("cpu")) == ()
    for kernel in tar.KERNELS:  # an explicit kernel at TP 1 would reduce nothing: an error
        with pytest.raises(ValueError, match=f"'{kernel}' cannot run here: TP is 1"):
            tar.reduce_tiers(kernel, None, torch.device("cuda"))
    with pytest.raises(ValueError, match="tp_all_reduce must be one of.*did you mean 'one_shot'"):
        tar.reduce_tiers("oneshot", None, torch.device("cpu"))
    with pytest.raises(ValueError, match="tp_all_reduce 'two_shot' needs the fused decode path"):
        tar.reduce_tiers("two_shot", None, torch.device("cuda"), decode_path="modules")
    with pytest.raises(ValueError, match="a tier is .*nccl | one_shot | two_shot"):
        tar.TPAllReduce(None, ((1024, "three_shot"),), torch.device("cpu"))
    assert tar.describe(((512 << 10, "one_shot"), (8 << 20, "two_shot"))) == (
        "one_shot <= 512 KiB, two_shot <= 8192 KiB, then NCCL"
    )
    assert tar.describe(()) == "NCCL"


def test_engine_options_name_the_field():
    from megatron_grpo.rollout import EngineOptions

    with pytest.raises(ValueError, match="rollout.engine.tp_all_reduce must be one of"):
        EngineOptions(tp_all_reduce="one-shot")


def _decision_body(rank: int, world: int) -> None:
    import os

    group = dist.new_group([0, 1])
    cuda = torch.device("cuda")  # only its type is read: the decision runs without a GPU
    with pytest.raises(ValueError, match="'one_shot' cannot run here: the model is on cpu"):
        tar.reduce_tiers("one_shot", group, torch.device("cpu"))
    assert tar.reduce_tiers("auto", group, torch.device("cpu")) == ()
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # two hosts of one rank each
    assert "spans 2 hosts of 1 ranks" in tar.symm_mem_unavailable(group, cuda)
    with pytest.raises(ValueError, match="spans 2 hosts"):
        tar.reduce_tiers("two_shot", group, cuda)
    assert tar.reduce_tiers("auto", group, cuda) == ()
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    symm = hasattr(torch.ops.symm_mem, "two_shot_all_reduce_out")
    if symm:
        assert tar.symm_mem_unavailable(group, cuda) == ""
        assert tar.reduce_tiers("one_shot", group, cuda) == ((512 << 10, "one_shot"),)
        assert tar.reduce_tiers("two_shot", group, cuda) == ((8 << 20, "two_shot"),)
    # "auto": the tiers measured ahead at this TP size
    assert tar.reduce_tiers("auto", group, cuda) == (tar.MEASURED_AHEAD[2] if symm else ())
    measured = tar.MEASURED_AHEAD.pop(2)
    try:  # a TP size never measured: NCCL
        assert tar.reduce_tiers("auto", group, cuda) == ()
    finally:
        tar.MEASURED_AHEAD[2] = measured
    # the NCCL path (gloo here) sums in place on every rank
    reduce = tar.TPAllReduce(group, (), torch.device("cpu"))
    t = torch.arange(6.0).reshape(2, 3) * (rank + 1)
    assert reduce.kernel(t) == "nccl"
    reduce = tar.TPAllReduce(group, ((1 << 10, "nccl"),), torch.device("cpu"))  # no buffer
    assert reduce.buffer is None and reduce.kernel(t) == "nccl"
    assert torch.equal(reduce(t), torch.arange(6.0).reshape(2, 3) * 3)


def test_decision_over_a_two_rank_group():
    run_distributed(_decision_body, 2)


def _close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, group) -> bool:
    """Equal at TP 2 (one rounding); at TP 4 the two sum in other orders: within a few roundings
    of the partial sums (bounded by the sum of the ranks' magnitudes)."""
    if dist.get_world_size(group) == 2:
        return torch.equal(got, want)
    scale = x.float().abs()
    dist.all_reduce(scale, group=group)
    bound = 4 * torch.finfo(want.dtype).eps * scale
    return bool(((got.float() - want.float()).abs() <= bound).all())


def _symm_body(rank: int, world: int) -> None:
    group = dist.new_group(list(range(world)))
    device = torch.device("cuda", torch.cuda.current_device())
    tiers = ((64 << 10, "one_shot"), (1 << 20, "two_shot"))
    symm = tar.TPAllReduce(group, tiers, device)
    g = torch.Generator(device=device).manual_seed(rank)
    cases = ((torch.bfloat16, (3, 4096), "one_shot"), (torch.float32, (300, 1000), "nccl"),
             (torch.bfloat16, (1, 8), "one_shot"), (torch.bfloat16, (64, 4096), "two_shot"),
             (torch.float32, (33, 1000), "two_shot"), (torch.bfloat16, (37, 999), "nccl"),
             (torch.bfloat16, (512, 4096), "nccl"))  # fmt: skip
    for dtype, shape, kernel in cases:  # the tiers by size; two-shot needs 16 x TP bytes parts
        x = torch.randn(shape, generator=g, device=device, dtype=dtype) * 5
        assert symm.kernel(x) == kernel or (kernel == "two_shot" and world == 4), (shape, dtype)
        want = x.clone()
        dist.all_reduce(want, group=group)
        got = symm(x.clone())
        assert _close(got, want, x, group), (dtype, shape, (got.float() - want.float()).abs().max())
    # replayed in a CUDA graph with new inputs (the engine's decode steps), both kernels
    for rows in (4, 64):
        static = torch.zeros(rows, 4096, device=device, dtype=torch.bfloat16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            symm(static.clone())  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = symm(static.clone()) * 1
        for step in range(3):
            static.copy_(torch.randn(static.shape, generator=g, device=device, dtype=static.dtype))
            want = static.clone()
            dist.all_reduce(want, group=group)
            graph.replay()
            assert _close(out, want, static, group), f"{rows} rows, replay {step}"
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_one_shot_equals_nccl_bitwise():
    """2 GPUs: one-shot and two-shot sums equal NCCL's exactly (bf16 and fp32, odd shapes, each
    size tier and beyond them), eagerly and replayed from a CUDA graph."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_distributed(_symm_body, 2, backend="nccl", timeout=120)


@pytest.mark.gpu
def test_gpu_one_shot_at_tp4_within_rounding():
    """4 GPUs: at TP 4 the kernels and NCCL sum in other orders; within bf16 / fp32 rounding."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    run_distributed(_symm_body, 4, backend="nccl", timeout=120)


def _recording(kernel, used: list):
    def recorded(self, t):
        used.append(kernel(self, t))
        return used[-1]

    return recorded


def _engine_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import EngineOptions, SamplingParams, generate
    from megatron_grpo.rollout.engine import KVCacheEngine
    from tests.megatron_utils import build_layout, tiny_model

    cfg = tiny_model(init_method_std=0.3)
    model = unwrap(build_layout(ParallelConfig(tensor_model_parallel_size=2), cfg)[0])
    params = SamplingParams(top_k=1, max_new_tokens=16, eos_id=3, vocab_size=cfg.vocab_size)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (4 + i % 9,), generator=g).tolist()
               for i in range(20)]  # fmt: skip
    out = {}
    for path in ("nccl", "one_shot", "two_shot"):
        options = EngineOptions(kv_cache_gib=0.5, context_bucket=16, tp_all_reduce=path)
        engine = KVCacheEngine(model, options)
        assert engine.use_graphs, engine.decode
        assert path in str(engine.decode) or path == "nccl", engine.decode
        used, kernel = [], tar.TPAllReduce.kernel
        tar.TPAllReduce.kernel = _recording(kernel, used)
        try:
            g = torch.Generator().manual_seed(1)
            out[path] = generate(model, prompts, params, g, engine=engine)
        finally:
            tar.TPAllReduce.kernel = kernel
        assert path in used, (path, set(used))  # the decode steps went through the kernel
    assert out["one_shot"] == out["nccl"] and out["two_shot"] == out["nccl"]


@pytest.mark.gpu
def test_gpu_tp2_engine_one_shot_decodes_the_nccl_tokens():
    """2 GPUs: a TP2 engine with decode graphs gives the same greedy tokens and log-probs with
    the one-shot and two-shot all-reduces as with NCCL's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_distributed(_engine_body, 2, backend="nccl", timeout=120)
