"""MoE pairs sorted by local expert (``ops.layers.sort_keys``): the torch reference against the
definition, the one-launch Triton counting sort against the reference (bit for bit: the outputs
are integers), and the decision between them. The interpreter tests run in a fresh process with
TRITON_INTERPRET=1; GPU tests (marked gpu, 1 GPU) run the compiled kernel, also in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from megatron_grpo.megatron.moe.permute import sort_by_expert  # noqa: E402
from megatron_grpo.ops.layers.sort_keys import (  # noqa: E402
    COUNTING_SORT_MAX_PAIRS,
    resolve_moe_sort,
    sort_keys,
    sort_keys_torch,
)
from tests.interpreter import interpreter_only, run_interpreter_tests  # noqa: E402

# (pairs, experts, offset, local experts): odd sizes around the kernel's 128-pair blocks; EP 1
# (offset 0, all local), a middle rank of EP 4, one local expert, many, and no pairs at all
CASES = [(1, 4, 0, 4), (7, 4, 0, 4), (128, 32, 0, 32), (129, 32, 8, 8), (300, 8, 6, 2),
         (1000, 128, 64, 64), (2048, 32, 16, 16), (0, 4, 0, 4), (257, 4, 3, 1)]  # fmt: skip
FILL = 12345


def test_interpreter_subprocess():
    """Run this module's interpreter tests in a fresh process with TRITON_INTERPRET=1."""
    run_interpreter_tests(__file__, timeout=600)


def _definition(ids: torch.Tensor, offset: int, num_keys: int, fill: int):
    """The contract spelled out pair by pair (python loops: small inputs only)."""
    keys = [i - offset if 0 <= i - offset < num_keys else num_keys for i in ids.tolist()]
    order = sorted(range(len(keys)), key=lambda p: (keys[p], p))
    pos = {p: j for j, p in enumerate(order)}
    back = [pos[p] if keys[p] < num_keys else fill for p in range(len(keys))]
    counts = [keys.count(e) for e in range(num_keys)]
    return [torch.tensor(x, dtype=torch.long) for x in (order, back, counts)]


def _ids(n: int, experts: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, experts, (n,), generator=g).to(device)


@pytest.mark.parametrize("n, experts, offset, local", CASES)
def test_reference_meets_the_definition(n, experts, offset, local):
    ids = _ids(n, experts, seed=n)
    got = sort_keys_torch(ids, offset, local, FILL)
    want = _definition(ids, offset, local, FILL)
    for name, a, b in zip(("order", "back", "counts"), got, want, strict=True):
        assert torch.equal(a.view(-1), b.view(-1)), name


def _kernel_test(device: str = "cpu") -> None:
    for seed, (n, experts, offset, local) in enumerate(CASES):
        ids = _ids(n, experts, seed, device)
        got = sort_keys(ids, offset, local, FILL, "counting")
        want = sort_keys_torch(ids, offset, local, FILL)
        for name, a, b in zip(("order", "back", "counts"), got, want, strict=True):
            assert torch.equal(a, b), f"{name} at {n} pairs, offset {offset}, {local} local"
    # every pair on one expert, and every pair on another rank's experts
    for ids in (torch.full((300,), 5, device=device), torch.arange(300, device=device) % 4):
        got = sort_keys(ids, 8, 4, FILL, "counting")
        for a, b in zip(got, sort_keys_torch(ids, 8, 4, FILL), strict=True):
            assert torch.equal(a, b)
    # [T, k] expert ids of a top-k router, as the local dispatch gives them
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(37)]).to(device)
    got, want = sort_by_expert(ids, 16, "counting"), sort_by_expert(ids, 16, "argsort")
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


test_interpreter_counting_sort_equals_argsort = interpreter_only(_kernel_test)


def _tiles_test() -> None:
    """The kernel with explicit tiles (narrow and long, wide and short; a tile wider than the
    pairs; more counting programs than keys) equals the reference; a bad tile is an error."""
    from megatron_grpo.kernels import sort_keys as kernel

    for tile in [(8, 1024), (4, 512), (32, 128), (4, 16), (16, 64)]:
        for seed, (n, experts, offset, local) in enumerate([*CASES[:5], CASES[8]]):
            ids = _ids(n, experts, seed)
            got = kernel(ids, offset, local, FILL, tile=tile)
            for a, b in zip(got, sort_keys_torch(ids, offset, local, FILL), strict=True):
                assert torch.equal(a, b), (tile, n, offset, local)
    with pytest.raises(ValueError, match="tile must be two powers of two"):
        kernel(_ids(8, 4, 0), 0, 4, FILL, tile=(8, 100))


test_interpreter_counting_sort_tiles = interpreter_only(_tiles_test)


def test_tiles_by_pair_count():
    from megatron_grpo.kernels.sort_keys import TILES, tile_for

    assert tile_for(1) == tile_for(512) == TILES[0][1] == (4, 512)
    assert tile_for(513) == tile_for(8192) == tile_for(10**6) == (8, 1024)


def test_the_decision_is_one_function():
    assert resolve_moe_sort("auto", 256, "cpu") == "argsort"  # no Triton on CPU tensors
    assert resolve_moe_sort("auto", COUNTING_SORT_MAX_PAIRS, "cuda") == "counting"
    assert resolve_moe_sort("auto", COUNTING_SORT_MAX_PAIRS + 1, "cuda") == "argsort"
    assert resolve_moe_sort("argsort", 16, "cuda") == "argsort"
    assert resolve_moe_sort("counting", 10**6, "cuda") == "counting"  # explicit: as asked
    with pytest.raises(ValueError, match="moe_sort must be one of .*did you mean 'counting'"):
        resolve_moe_sort("countng", 16, "cuda")


@pytest.mark.skipif(
    type(triton.language.zeros).__name__ == "InterpretedFunction", reason="outside the interpreter"
)
def test_explicit_counting_on_cpu_is_an_error():
    with pytest.raises(ValueError, match="moe_sort='counting' on cpu tensors needs Triton"):
        sort_keys(torch.zeros(4, dtype=torch.long), 0, 2, 4, "counting")


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_gpu_counting_sort_equals_argsort():
    _kernel_test("cuda")


@pytest.mark.gpu
@gpu
def test_gpu_counting_sort_replays_in_a_cuda_graph():
    """Decode-sized pairs (512 tokens x top-4, EP 2's second rank) in a graph, replayed on new
    routes written into the captured input."""
    ids = _ids(2048, 32, seed=1, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sort_keys(ids, 16, 16, 2048, "counting")  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sort_keys(ids, 16, 16, 2048, "counting")
    for seed in (2, 3):
        ids.copy_(_ids(2048, 32, seed=seed, device="cuda"))
        graph.replay()
        want = sort_keys_torch(ids, 16, 16, 2048)
        assert all(torch.equal(a, b) for a, b in zip(out, want, strict=True))
