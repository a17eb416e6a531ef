"""The fused decode step's kernels against float64 ground truth, and the step end to end.

Each Triton kernel (``add_rms_norm``, ``qkv_rope_cache``, ``swiglu``) must stay within the
same-dtype torch reference's error (``decode_ops.*_torch``, megatron-core's rounding sequence)
plus two units of roundoff, at odd sizes (H, head dim, F not powers of two; partial and interleaved
RoPE; with and without q/k norm and biases). As in test_kernels.py, the interpreter tests run in
a fresh process with TRITON_INTERPRET=1; GPU tests (marked gpu) run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from megatron_grpo.ops.layers import decode as decode_ops  # noqa: E402
from tests.interpreter import interpreter_only, run_interpreter_tests  # noqa: E402


def test_interpreter_subprocess():
    """Run this module's interpreter tests in a fresh process with TRITON_INTERPRET=1."""
    run_interpreter_tests(__file__, timeout=900)


def _err(x: torch.Tensor, truth: torch.Tensor) -> float:
    return ((x.double() - truth).abs() / (1 + truth.abs())).max().item()


def _check(kernel_out, ref_out, truth, dtype, ulps: float = 2) -> None:
    """Kernel error <= the same-dtype reference's error + ``ulps`` units of roundoff of the
    dtype: a norm's rstd may differ in its last bit (reduction order), then the output rounds."""
    tol = ulps * torch.finfo(dtype).eps
    for k, r, t in zip(kernel_out, ref_out, truth, strict=True):
        assert k.dtype == r.dtype == dtype
        assert _err(k, t) <= _err(r, t) + tol, (_err(k, t), _err(r, t))


def _norm_case(dtype, device, bias: bool, residual: bool, h=48, b=5):
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(b, h, generator=g) * 3 for _ in range(2))
    w, bb = torch.randn(h, generator=g), torch.randn(h, generator=g)
    x[0] *= 1e3  # a large row
    t = dict(x=x, weight=w, residual=res if residual else None, bias=bb if bias else None)
    return {k: None if v is None else v.to(device, dtype) for k, v in t.items()}


def _run_norm(fn, case):
    case = {k: None if v is None else v.clone() for k, v in case.items()}
    return fn(case.pop("x"), case.pop("weight"), 1e-6, **case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,residual", [(False, False), (False, True), (True, True)])
def _norm_test(dtype, bias, residual, device="cpu"):
    from megatron_grpo.kernels import add_rms_norm

    case = _norm_case(dtype, device, bias, residual)
    truth = _run_norm(decode_ops.add_rms_norm_torch,
                      {k: None if v is None else v.double() for k, v in case.items()})  # fmt: skip
    _check(_run_norm(add_rms_norm, case), _run_norm(decode_ops.add_rms_norm_torch, case),
           truth, dtype)  # fmt: skip


test_interpreter_add_rms_norm = interpreter_only(_norm_test)


def _qkv_case(dtype, device, groups=3, per_group=2, d=24, rot=16, b=4, slots=6, seq=9):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(b, groups * (per_group + 2) * d, generator=g) * 2
    qw, kw = torch.randn(d, generator=g), torch.randn(d, generator=g)
    angles = torch.rand(seq, rot, generator=g) * 6
    cos, sin = torch.cos(angles) * 1.1, torch.sin(angles) * 1.1  # a YaRN-like factor
    pos = torch.tensor([0, 8, 3, 8])[:b]
    cache = torch.zeros(2, slots, groups, seq, d)
    to = lambda t: t.to(device, dtype)  # noqa: E731
    return dict(qkv=to(qkv), qw=to(qw), kw=to(kw), cos=to(cos), sin=to(sin),
                pos=pos.to(device), cache=to(cache), groups=groups, per_group=per_group)  # fmt: skip


def _run_qkv(fn, c, norm: bool, rope: bool, interleaved: bool):
    cache = c["cache"].clone()
    q = fn(c["qkv"], c["groups"], c["per_group"], c["pos"], cache[0], cache[1],
           (c["qw"], c["kw"], 1e-6) if norm else None,
           (c["cos"], c["sin"], interleaved) if rope else None)  # fmt: skip
    rows = torch.arange(c["pos"].numel())
    return q, cache[0][rows, :, c["pos"]], cache[1][rows, :, c["pos"]], cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm,rope,interleaved", [
    (True, True, False), (True, True, True), (False, True, False), (True, False, False),
])  # fmt: skip
def _qkv_test(dtype, norm, rope, interleaved, device="cpu"):
    from megatron_grpo.kernels import qkv_rope_cache

    c = _qkv_case(dtype, device)
    c64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
           for k, v in c.items()}  # fmt: skip
    args = (norm, rope, interleaved)
    *truth, _ = _run_qkv(decode_ops.qkv_rope_cache_torch, c64, *args)
    *ref, _ = _run_qkv(decode_ops.qkv_rope_cache_torch, c, *args)
    *got, cache = _run_qkv(qkv_rope_cache, c, *args)
    _check(got, ref, truth, dtype)
    written = torch.zeros_like(cache[0], dtype=torch.bool)
    written[torch.arange(4), :, c["pos"]] = True
    assert (cache[:, ~written] == 0).all(), "the kernel wrote outside (row, pos)"


