"""Packed-sequence RoPE in one op (ops.layers.rope, megatron.packed_rope) against megatron-core's own
per-document loop (``_apply_rotary_pos_emb_thd``): bit for bit in the torch reference, to the
kernel's rounding contract in Triton (interpreted on CPU), forward and backward."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megatron_grpo.megatron.attention.rope import packed_positions
from megatron_grpo.ops.layers.rope import apply_rotary

LAYOUTS = {
    "one_doc": [37],
    "many": [5, 1, 9, 3, 17, 2, 8],
    "empty_and_one_token": [4, 0, 1, 6, 0, 1, 3],
    "equal": [8, 8, 8, 8],
}


class _Group:  # megatron's THD RoPE asks the cp_group for its size and rank only
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _freqs(rows: int, dim: int, rotary_percent: float = 1.0, interleaved: bool = False):
    """megatron-core's RotaryEmbedding table ``[rows, 1, 1, ROT]`` fp32 (its forward moves the
    inverse frequencies to CUDA, so its math is repeated here)."""
    rot = int(dim * rotary_percent)
    inv = 1.0 / (500 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(rows, dtype=torch.float32), inv)
    if interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.size(0), -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def _megatron(x, cu, freqs, interleaved, mscale=1.0, cp=(1, 0)):
    return rope_utils._apply_rotary_pos_emb_thd(
        x, cu, freqs, rotary_interleaved=interleaved, mscale=mscale, cp_group=_Group(*cp)
    )


def _ours(x, cu, freqs, interleaved, impl, mscale=1.0, cp=(1, 0)):
    pos = packed_positions(cu.tolist(), x.size(0), *cp)
    table = freqs.reshape(freqs.size(0), -1)
    cos = (torch.cos(table) * mscale).to(x.dtype)[pos]
    sin = (torch.sin(table) * mscale).to(x.dtype)[pos]
    return apply_rotary(x, cos, sin, interleaved=interleaved, impl=impl)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _run(fn, x, grad):
    x = x.detach().requires_grad_()
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "variant",
    [
        dict(interleaved=False, percent=1.0, mscale=1.0),
        dict(interleaved=True, percent=1.0, mscale=1.0),
        dict(interleaved=False, percent=0.5, mscale=1.0),
        dict(interleaved=True, percent=0.5, mscale=1.23),  # YaRN's concentration factor
    ],
    ids=["plain", "interleaved", "partial", "interleaved_partial_yarn"],
)
def test_torch_reference_equals_megatron_bitwise(layout, dtype, variant):
    lens = LAYOUTS[layout]
    cu, t, d = _cu(lens), sum(lens), 16
    freqs = _freqs(max(lens), d, variant["percent"], variant["interleaved"])
    g = torch.Generator().manual_seed(len(lens))
    x = torch.randn(t, 3, d, generator=g).to(dtype)
    grad = torch.randn(t, 3, d, generator=g).to(dtype)
    inter, m = variant["interleaved"], variant["mscale"]
    want = _run(lambda v: _megatron(v, cu, freqs, inter, m), x, grad)
    got = _run(lambda v: _ours(v, cu, freqs, inter, "torch", m), x, grad)
    for name, a, b in zip(("out", "grad"), got, want, strict=True):
        assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_context_parallel_halves_equal_megatron(cp, dtype):
    lens = [4 * cp, 2 * cp, 6 * cp, 2 * cp]  # padded to multiples of 2 * CP, as the batch does
    cu, d = _cu(lens), 8
    freqs = _freqs(max(lens), d)
    g = torch.Generator().manual_seed(cp)
    x = torch.randn(sum(lens) // cp, 2, d, generator=g).to(dtype)
    grad = torch.randn_like(x)
    for rank in range(cp):
        want = _run(lambda v, r=rank: _megatron(v, cu, freqs, False, cp=(cp, r)), x, grad)
        got = _run(lambda v, r=rank: _ours(v, cu, freqs, False, "torch", cp=(cp, r)), x, grad)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"rank {rank}"


def test_positions_restart_per_document_and_padding_is_zero():
    pos = packed_positions([0, 3, 3, 5], 7)
    assert pos.tolist() == [0, 1, 2, 0, 1, 0, 0]  # the empty doc is skipped; rows 5, 6 padding


def test_interpreter_subprocess():
    """Run this module's interpreter tests in a fresh process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    from tests.interpreter import run_interpreter_tests

    run_interpreter_tests(__file__)


def _kernel_case(dtype, interleaved, percent, device):
    lens = LAYOUTS["many"]
    cu, t, d = _cu(lens), sum(lens), 16
    freqs = _freqs(max(lens), d, percent, interleaved)
    g = torch.Generator().manual_seed(3)
    # a strided q (megatron's qkv split is a view): heads 0-2 of a 5-head buffer
    x = torch.randn(t, 5, d, generator=g).to(device, dtype)[:, :3]
    grad = torch.randn(t, 3, d, generator=g).to(device, dtype)
    freqs = freqs.to(device)
    want = _run(lambda v: _ours(v, cu, freqs, interleaved, "torch"), x, grad)
    got = _run(lambda v: _ours(v, cu, freqs, interleaved, "triton"), x, grad)
    for name, a, b in zip(("out", "grad"), got, want, strict=True):
        assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max()}"
    with torch.no_grad():  # the no-graph path (no autograd.Function) computes the same
        assert torch.equal(_ours(x, cu, freqs, interleaved, "triton"), got[0])


_KERNEL_CASES = pytest.mark.parametrize(
    "dtype,interleaved,percent",
    [
        (dt, i, p)
        for dt in (torch.float32, torch.bfloat16)
        for i in (False, True)
        for p in (1.0, 0.5)
    ],
)


@_KERNEL_CASES
def test_kernel_interpreter_equals_reference(dtype, interleaved, percent):
    from tests.interpreter import IN_INTERPRETER

    if not IN_INTERPRETER:
        pytest.skip("runs under TRITON_INTERPRET=1 in test_interpreter_subprocess")
    _kernel_case(dtype, interleaved, percent, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@_KERNEL_CASES
def test_kernel_gpu_equals_reference(dtype, interleaved, percent):
    _kernel_case(dtype, interleaved, percent, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cp", [(1, 0), (2, 1), (4, 2)])
def test_gpu_positions_computed_on_the_device_equal_the_hosts(cp):
    """One GPU: the positions the attention builds on the device equal the host's."""
    bounds = [0, 8, 8, 24, 40, 72]
    tokens = 72 // cp[0] + 4  # trailing padding rows
    host = packed_positions(bounds, tokens, *cp)
    dev = packed_positions(bounds, tokens, *cp, device="cuda")
    assert dev.device.type == "cuda" and torch.equal(dev.cpu(), host)
