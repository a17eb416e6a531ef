"""Rows gathered and summed per output row (``ops.layers.gather_sum``, the gathered MoE
dispatch's combine and its row gather's backward): the torch reference against the definition,
the Triton kernel against the reference (bf16 sums of a few rows are exact in fp32, so bit for
bit; fp32 within rounding). Interpreter tests run in a fresh process with TRITON_INTERPRET=1;
the GPU test (marked gpu, 1 GPU) runs the compiled kernel.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from megatron_grpo.ops.layers.gather_sum import gather_sum, gather_sum_torch  # noqa: E402
from tests.interpreter import interpreter_only, run_interpreter_tests  # noqa: E402

# (M source rows, D, N output rows, S slots): odd widths around the kernel's column blocks, the
# dispatch's probs (D = 1), one slot, top-8, no output rows, no source rows (every slot unused)
CASES = [(10, 1, 7, 4), (33, 37, 20, 1), (50, 1030, 9, 8), (5, 16, 0, 4), (0, 8, 3, 2),
         (64, 1024, 31, 4)]  # fmt: skip


def test_interpreter_subprocess():
    """Run this module's interpreter tests in a fresh process with TRITON_INTERPRET=1."""
    run_interpreter_tests(__file__, timeout=600)


def _case(m, d, n, s, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(m, d, generator=g).to(dtype)
    idx = torch.randint(0, m + 1, (n, s), generator=g)  # m: no row
    idx[::3, 0] = m  # some slots unused on purpose, whatever the draw
    return src.to(device), idx.to(device)


def _definition(src, idx, out_dtype):
    out = torch.zeros(idx.size(0), src.size(1), dtype=torch.float64)
    for n, row in enumerate(idx.tolist()):
        for j in row:
            if j < src.size(0):
                out[n] += src[j].double()
    return out.to(out_dtype)


@pytest.mark.parametrize("m, d, n, s", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_meets_the_definition(m, d, n, s, dtype):
    src, idx = _case(m, d, n, s, dtype, seed=m + d)
    got = gather_sum_torch(src, idx, torch.float32)
    torch.testing.assert_close(got, _definition(src, idx, torch.float32), rtol=1e-6, atol=1e-6)
    assert gather_sum_torch(src, idx, dtype).dtype == dtype


def _kernel_test(device: str = "cpu") -> None:
    for seed, (m, d, n, s) in enumerate(CASES):
        for dtype, out_dtype in ((torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                 (torch.float32, torch.float32)):  # fmt: skip
            src, idx = _case(m, d, n, s, dtype, seed, device)
            got = gather_sum(src, idx, out_dtype, impl="triton")
            want = gather_sum_torch(src, idx, out_dtype)
            assert got.dtype == out_dtype and got.shape == want.shape
            if dtype == torch.bfloat16:  # a few bf16 rows add exactly in fp32: any order
                assert torch.equal(got, want), (m, d, n, s, dtype, out_dtype)
            else:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


test_interpreter_kernel_equals_reference = interpreter_only(_kernel_test)


def test_bad_shapes_name_the_tensors():
    with pytest.raises(ValueError, match=r"src must be \[M, D\] and idx \[N, S\] int64"):
        gather_sum(torch.zeros(4), torch.zeros(2, 2, dtype=torch.long), torch.float32)
    with pytest.raises(ValueError, match=r"idx \[N, S\] int64"):
        gather_sum(torch.zeros(4, 2), torch.zeros(2, 2, dtype=torch.int32), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernel_equals_reference():
    """One GPU: the compiled kernel against the reference."""
    _kernel_test("cuda")


def test_auto_takes_the_reference_for_narrow_rows(monkeypatch):
    """ "auto" runs the kernel for rows of at least MIN_KERNEL_WIDTH elements on CUDA, the
    reference below (where the kernel's one program per row loses); explicit "triton" always
    runs the kernel."""
    from megatron_grpo.ops.layers import gather_sum as layer

    calls = []
    monkeypatch.setattr(layer, "resolve_impl", lambda impl, device: "triton")
    monkeypatch.setattr(
        layer.triton_kernels, "gather_sum", lambda src, idx, dtype: calls.append(src.size(1))
    )
    idx = torch.zeros(3, 2, dtype=torch.long)
    for width in (1, layer.MIN_KERNEL_WIDTH - 1, layer.MIN_KERNEL_WIDTH):
        gather_sum(torch.zeros(4, width), idx, torch.float32)
    gather_sum(torch.zeros(4, 1), idx, torch.float32, impl="triton")
    assert calls == [layer.MIN_KERNEL_WIDTH, 1]
