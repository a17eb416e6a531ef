"""The LM head's GPU kernels compile for Hopper (sm_90) on a machine without a GPU.

Triton's interpreter runs a kernel's Python, not its compiler: a plain global read inside
``@triton.jit`` code, an unsupported layout or a config whose shared memory exceeds an H100's
227 KiB only fail on a GPU. ``kernels._aot`` compiles each launch at its default config for
sm_90 with the ``ptxas`` Triton ships; this checks them all in CI (timing and numerics on a GPU:
``pytest -m gpu``; numerics here: the interpreter tests).
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from megatron_grpo.kernels import _aot  # noqa: E402

from tests.interpreter import IN_INTERPRETER  # noqa: E402

pytestmark = pytest.mark.skipif(IN_INTERPRETER, reason="compiles for the GPU, not interpreted")
SPECS = {spec.name: spec for spec in _aot.hopper_specs()}


def _compiled(name: str):
    try:
        return _aot.compile_sm90(SPECS[name])
    except (FileNotFoundError, RuntimeError) as e:  # no ptxas for this triton: cannot check here
        if "ptxas" in str(e).lower():
            pytest.skip(f"triton cannot assemble for sm_90 here: {e}")
        raise


@pytest.mark.parametrize("name", sorted(SPECS))
def test_compiles_for_sm90_within_its_shared_memory(name):
    kernel = _compiled(name)
    assert kernel.metadata.shared <= _aot.SM90_MAX_SHARED, kernel.metadata.shared
    if " tma" in name and "first" not in name:  # Hopper's tensor-core MMA, not mma.sync
        assert "wgmma" in kernel.asm["ptx"]


@pytest.mark.parametrize("name", ["split_acc tma", "split_acc tma first", "split_acc resolve"])
def test_split_accumulator_does_not_spill(name):
    """Its epilogue holds the accumulator and the pair's tiles at once: TMA loads and stores
    keep per-element pointers out of registers (the pointer version spills)."""
    res = _aot.resources(_compiled(name))
    if res.stack is None:
        pytest.skip("cuobjdump not found next to triton's ptxas")
    assert res.stack == 0, res
