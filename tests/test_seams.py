"""The typed objects at the seams (LMHeadOptions, LossInputs, ParallelLayout) and the one-way
dependencies between the package's rooms (an import test in dependency order)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.loss import GRPOLossConfig, LossInputs, build_context, grpo_loss
from megatron_grpo.ops import fused_grpo_loss, fused_grpo_loss_plan, logprobs_plan
from megatron_grpo.ops.lm_head.options import DEFAULT_MEMORY_BUDGET, PATHS, REQUESTS, LMHeadOptions

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_grpo"

# ---------------------------------------------------------------- LMHeadOptions


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(path="liger"), ValueError, "path must be one of"),
        (dict(impl="cuda"), ValueError, "impl must be one of"),
        (dict(gemm="cublas"), ValueError, "gemm must be"),
        (dict(memory_budget=0), ValueError, "memory_budget must be"),
        (dict(memory_budget=True), ValueError, "memory_budget must be"),
        (dict(memory_budget=2.0**30), ValueError, "memory_budget must be"),
        (dict(chunk_size=0), ValueError, "chunk_size must be"),
        (dict(chunk_size=1.5), ValueError, "chunk_size must be"),
        (dict(temperature=0.0), ValueError, "temperature must be"),
        (dict(temperature=float("nan")), ValueError, "temperature must be"),
        (dict(temperature=True), TypeError, "temperature must be"),
        (dict(vocab_size=0), ValueError, "vocab_size must be"),
        (dict(vocab_size=3.0), ValueError, "vocab_size must be"),
    ],
)
def test_lm_head_options_errors_name_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        LMHeadOptions(**kwargs)


def test_lm_head_options_defaults_overrides_and_paths():
    opts = LMHeadOptions()
    assert (opts.path, opts.impl, opts.gemm, opts.chunk_size) == (None, "auto", "auto", None)
    assert opts.budget == DEFAULT_MEMORY_BUDGET
    assert LMHeadOptions.of(opts) is opts
    tuned = LMHeadOptions.of(opts, memory_budget=2**31, path="op")
    assert (tuned.budget, tuned.path, opts.path) == (2**31, "op", None)  # frozen: a new value
    with pytest.raises(TypeError, match="not_an_option"):
        LMHeadOptions.of(opts, not_an_option=1)
    with pytest.raises(AttributeError):
        opts.impl = "torch"  # type: ignore[misc]
    assert REQUESTS == ("fused", *PATHS) and "megatron" in PATHS
    assert LMHeadOptions.field_names() >= {"path", "impl", "memory_budget", "vocab_size"}


def test_training_config_and_step_read_the_one_list_of_paths():
    from megatron_grpo.megatron.step.forward import GRPOStep

    for path in REQUESTS:
        assert LMHeadOptions(path=path).path == path
        if path != "megatron":
            assert GRPOStep(GRPOLossConfig(), vocab_size=7, logprob_path=path).options.path == path


# ---------------------------------------------------------------- LossInputs and the options in use

T, H, V = 12, 8, 11
CU = torch.tensor([0, 5, 12])


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (T,), generator=g)
    loss_mask = torch.arange(T) % 5 >= 2
    batch = dict(
        old_logprobs=-torch.rand(T, generator=g, dtype=torch.float64),
        advantages=torch.randn(T, generator=g, dtype=torch.float64),
        loss_mask=loss_mask,
        cu_seqlens=CU,
        ref_logprobs=-torch.rand(T, generator=g, dtype=torch.float64),
    )
    return hidden, weight, targets, batch


def test_loss_inputs_object_and_keyword_forms_agree():
    hidden, weight, targets, batch = _inputs()
    cfg = GRPOLossConfig(kl_coef=0.05)
    inputs = LossInputs(**batch)
    opts = LMHeadOptions(impl="torch", temperature=0.8, chunk_size=4)
    by_object = fused_grpo_loss(hidden, weight, targets, cfg, inputs, options=opts)
    by_keyword = fused_grpo_loss(
        hidden, weight, targets, cfg, impl="torch", temperature=0.8, chunk_size=4, **batch
    )
    for a, b in zip(by_object[::2], by_keyword[::2], strict=True):  # loss, log-probs
        assert torch.equal(a, b)
    plan = fused_grpo_loss_plan(hidden, weight, targets, cfg, inputs, options=opts)
    assert plan == fused_grpo_loss_plan(hidden, weight, targets, cfg, options=opts, **batch)
    # keyword fields override those of the objects
    assert fused_grpo_loss_plan(hidden, weight, targets, cfg, inputs, options=opts,
                                path="op").path == "op"  # fmt: skip
    logp = by_object[2].detach()
    loss, _ = grpo_loss(cfg, inputs, logprobs=logp)
    assert torch.equal(loss, grpo_loss(cfg, logprobs=logp, **batch)[0])
    assert build_context(cfg, inputs).num_rows == int(batch["loss_mask"].sum())
    with pytest.raises(TypeError, match="advantage"):
        fused_grpo_loss(hidden, weight, targets, cfg, inputs, advantage=batch["advantages"])
    rows = logprobs_plan(hidden, weight, targets, opts, rows=batch["loss_mask"]).rows
    assert rows == int(batch["loss_mask"].sum())


def test_loss_inputs_from_batch_reads_attributes():
    from megatron_grpo.megatron.batch.packing import pack_sequences

    seqs = [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7])]
    masks = [torch.tensor([False, True, True, True]), torch.tensor([False, False, True])]
    packed = pack_sequences(
        seqs, masks, advantages=[1.0, -1.0], old_logprobs=[-torch.rand(4), -torch.rand(3)]
    )
    inputs = LossInputs.from_batch(packed, device=torch.device("cpu"), denominator=1.0)
    assert torch.equal(inputs.old_logprobs, packed.old_logprobs)
    assert torch.equal(inputs.advantages, packed.advantages)
    assert inputs.cu_seqlens is packed.cu_seqlens  # stays where it is: the loss moves it
    assert (inputs.ref_logprobs, inputs.rollout_logprobs) == (None, None)
    assert (inputs.denominator, inputs.cp_group) == (1.0, None)
    # duck-typed: any object with the attribute names
    plain = SimpleNamespace(**{k: getattr(packed, k) for k in (
        "old_logprobs", "advantages", "loss_mask", "cu_seqlens", "ref_logprobs",
        "rollout_logprobs")})  # fmt: skip
    assert torch.equal(LossInputs.from_batch(plain).loss_mask, packed.loss_mask)
    plain.advantages = None
    with pytest.raises(ValueError, match=r"SimpleNamespace\.advantages is required"):
        LossInputs.from_batch(plain)
    with pytest.raises(TypeError, match="old_logprobs"):  # required: never left out by accident
        LossInputs(advantages=packed.advantages, loss_mask=packed.loss_mask, cu_seqlens=CU)


# ---------------------------------------------------------------- ParallelLayout


@pytest.mark.parametrize(
    "tp, sp, cp, token, sequence",
    [
        (1, False, 1, 1, 1),
        (4, False, 1, 1, 1),
        (4, True, 1, 4, 4),
        (1, False, 2, 1, 4),
        (2, False, 2, 1, 4),
        (2, True, 2, 2, 8),
        (4, True, 3, 4, 24),
    ],
)
def test_parallel_layout_padding_multiples(tp, sp, cp, token, sequence):
    from megatron_grpo.megatron import ParallelConfig, ParallelLayout

    layout = ParallelLayout(tp_size=tp, cp_size=cp, sequence_parallel=sp)
    assert (layout.token_multiple, layout.sequence_multiple) == (token, sequence)
    par = ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp,
                         sequence_parallel=sp)  # fmt: skip
    assert ParallelLayout.of_config(par) == layout


def test_parallel_layout_checks():
    from megatron_grpo.megatron import ParallelLayout

    with pytest.raises(ValueError, match="tp_size"):
        ParallelLayout(tp_size=0)
    with pytest.raises(ValueError, match="cp_rank"):
        ParallelLayout(cp_size=2, cp_rank=2)


def test_parallel_layout_roles():
    from megatron_grpo.megatron import ParallelLayout

    one = ParallelLayout()
    assert one.is_logging_rank and one.is_replica_writer and one.is_first_stage
    assert one.is_last_stage and (one.dp_size, one.dp_group) == (1, None)
    mid = ParallelLayout(tp_size=2, tp_rank=1, pp_size=2, pp_rank=1, dp_cp_size=2)
    assert mid.is_last_stage and not mid.is_first_stage
    assert not mid.is_logging_rank and not mid.is_replica_writer
    assert ParallelLayout(pp_size=2, dp_cp_size=2, dp_cp_rank=1, cp_size=2).is_replica_writer
    assert not ParallelLayout(pp_size=2, pp_rank=1, dp_cp_size=2, dp_cp_rank=1).is_logging_rank
    with pytest.raises(ValueError, match="dp_rank"):
        ParallelLayout(dp_size=2, dp_rank=2)


def _current_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig, ParallelLayout, initialize_parallel

    par = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    layout = initialize_parallel(par, seed=1)
    assert (layout.tp_size, layout.tp_rank, layout.token_multiple) == (2, rank, 2)
    assert layout.tp_group is not None and layout.cp_group is None
    assert layout.is_pipeline_last_stage and layout.is_last_stage
    assert (layout.dp_size, layout.dp_cp_size, layout.tp_src_rank) == (1, 1, 0)
    assert layout.dp_group is not None and layout.mp_group is not None
    assert layout.is_replica_writer == (rank == 0) == layout.is_logging_rank
    assert ParallelLayout.current(sequence_parallel=True) == layout


def test_initialize_parallel_returns_the_layout():
    from tests.dist_utils import run_distributed

    run_distributed(_current_body, 2)


# The modules that build the layout or the model, the only ones that read megatron-core's
# parallel_state; every other module is handed a ParallelLayout (the reward scorer of a
# plug-in's source looks it up through megatron/parallel.py's current_layout).
READS_PARALLEL_STATE = {
    "megatron_grpo.megatron.layout",  # ParallelLayout.current (every fact), the rank groups
    "megatron_grpo.megatron.parallel",  # initializes it, seeds per rank
    "megatron_grpo.megatron.model.build",  # pipeline stages of each chunk, checks the sizes
    "megatron_grpo.megatron.model.layer_spec",  # the CP and expert groups the modules are given
}


def test_only_the_layout_and_model_builders_read_parallel_state():
    readers = set()
    for name, path in _modules().items():
        targets = _imports(path, runtime_only=False)
        if any(t.startswith("megatron.core.parallel_state") for t in targets):
            readers.add(name)
    assert readers <= READS_PARALLEL_STATE, (
        "read the ParallelLayout instead of megatron-core's parallel_state in: "
        + ", ".join(sorted(readers - READS_PARALLEL_STATE))
    )


# ---------------------------------------------------------------- one-way dependencies

# The rooms and what each may import (train -> rollout -> megatron -> ops -> kernels; loss/
# imports no Megatron and no ops; rollout/ never imports train/). "<megatron-core>": the third-party megatron package.
# Leaf modules every room may import (they import nothing of the package): the user-input
# error type, the third-party warnings log and the step profiler.
LEAVES = {"errors", "warning_log", "profiling"}
ALLOWED = {
    "errors": set(),
    "warning_log": set(),
    "profiling": set(),
    "config": LEAVES,
    "kernels": set(),
    "loss": set(),
    "ops": {"config", "loss", "kernels"} | LEAVES,
    "megatron": {"config", "loss", "ops", "kernels", "<megatron-core>"} | LEAVES,
    "convert": {"config", "loss", "ops", "kernels", "megatron", "<megatron-core>"} | LEAVES,
    "rollout": {"config", "loss", "ops", "kernels", "megatron", "<megatron-core>"} | LEAVES,
    "train": {
        "config",
        "loss",
        "ops",
        "kernels",
        "megatron",
        "convert",
        "rollout",
        "<megatron-core>",
    }
    | LEAVES,  # fmt: skip
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue  # runs the CLI when imported
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(path: Path, runtime_only: bool) -> list[str]:
    """Absolute module names ``path`` imports; ``runtime_only``: those run at its import (not
    inside functions or ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    nodes = []
    todo = list(tree.body) if runtime_only else list(ast.walk(tree))
    while todo:
        node = todo.pop()
        if runtime_only and isinstance(node, (ast.If, ast.Try)):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            todo += [n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)]
        if isinstance(node, ast.Import):
            nodes += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            nodes += [f"{node.module}.{a.name}" for a in node.names] + [node.module]
    return nodes


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "megatron":
        return "<megatron-core>"
    return parts[1] if parts[0] == "megatron_grpo" and len(parts) > 1 else None


