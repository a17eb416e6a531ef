"""Compiling the LM-head (and fused q / k norm + RoPE) kernels for Hopper without a GPU: what
each launch costs in registers, spilled bytes and shared memory.

Triton compiles ahead of time for a named target with the ``ptxas`` it ships, so a CPU machine
can check that a kernel compiles at its default config (the interpreter runs the Python, not the
compiler), fits an H100's shared memory, and whether ``ptxas`` spilled registers to local memory
(``cuobjdump --dump-resource-usage``: ``STACK`` bytes per thread). Used by
tests/test_kernels_compile.py and tools/kernel_resources.py. :func:`hopper_specs` is the one list
of launches (kernel, mode, signature, default config).
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
from dataclasses import dataclass, field

SM90_MAX_SHARED = 232448  # bytes of shared memory a block may opt into on sm_90
_F32 = "*fp32"


@dataclass(frozen=True)
class KernelSpec:
    """One launch of a kernel: its jit function's builder, argument types, constexprs, config."""

    name: str
    build: object  # () -> the triton.jit function
    signature: dict
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class Resources:
    shared: int  # bytes of shared memory per block
    registers: int | None  # per thread (None: cuobjdump not found)
    stack: int | None  # bytes of local memory per thread: spilled registers


def compile_sm90(spec: KernelSpec):
    """The compiled kernel (raises the compiler's error)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**spec.signature, **dict.fromkeys(spec.constexprs, "constexpr")}
    src = ASTSource(fn=spec.build(), signature=sig, constexprs=dict(spec.constexprs))
    opts = dict(num_warps=spec.num_warps, num_stages=spec.num_stages)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def resources(kernel) -> Resources:
    """Shared memory (Triton's metadata), registers and stack (``cuobjdump``, if found)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    regs = stack = None
    if os.path.exists(tool):
        path = f"/tmp/_aot_{os.getpid()}.cubin"
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True)
        os.remove(path)
        found = re.search(r"REG:(\d+) STACK:(\d+)", out.stdout)
        if found:
            regs, stack = int(found.group(1)), int(found.group(2))
    return Resources(kernel.metadata.shared, regs, stack)


def hopper_specs() -> list[KernelSpec]:
    """The LM head's GPU launches at their default configs (bf16 operands), and the fused
    q / k norm + RoPE kernels (their q / k branches must give one pointer type)."""
    specs = _head_gemm_specs() + _split_specs() + _logits_grad_specs()
    return specs + _qk_norm_rope_specs() + _rope_specs()


def _head_gemm_specs() -> list[KernelSpec]:
    from . import head_gemm as hg

    cfg = dict(hg.TMA_CONFIG)
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    store = cfg.pop("TMA_STORE")
    bm, bk, bn = cfg["BLOCK_M"], cfg["BLOCK_K"], hg.STATS_BLOCK_N
    sig = {"h_desc": f"tensordesc<bf16[{bm}, {bk}]>", "w_desc": f"tensordesc<bf16[{bn}, {bk}]>",
           "t_ptr": "*i64", "m_ptr": _F32, "s_ptr": _F32, "zt_ptr": _F32, "b_ptr": _F32,
           "shifted_ptr": "*bf16", "lse_ptr": _F32, "glp_ptr": _F32, "gent_ptr": _F32,
           "pz_ptr": _F32, "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
           "stride_o": "i32", "inv_t": "fp32"}  # fmt: skip
    modes = {"stats": (False, False, False), "stats+entropy": (False, True, False),
             "stats+shifted": (False, False, True), "stats+entropy+shifted": (False, True, True),
             "grad": (True, False, False), "grad+entropy": (True, True, False)}  # fmt: skip
    if store:
        tile = f"tensordesc<bf16[{bm}, {bn}]>"  # the output tile, stored by TMA
        sig |= {"shifted_ptr": tile, "out_ptr": tile}
    return [
        KernelSpec(
            f"head_gemm tma {mode}",
            hg._build_tma,
            sig,
            dict(
                GRAD=grad,
                HAS_ENTROPY=ent,
                STORE_SHIFTED=shifted,
                DOT_F32=False,
                NUM_SMS=132,
                BLOCK_N=bn,
                TMA_STORE=store,
                **cfg,
            ),
            warps,
            stages,
        )  # fmt: skip
        for mode, (grad, ent, shifted) in modes.items()
    ]