test_interpreter_qkv_rope_cache = interpreter_only(_qkv_test)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def _swiglu_test(dtype, bias, device="cpu"):
    from megatron_grpo.kernels import swiglu

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 2 * 1100, generator=g) * 4).to(device, dtype)  # F = 1100: two blocks
    bb = torch.randn(2 * 1100, generator=g).to(device, dtype) if bias else None
    truth = decode_ops.swiglu_torch(x.double(), None if bb is None else bb.double())
    _check([swiglu(x, bb)], [decode_ops.swiglu_torch(x, bb)], [truth], dtype)


test_interpreter_swiglu = interpreter_only(_swiglu_test)


def _sample_test(device="cpu"):
    from megatron_grpo.kernels import sample_rows

    from megatron_grpo.rollout import SamplingParams
    from megatron_grpo.rollout.engine.sampling import sample

    g = torch.Generator().manual_seed(3)
    b, v, padded = 64, 300, 304
    logits = torch.randn(b, padded, generator=g) * 3
    logits[:, v:] = 1e4  # padded columns: must never be read
    logits[0, :v] = -1e4  # ties everywhere
    logits[1, 7] = 1e4  # one dominant token
    logits[2, :v] = torch.linspace(-50, 50, v)  # a wide spread
    u = torch.rand(b, generator=g)
    u[3], u[4] = 0.0, 1.0 - 2**-24
    logits, u = logits.to(device), u.to(device)
    params = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=1, eos_id=0,
                            vocab_size=v)  # fmt: skip
    tokens, logp = sample_rows(logits, u, v, 0.7)
    want, want_logp = sample(logits, u, params)
    # Row 4's target sits within rounding of the end of its CDF: any token of the tail may win.
    rows = [i for i in range(b) if i != 4]
    assert tokens[rows].tolist() == want[rows].tolist()
    assert int(tokens[1]) == 7 and int(tokens[4]) >= v - 10 and int(tokens[4]) < v
    truth = torch.log_softmax(logits[:, :v].double() / 0.7, dim=-1)
    err = (logp.double() - truth.gather(1, tokens[:, None])[:, 0]).abs()
    ref_err = (want_logp.double() - truth.gather(1, want[:, None])[:, 0]).abs()
    # fp32 holds z only to an ulp of |z| (GPU division is not correctly rounded either)
    z = (logits[:, :v].double() / 0.7).abs().amax(-1)
    assert (err[rows] <= ref_err[rows] + 1e-5 + 8 * 2**-24 * z[rows]).all(), (err, ref_err)


test_interpreter_sample_rows = interpreter_only(_sample_test)