def test_rooms_import_one_way():
    bad = []
    for name, path in _modules().items():
        src = _room(name)
        for target in _imports(path, runtime_only=False):
            dst = _room(target)
            if src is not None and dst not in (None, src) and dst not in ALLOWED[src]:
                bad.append(f"{name} imports {target}")
    assert not bad, "back-edges between rooms:\n" + "\n".join(sorted(set(bad)))


def test_the_engine_knows_nothing_of_the_rollout_wing():
    """rollout/engine/ generates from prompts; the wing around it (sources, partial rollouts,
    dynamic sampling, scoring, tasks) drives it, never the reverse."""
    bad = [
        f"{name} imports {target}"
        for name, path in _modules().items()
        if name.startswith("megatron_grpo.rollout.engine")
        for target in _imports(path, runtime_only=False)
        if target.startswith("megatron_grpo.rollout.")
        and not target.startswith("megatron_grpo.rollout.engine")
    ]
    assert not bad, "the engine reaches into the wing:\n" + "\n".join(sorted(set(bad)))


# The trainer's room keeps the loop, optimizer, checkpoint, metrics, run directory and stop
# handling (everything that produces scored samples lives in rollout/); both rooms stay small.
# 20: logprob_sizes.py, config.py's log-prob pass sizes (500 lines); 21: layout_checks.py, its
# checks across sections (config.py again at 500 lines)
TRAIN_MAX_FILES = 21
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def test_train_and_rollout_rooms_stay_small():
    train_files = sorted((PACKAGE / "train").rglob("*.py"))
    assert len(train_files) <= TRAIN_MAX_FILES, [str(p.relative_to(ROOT)) for p in train_files]
    long_files, long_functions = [], []
    for room in ("train", "rollout"):
        for path in sorted((PACKAGE / room).rglob("*.py")):
            text = path.read_text()
            where = path.relative_to(ROOT)
            if len(text.splitlines()) > MAX_FILE_LINES:
                long_files.append(f"{where}: {len(text.splitlines())} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    size = node.end_lineno - node.lineno + 1
                    if size > MAX_FUNCTION_LINES:
                        long_functions.append(f"{where}:{node.lineno} {node.name}: {size} lines")
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def _import_graph(runtime_only: bool) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``runtime_only``: at its own import;
    ``from pkg import sub`` counts as pkg.sub; another room's package ``__init__`` runs first,
    so it counts too)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = set()
        for target in _imports(path, runtime_only=runtime_only):
            if target in modules and target != name:
                deps.add(target)
                room = ".".join(target.split(".")[:2])
                if _room(target) != _room(name) and room in modules:
                    deps.add(room)
        # "from pkg import name" also lists pkg: keep it only where name is no module
        graph[name] = {d for d in deps if not any(o.startswith(d + ".") for o in deps)}
    return graph


