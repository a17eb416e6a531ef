"""Every bad input under torchrun at TP 2 is one ``error:`` line (``config error:`` for the
config), printed once by rank 0, with no traceback from any rank, and the documented exit code
(2 bad input, 1 a failing reward function; torchrun itself exits 1 and lists the ranks' codes).
The setting is docs/byo_task.md's: the seeded tiny Qwen3 stand-in, converted, a verl-layout
Parquet file and a reward file, all in ``tmp_path``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.dist_utils import free_ports

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("pyarrow")
pytest.importorskip("transformers")

GOOD_ROW = {"prompt": [{"role": "user", "content": "what is 1 plus 2 ?"}],
            "reward_model": {"ground_truth": "3"}, "data_source": "toy/plus"}  # fmt: skip
BOOM = "def helper(text):\n    raise ValueError('boom')\n\n\ndef score(solution_str, ground_truth):\n    return helper(solution_str)\n"  # noqa: E501
TYPO_RECIPE = "parallel:\n  tensor_model_parallel_size: 2\nrollout:\n  num_prompt: 8\n"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """tmp dir with ckpt/ (the converted stand-in), data/, rewards/ and bad variants."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_grpo.convert import hf_to_mcore
    from megatron_grpo.convert.tiny import save_tiny_hf

    root = tmp_path_factory.mktemp("bad_inputs")
    ckpt = hf_to_mcore(save_tiny_hf("qwen3", root / "hf", seed=0), root / "ckpt")
    (root / "data").mkdir()
    pq.write_table(pa.Table.from_pylist([GOOD_ROW] * 8), root / "data" / "train.parquet")
    pq.write_table(pa.Table.from_pylist([{"question": "x"}]), root / "data" / "noprompt.parquet")
    pq.write_table(
        pa.Table.from_pylist([GOOD_ROW, {**GOOD_ROW, "prompt": None}]),
        root / "data" / "nullrow.parquet",
    )
    (root / "data" / "corrupt.parquet").write_bytes(b"PAR1 not a parquet file")
    (root / "rewards").mkdir()
    (root / "rewards" / "ok.py").write_text(
        "def score(solution_str, ground_truth):\n    return 0.0\n"
    )
    (root / "rewards" / "boom.py").write_text(BOOM)
    (root / "typo.yaml").write_text(TYPO_RECIPE)
    damaged = shutil.copytree(ckpt, root / "damaged")
    shard = sorted(damaged.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    return root


# (case, --set overrides, other arguments, exit code of the ranks, the error line's start)
CASES = [
    # every mistake at once: the typo, and the stand-in's context is shorter than the default
    # prompt + response lengths, which typo.yaml (unlike byo_task.yaml) leaves as they are
    ("yaml_typo", [], ["--config", "{w}/typo.yaml"], 2,
     "config error: 2 mistakes in {w}/typo.yaml (with its --set overrides):"),
    ("set_typo", ["rollout.num_prompt=8"], [], 2,
     "config error: unknown config key 'rollout.num_prompt'; did you mean 'num_prompts'?"),
    ("missing_file", ["rollout.dataset.train_files=[{w}/data/nope.parquet]"], [], 2,
     "error: rollout.dataset.train_files[0]: no such file '{w}/data/nope.parquet'"),
    ("no_prompt_column", ["rollout.dataset.train_files=[{w}/data/noprompt.parquet]"], [], 2,
     "error: {w}/data/noprompt.parquet:1: no column 'prompt'"),
    ("corrupt_parquet", ["rollout.dataset.train_files=[{w}/data/corrupt.parquet]"], [], 2,
     "error: {w}/data/corrupt.parquet: cannot read as Parquet"),
    ("null_row", ["rollout.dataset.train_files=[{w}/data/nullrow.parquet]"], [], 2,
     "error: {w}/data/nullrow.parquet:2: column 'prompt' is null"),
    ("missing_tokenizer", ["rollout.dataset.tokenizer_dir={w}/data"], [], 2,
     "error: rollout.dataset.tokenizer_dir '{w}/data': cannot load a tokenizer"),
    ("missing_reward_file", ["rollout.reward_fn={w}/rewards/nope.py:score"], [], 2,
     "error: rollout.reward_fn: no file '{w}/rewards/nope.py'"),
    ("misspelled_reward", ["rollout.reward_fn={w}/rewards/ok.py:scor"], [], 2,
     "error: rollout.reward_fn: '{w}/rewards/ok.py' has no callable 'scor'; did you mean 'score'?"),
    ("reward_raises", ["rollout.reward_fn={w}/rewards/boom.py:score"], [], 1,
     "error: rollout.reward_fn '{w}/rewards/boom.py:score' failed on {w}/data/train.parquet:"),
    ("damaged_checkpoint", ["checkpoint.load={w}/damaged"], [], 2,
     "error: checkpoint {w}/damaged is damaged: __0_0.distcp: EOFError: truncated"),
    ("resume_without_checkpoint", ["checkpoint.dir={w}/runs/none"], ["--resume"], 2,
     "error: --resume: checkpoint.dir '{w}/runs/none' does not exist"),
]  # fmt: skip


def _rank_logs(logs: Path) -> dict[int, str]:
    return {
        rank: "".join(f.read_text() for f in sorted(logs.glob(f"*/attempt_0/{rank}/std*.log")))
        for rank in (0, 1)
    }


def _torchrun(world: Path, case: str, sets: list[str], args: list[str], port: int):
    """The case's torchrun (2 ranks, TP 2) on ``port``: its result and each rank's output."""
    w, logs = str(world), world / "logs" / case
    base = [
        f"checkpoint.load={w}/ckpt", f"rollout.dataset.train_files=[{w}/data/train.parquet]",
        "rollout.dataset.val_files=[]", f"rollout.dataset.tokenizer_dir={w}/ckpt/hf",
        f"rollout.reward_fn={w}/rewards/ok.py:score", "evaluation.interval=0",
        "checkpoint.dir=null", f"logging.dir={w}/runs/{case}", "training.steps=1",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(port), "--log-dir", str(logs), "--tee", "3"]
    cmd += ["-m", "megatron_grpo.train"]
    cmd += (
        [a.format(w=w) for a in args]
        if "--config" in args
        else ["--config", "recipes/byo_task.yaml", *args]
    )
    cmd += [x for s in base + [s.format(w=w) for s in sets] for x in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return out, _rank_logs(logs)


@pytest.fixture(scope="module")
def runs(world, request) -> dict[str, tuple[subprocess.CompletedProcess, dict[int, str]]]:
    """Every selected case's torchrun, three at a time (each its own directories and port): a
    failed run spends seconds idle (torchrun waits for the other rank to exit), which the
    others' start-up fills."""
    here = [i for i in request.session.items if i.path == request.path and hasattr(i, "callspec")]
    cases = [c for c in CASES if any(i.callspec.params.get("case") == c[0] for i in here)]
    ports = free_ports(len(cases))
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {
            case: pool.submit(_torchrun, world, case, sets, args, port)
            for (case, sets, args, _, _), port in zip(cases, ports, strict=True)
        }
        return {case: f.result() for case, f in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize(("case", "sets", "args", "code", "line"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_input_is_one_error_line_from_one_rank(world, runs, case, sets, args, code, line):
    w = str(world)
    out, ranks = runs[case]  # _torchrun(world, case, sets, args, port)
    text = ranks[0] + ranks[1]
    errors = [x for x in text.splitlines() if x.startswith(("error:", "config error:"))]
    assert len(errors) == 1 and errors[0].startswith(line.format(w=w)), (errors, text[-3000:])
    assert errors[0] in ranks[0] and "Traceback" not in text, text[-3000:]
    # torchrun: exit 1 and its own report listing each rank's code
    assert out.returncode == 1 and f"exitcode  : {code} (pid:" in out.stderr, out.stderr[-3000:]
    if case == "yaml_typo":  # each mistake on its own line, the recipe's with FILE:LINE
        rest = ranks[0].split(errors[0], 1)[1].splitlines()[1:3]
        assert rest[0].startswith(f"  {w}/typo.yaml:4: unknown config key 'rollout.num_prompt'")
        assert "exceeds model.max_sequence_length" in rest[1], rest
    if case == "reward_raises":  # the user's own frames follow, none of megatron_grpo's
        rest = ranks[0].split(errors[0], 1)[1].splitlines()[1:3]
        assert rest == [
            f"  {w}/rewards/boom.py:6: return helper(solution_str)",
            f"  {w}/rewards/boom.py:2: raise ValueError('boom')",
        ], rest