def _step_body(rank: int, world: int) -> None:
    """The fused step with the Triton kernels decodes the recompute oracle's greedy tokens."""
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate
    from tests.test_rollout import _model, _params, _prompts

    _, chunks = _model(ParallelConfig())  # RoPE, GQA, qk-layernorm, qkv bias
    model = unwrap(chunks[0])
    engine = KVCacheEngine(model, EngineOptions(context_bucket=8, decode_impl="triton"))
    assert str(engine.decode) == "fused/triton, triton attention"
    prompts, params = _prompts(5), _params(top_k=1, max_new_tokens=6)
    got = generate(model, prompts, params, torch.Generator().manual_seed(5), engine=engine)
    want = generate(model, prompts, params, torch.Generator().manual_seed(5), engine="recompute")
    assert got.responses == want.responses


@interpreter_only
def test_interpreter_fused_step_equals_recompute():
    from tests.dist_utils import run_distributed

    run_distributed(_step_body, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_decode_kernels(dtype):
    for bias, residual in [(False, False), (False, True), (True, True)]:
        _norm_test(dtype, bias, residual, device="cuda")
    for args in [(True, True, False), (True, True, True), (False, True, False)]:
        _qkv_test(dtype, *args, device="cuda")
    for bias in (False, True):
        _swiglu_test(dtype, bias, device="cuda")
    _sample_test(device="cuda")
    _attention_test(dtype, device="cuda", b=5)


def test_decode_attention_grid_decisions():
    """One wave of programs (splits), and the small tile for more than 2 and at most 4
    programs an SM (132 SMs): the choices measured ahead on one H200."""
    from megatron_grpo.kernels.decode_attention import num_splits, tile

    assert [num_splits(64, 4, 520), num_splits(64, 2, 1288), num_splits(64, 2, 260)] == [1, 2, 1]
    assert num_splits(1, 1, 768) == 3 and num_splits(1, 1, 100) == 1  # >= 256 keys a split
    got = [tile(n) for n in (128, 264, 265, 528, 529, 1024)]
    assert got == [(64, 4), (64, 4), (32, 2), (32, 2), (64, 4), (64, 4)]


def _attention_test(dtype, device="cpu", b=5, groups=2, heads=3, d=24, seq=768):
    """Rows of lengths 1 .. seq (split-K: several splits, some past a row's end) against
    float64, bounded by the same-dtype SDPA with a key-padding mask."""
    from megatron_grpo.kernels import decode_attention

    from megatron_grpo.megatron.attention.sdpa import sdpa

    g = torch.Generator().manual_seed(4)
    q = torch.randn(b, groups, heads, d, generator=g)
    cache = torch.randn(2, b + 1, groups, seq, d, generator=g) * 2
    cache[:, :, :, :, 0] += 8.0  # peaked scores
    pos = torch.tensor([0, 699, 63, 64, 400])[:b]
    ctx = 768  # 3 splits of 256 keys: rows 0, 63 and 64 end in the first
    q, cache, pos = q.to(device, dtype), cache.to(device, dtype), pos.to(device)
    mask = (torch.arange(ctx, device=device)[None, :] <= pos[:, None])[:, None, None]

    def ref(q, k, v):
        return sdpa(q, k[:b, :, :ctx], v[:b, :, :ctx], mask=mask, scale=0.3)

    truth = ref(q.double(), cache[0].double(), cache[1].double())
    want = ref(q, cache[0], cache[1])
    # the chosen splits and tile, and explicit ones: one split, 5 (154 keys, not a multiple of
    # the block), 32- and 128-key blocks with 8 warps, the small tile (32 keys, 2 warps)
    tiles = [{}, dict(splits=1), dict(splits=5, block_n=32), dict(block_n=64, num_warps=4)]
    tiles += [dict(block_n=128, num_warps=8), dict(splits=1, block_n=32, num_warps=2)]
    for tile in tiles:
        got = decode_attention(q, cache[0], cache[1], pos, ctx, 0.3, **tile)
        # fp32: sums over 700 keys in another order (and split) than SDPA's
        _check([got], [want], [truth], dtype, 16 if dtype == torch.float32 else 2)
    with pytest.raises(ValueError, match="block_n a power of two"):
        decode_attention(q, cache[0], cache[1], pos, ctx, 0.3, block_n=48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def _attention_interp(dtype):
    _attention_test(dtype)


test_interpreter_decode_attention = interpreter_only(_attention_interp)