def _order(graph: dict[str, set[str]]) -> list[str]:
    """Dependencies first; an import circle fails, naming its modules."""
    order, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        if state.get(node) == "done":
            return
        if state.get(node) == "open":
            cycle = stack[stack.index(node) :] + [node]
            raise AssertionError("import circle: " + " -> ".join(cycle))
        state[node] = "open"
        for dep in sorted(graph[node]):
            visit(dep, [*stack, node])
        state[node] = "done"
        order.append(node)

    for node in sorted(graph):
        visit(node, [])
    return order


def test_every_module_imports_in_dependency_order():
    """No import circle between modules, function-level imports included (one that breaks a
    circle at runtime leaves the circle in the design: model.py <-> routing_replay.py was one),
    and every module imports in that order in a fresh interpreter."""
    order = _order(_import_graph(runtime_only=False))
    assert "megatron_grpo.megatron.moe.routing_replay" in order
    script = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script, *order],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_package_is_formatted_by_the_formatter():
    """``ruff format`` formats every line of the package (Triton kernels, in kernels/, keep
    their hand layout): no ``# fmt: skip`` / ``# fmt: off`` in megatron_grpo/."""
    marks = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "# fmt: skip" in line or "# fmt: off" in line
    ]
    assert not marks, "formatter overrides: " + ", ".join(marks)


