"""The GPU kernels compile for Hopper (sm_90) on a machine without a GPU.

Triton's interpreter runs a kernel's Python, not its compiler: a plain global read inside
``@triton.jit`` code, an unsupported layout or a config whose shared memory exceeds an H100's
227 KiB only fail on a GPU. Triton compiles ahead of time for a named target with the ``ptxas``
it ships, so CI (CPU) compiles each kernel at its default config for sm_90 and checks its shared
memory. (Timing and numerics on a GPU: ``pytest -m gpu``; numerics here: the interpreter tests.)
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from tests.interpreter import IN_INTERPRETER  # noqa: E402

pytestmark = pytest.mark.skipif(IN_INTERPRETER, reason="compiles for the GPU, not interpreted")
SM90_MAX_SHARED = 232448  # bytes of shared memory a block may opt into on sm_90


def _compile(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                    constexprs=constexprs)  # fmt: skip
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))  # fmt: skip
    except (FileNotFoundError, RuntimeError) as e:  # no ptxas for this triton: cannot check here
        if "ptxas" in str(e).lower():
            pytest.skip(f"triton cannot assemble for sm_90 here: {e}")
        raise
    assert kernel.metadata.shared <= SM90_MAX_SHARED, kernel.metadata.shared
    return kernel


def _split_config():
    from megatron_grpo.kernels import split_accumulator as sa

    cfg = dict(sa.CONFIG)
    return sa, cfg.pop("num_warps"), cfg.pop("num_stages"), cfg


def test_split_accumulator_tma_compiles_for_sm90():
    sa, warps, stages, cfg = _split_config()
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    sig = {"a_desc": f"tensordesc<bf16[{bk}, {bm}]>", "b_desc": f"tensordesc<bf16[{bk}, {bn}]>",
           "hi_desc": f"tensordesc<bf16[{bm}, {bn}]>", "lo_desc": f"tensordesc<i8[{bm}, {bn}]>",
           "M": "i32", "N": "i32", "K": "i32"}  # fmt: skip
    for first in (True, False):
        kernel = _compile(sa._build("tma"), sig, dict(FIRST=first, DOT_F32=False, NUM_SMS=132,
                                                      **cfg), warps, stages)  # fmt: skip
        assert "wgmma" in kernel.asm["ptx"]  # Hopper's tensor-core MMA, not the mma.sync path


def test_split_accumulator_pointer_and_resolve_compile_for_sm90():
    sa, warps, stages, cfg = _split_config()
    sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "hi_ptr": "*bf16", "lo_ptr": "*i8", "M": "i32",
           "N": "i32", "K": "i32", "stride_a": "i32", "stride_b": "i32", "stride_o": "i32"}  # fmt: skip
    _compile(sa._build("pointer"), sig, dict(FIRST=False, DOT_F32=False, **cfg), warps, stages)
    sig = {"hi_ptr": "*bf16", "lo_ptr": "*i8", "scale_ptr": "*fp32", "n": "i32"}
    _compile(sa._build("resolve"), sig, dict(ROUND=False, BLOCK=4096), 8, 1)


def test_head_gemm_tma_compiles_for_sm90():
    from megatron_grpo.kernels import head_gemm as hg

    cfg = dict(hg.TMA_CONFIG)
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    bm, bk, bn = cfg["BLOCK_M"], cfg["BLOCK_K"], hg.STATS_BLOCK_N
    f32 = "*fp32"
    sig = {"h_desc": f"tensordesc<bf16[{bm}, {bk}]>", "w_desc": f"tensordesc<bf16[{bn}, {bk}]>",
           "t_ptr": "*i64", "m_ptr": f32, "s_ptr": f32, "zt_ptr": f32, "b_ptr": f32,
           "shifted_ptr": "*bf16", "lse_ptr": f32, "glp_ptr": f32, "gent_ptr": f32, "pz_ptr": f32,
           "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_o": "i32",
           "inv_t": "fp32"}  # fmt: skip
    for grad in (False, True):
        consts = dict(GRAD=grad, HAS_ENTROPY=True, STORE_SHIFTED=not grad, DOT_F32=False,
                      NUM_SMS=132, BLOCK_N=bn, **cfg)  # fmt: skip
        _compile(hg._build_tma(), sig, consts, warps, stages)