def _split_specs() -> list[KernelSpec]:
    from . import split_accumulator as sa

    cfg = dict(sa.CONFIG)
    warps, stages, ctas = cfg.pop("num_warps"), cfg.pop("num_stages"), cfg.pop("CTAS_PER_SM")
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tma = {"a_desc": f"tensordesc<bf16[{bk}, {bm}]>", "b_desc": f"tensordesc<bf16[{bk}, {bn}]>",
           "hi_desc": f"tensordesc<bf16[{bm}, {bn}]>", "lo_desc": f"tensordesc<i8[{bm}, {bn}]>",
           "M": "i32", "N": "i32", "K": "i32"}  # fmt: skip
    ptr = {"a_ptr": "*bf16", "b_ptr": "*bf16", "hi_ptr": "*bf16", "lo_ptr": "*i8", "M": "i32",
           "N": "i32", "K": "i32", "stride_a": "i32", "stride_b": "i32", "stride_o": "i32"}  # fmt: skip
    resolve = {"hi_ptr": "*bf16", "lo_ptr": "*i8", "scale_ptr": _F32, "n": "i32"}
    flags = dict(FIRST=False, DOT_F32=False, **cfg)
    return [
        KernelSpec(
            "split_acc tma",
            lambda: sa._build("tma"),
            tma,
            {**flags, "NUM_PROGRAMS": 132 * ctas},
            warps,
            stages,
        ),  # fmt: skip
        KernelSpec(
            "split_acc tma first",
            lambda: sa._build("tma"),
            tma,
            {**flags, "FIRST": True, "NUM_PROGRAMS": 132 * ctas},
            warps,
            stages,
        ),  # fmt: skip
        KernelSpec("split_acc pointer", lambda: sa._build("pointer"), ptr, flags, warps, stages),
        KernelSpec(
            "split_acc resolve",
            lambda: sa._build("resolve"),
            resolve,
            dict(ROUND=False, BLOCK=4096),
            8,
            1,
        ),  # fmt: skip
    ]


def _logits_grad_specs() -> list[KernelSpec]:
    lg = importlib.import_module(".logits_grad", __package__)  # the package exports a function

    sig = {"logits_ptr": "*bf16", "targets_ptr": "*i64", "lse_ptr": _F32, "grad_logp_ptr": _F32,
           "grad_entropy_ptr": _F32, "entropy_pz_ptr": _F32, "shift_ptr": _F32,
           "out_ptr": "*bf16", "n_valid": "i32", "v_local": "i32", "stride_row": "i32",
           "stride_out_row": "i32", "inv_temperature": "fp32", "n_rows": "i32",
           "shift_block": "i32"}  # fmt: skip
    consts = dict(BLOCK_V=lg.BLOCK_V, HAS_ENTROPY=False, NARROW_ALIAS=False, HAS_SHIFT=True)
    return [KernelSpec("logits_grad shifted", _jit(lg._grad_kernel), sig, consts, lg.NUM_WARPS, 1)]


def _qk_norm_rope_specs() -> list[KernelSpec]:
    qk = importlib.import_module(".qk_norm_rope", __package__)

    bf16 = "*bf16"
    tables = {"cos_ptr": bf16, "sin_ptr": bf16}
    fwd = {"q_ptr": bf16, "k_ptr": bf16, "wq_ptr": bf16, "wk_ptr": bf16, **tables,
           "qo_ptr": bf16, "ko_ptr": bf16, "rq_ptr": _F32, "rk_ptr": _F32, "T": "i32",
           **dict.fromkeys(("sq_t", "sq_h", "sk_t", "sk_h", "stride_c"), "i32"),
           "eps": "fp32"}  # fmt: skip
    bwd = {"gq_ptr": bf16, "gk_ptr": bf16, "q_ptr": bf16, "k_ptr": bf16, "wq_ptr": bf16,
           "wk_ptr": bf16, "rq_ptr": _F32, "rk_ptr": _F32, **tables, "dq_ptr": bf16,
           "dk_ptr": bf16, "dw_ptr": _F32, "T": "i32", "tiles": "i32",
           **dict.fromkeys((*qk._STRIDES, "stride_c"), "i32")}  # fmt: skip
    shape = dict(NQ=32, NK=8, ROT=128, D=128, BLOCK_T=qk.BLOCK_T, BLOCK_D=128)
    return [
        KernelSpec(
            f"qk_norm_rope {name}{' interleaved' * i}",
            lambda k=k: qk._build(False)[k],
            sig,
            {**shape, "INTERLEAVED": i},
        )  # fmt: skip
        for name, k, sig in (("fwd", 0, fwd), ("bwd", 1, bwd))
        for i in (False, True)
    ]


def _rope_specs() -> list[KernelSpec]:
    rope = importlib.import_module(".rope", __package__)

    sig = {"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16",
           **dict.fromkeys(("T", "stride_xt", "stride_xh", "stride_ot", "stride_oh",
                            "stride_c"), "i32")}  # fmt: skip
    shape = dict(ROT=128, D=128, BLOCK_T=rope.BLOCK_T, BLOCK_D=128)
    return [
        KernelSpec(
            f"rope {'bwd' if b else 'fwd'}{' interleaved' * i}",
            lambda: rope._build(False),
            sig,
            {**shape, "INTERLEAVED": i, "BACKWARD": b},
        )  # fmt: skip
        for b in (False, True)
        for i in (False, True)
    ]


def _jit(fn):
    """A builder of ``fn``'s plain jit function (the launchers wrap theirs in heuristics)."""

    def build():
        import triton

        return triton.jit(fn)

    return build