# ---------------------------------------------------------------- the kernel road

KERNEL_ROAD = "megatron_grpo.ops.kernels"  # the one module that imports megatron_grpo.kernels


def _kernel_imports(path: Path) -> list[tuple[int, str]]:
    """(line, how) of every import of ``megatron_grpo.kernels`` in ``path``: import statements
    anywhere (function-local too) and ``importlib.import_module("megatron_grpo.kernels...")``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
        if any(str(n).startswith("megatron_grpo.kernels") for n in names):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_one_module_reaches_the_kernels():
    roads = {name: hits for name, path in _modules().items() if (hits := _kernel_imports(path))}
    assert set(roads) == {KERNEL_ROAD}, (
        "reach megatron_grpo.kernels through megatron_grpo.ops.kernels only: "
        + "; ".join(f"{n}: {h}" for n, h in roads.items() if n != KERNEL_ROAD)
    )
    # and the road's own imports sit at its top, none inside a function
    tree = ast.parse(_modules()[KERNEL_ROAD].read_text())
    top = [n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(line in top for line, _ in roads[KERNEL_ROAD]), roads[KERNEL_ROAD]


def test_one_vocabulary_of_kernel_choices():
    """Every kernel choice reads its names from ops.kernels.CHOICES; a bad name says which."""
    from megatron_grpo.megatron.attention.packed import BUCKETS
    from megatron_grpo.ops.kernels import CHOICES, IMPLS, LayerKernels, check_choice
    from megatron_grpo.ops.layers.grouped_mm import GROUPED_MM_IMPLS

    assert IMPLS is CHOICES["impl"] and GROUPED_MM_IMPLS is CHOICES["grouped_gemm"]
    assert BUCKETS is CHOICES["attention"]
    assert LayerKernels() == LayerKernels("auto", "auto", "auto", "plan_free")
    for field, bad, hint in [("elementwise", "trition", "triton"), ("rope", "megatorn", "megatron"),
                             ("grouped_gemm", "padded", "padded_bmm"), ("attention", "x", None)]:  # fmt: skip
        with pytest.raises(ValueError, match=f"^{field} must be one of") as err:
            LayerKernels(**{field: bad})
        assert (f"did you mean {hint!r}" in str(err.value)) == (hint is not None)
    with pytest.raises(ValueError, match="decode impl must be one of"):
        check_choice("impl", "cuda", "decode impl")
    with pytest.raises(AttributeError):
        LayerKernels().rope = "torch"  # type: ignore[misc]  (frozen: chosen once)


def test_layer_kernels_recipe_section():
    """``model.layer_kernels`` maps 1:1 onto LayerKernels; unknown keys name the closest."""
    from megatron_grpo.config import ConfigError, from_dict
    from megatron_grpo.megatron import ModelConfig

    cfg = from_dict(ModelConfig, {"vocab_size": 8, "layer_kernels": {"rope": "torch"}})
    assert cfg.layer_kernels.rope == "torch" and cfg.layer_kernels.elementwise == "auto"
    with pytest.raises(ConfigError, match="did you mean 'attention'"):
        from_dict(ModelConfig, {"vocab_size": 8, "layer_kernels": {"atention": "exact"}})
    with pytest.raises(ConfigError, match="layer_kernels.rope must be one of"):
        from_dict(ModelConfig, {"vocab_size": 8, "layer_kernels": {"rope": "fast"}})


# ---------------------------------------------------------------- keyword forms

# The documented keyword forms of the public LM-head and loss functions (README: their options'
# and inputs' fields by keyword); no other package function takes ``**overrides``.
KEYWORD_FORMS = {
    "megatron_grpo.loss.grpo.grpo_loss",
    "megatron_grpo.loss.inputs.LossInputs.of",
    "megatron_grpo.loss.math.build_context",
    "megatron_grpo.ops.lm_head.fused_grpo.fused_grpo_loss",
    "megatron_grpo.ops.lm_head.fused_grpo.fused_grpo_loss_plan",
    "megatron_grpo.ops.lm_head.logprobs.logprobs_plan",
    "megatron_grpo.ops.lm_head.logprobs.vocab_parallel_logprobs",
    "megatron_grpo.ops.lm_head.options.LMHeadOptions.of",
    "megatron_grpo.ops.lm_head.plan.plan_lm_head",
}


def _override_functions(name: str, path: Path) -> set[str]:
    found = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}.{child.name}")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if child.args.kwarg is not None and child.args.kwarg.arg == "overrides":
                    found.add(f"{prefix}.{child.name}")

    visit(ast.parse(path.read_text()), name)
    return found


def test_no_new_overrides_keyword_forms():
    found = set().union(*(_override_functions(n, p) for n, p in _modules().items()))
    assert found <= KEYWORD_FORMS, (
        f"pass a typed value instead of **overrides: {found - KEYWORD_FORMS}"
    )
