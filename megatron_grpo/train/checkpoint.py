"""Checkpoints with megatron-core ``dist_checkpointing``: model, optimizer, RNG, step, data position.

Layout under ``checkpoint.dir``::

    step_00000010/      one dist_checkpointing (torch_dist) directory per save, plus
      model_config.yaml   the run's resolved ModelConfig (as tools/convert_checkpoint.py writes)
      hf/                 copied from checkpoint.load/hf when the run started from one
    step_00000020/
    latest              text file: the name of the newest complete step directory

A save writes into ``.tmp_step_N`` first, renames it to ``step_N`` only after every rank finished
writing, and then atomically replaces ``latest`` (write ``latest.tmp``, ``os.replace``). A save
interrupted at any point therefore leaves ``latest`` pointing at the previous, intact checkpoint;
leftover temporary directories are removed by the next save. Only the last ``keep_last`` step
directories of this run are kept (never the one ``latest`` names, never a higher step: see
``_prune``). ``dir`` must be on a file system all ranks share.

Model tensors are the unwrapped GPTModel's ``sharded_state_dict`` (the keys the conversion tool
writes too, so ``load_model_weights`` starts training from a converted checkpoint); optimizer
state is the Megatron optimizer's ``sharded_state_dict``; each rank's RNG states are a
``ShardedObject``; step, data position and the LR schedule are common (rank-0) state.
``model_config.yaml`` (and ``hf/``) make a step directory usable like a converted checkpoint:
``mcore-to-hf --ckpt dir/step_N`` and ``checkpoint.load: dir/step_N`` without a model section.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer import DistributedOptimizer
from megatron.core.tensor_parallel import random as mcore_random

from megatron_grpo.config import ConfigError, from_dict
from megatron_grpo.convert.layout import HF_ASSETS_DIR, copy_hf_assets, write_model_config
from megatron_grpo.megatron.config import LAYOUT_FIELDS, ModelConfig
from megatron_grpo.megatron.model.build import unwrap
from megatron_grpo.megatron.parallel import cuda_compat
from megatron_grpo.train.writer_queue import install_writer_queue

LATEST = "latest"
_STEP_RE = re.compile(r"step_(\d+)")
# DistributedOptimizer state: each DP rank writes its own shard (reshardable along DP only).
_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The directory ``root/latest`` points to, or None when there is no complete checkpoint."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not path.is_dir():
        raise FileNotFoundError(f"{pointer} points to {path}, which does not exist")
    return path


def _rng_state() -> dict[str, Any]:
    tracker = mcore_random.get_cuda_rng_tracker()
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tracker.get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    mcore_random.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_object(data: Any) -> ShardedObject:
    world = dist.get_world_size() if dist.is_initialized() else 1
    return ShardedObject("rng_state", data, (world,), (_rank(),), replica_id=0)


def _rank_object(data: Any) -> ShardedObject:
    """This rank's own trainer data (partial rollouts' requests in flight), like its RNG."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return ShardedObject("rank_state", data, (world,), (_rank(),), replica_id=0)


def _model_state(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    if len(chunks) == 1:
        return {"model": unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _materialize_optimizer_state(optimizer) -> None:
    """A fresh DistributedOptimizer over torch's Adam has no per-parameter ``step`` yet, and
    megatron-core's ``state_dict`` (no Apex/TE) asserts on it while building the state to load
    into; Megatron's own dummy initialization (a zero-gradient step) creates the states. What
    that step changes (states, and the weights through weight decay) the load overwrites; the
    ``step`` it leaves behind is replaced by :func:`_restore_adam_steps`."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            with cuda_compat():
                opt._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer) -> None:
    """Give every parameter of a DistributedOptimizer over torch's Adam its own ``step`` tensor,
    holding the checkpoint's step (which megatron-core restores into the param groups).

    megatron-core 0.16's load of this fallback (no Apex/TE) leaves the per-parameter ``step``
    wrong in two ways: ``load_state_dict`` puts ONE tensor into every parameter's state, which
    torch's Adam then increments once per parameter per step (``step_t += 1``), so the bias
    correction of the first update after resume uses steps ``s+1 .. s+n_params``; and the
    ``dp_reshardable`` param state carries ``step`` as a ``LocalNonpersistentObject``, whose load
    copies the pre-load placeholder (1 after the dummy initialization) over the restored value.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state.get(param)
                if not state or "step" not in state:
                    continue  # fused Adam (Apex/TE) keeps the step in the group only
                if "step" not in group:
                    raise RuntimeError("DistributedOptimizer load left no 'step' in a param group")
                old = state["step"]
                state["step"] = torch.tensor(
                    float(group["step"]), dtype=old.dtype, device=old.device
                )


def _sharded_state(chunks, optimizer, is_loading: bool) -> dict[str, Any]:
    state = _model_state(chunks)
    if optimizer is not None:
        if is_loading:
            _materialize_optimizer_state(optimizer)
        model_sd = {k: v for k, v in state.items()}
        with cuda_compat():
            state["optimizer"] = optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=_OPTIM_METADATA
            )
    return state


def write_checkpoint(
    root: str | Path,
    step: int,
    chunks,
    optimizer,
    scheduler,
    trainer_state: dict[str, Any],
    rank_state: Any = None,
) -> Path:
    """Write step ``step`` into ``root/.tmp_step_N`` (all ranks); not yet visible to resume.

    ``trainer_state["config"]`` is the run's resolved config (``to_dict(TrainConfig)``); its
    ``model`` section becomes ``model_config.yaml``. ``rank_state``: this rank's own data
    (restored only at the same world size), or None.
    """
    config = trainer_state.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ValueError(
            "trainer_state['config'] must be the resolved config (to_dict(TrainConfig)) with a "
            "model section; it is written as model_config.yaml"
        )
    tmp = Path(root) / f".tmp_{step_dir_name(step)}"
    install_writer_queue()
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    state = _sharded_state(chunks, optimizer, is_loading=False)
    state["rng"] = _rng_object(_rng_state())
    state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    state["trainer_state"] = dict(trainer_state, step=step, rank_state=rank_state is not None)
    if rank_state is not None:
        state["rank_state"] = _rank_object(rank_state)
    with cuda_compat():
        dist_checkpointing.save(state, str(tmp))
    if _rank() == 0:
        _write_model_files(tmp, config)
    _barrier()
    return tmp


def _write_model_files(ckpt_dir: Path, config: dict[str, Any]) -> None:
    """``model_config.yaml`` with the converter's writer and, when ``checkpoint.load`` has them,
    its ``hf/`` assets (config.json, tokenizer), so ``mcore-to-hf`` needs no extra flags."""
    write_model_config(ckpt_dir, from_dict(ModelConfig, config["model"], "model"))
    load = (config.get("checkpoint") or {}).get("load")
    if load is not None and (Path(load) / HF_ASSETS_DIR).is_dir():
        copy_hf_assets(Path(load) / HF_ASSETS_DIR, ckpt_dir / HF_ASSETS_DIR)


def commit_checkpoint(root: str | Path, tmp: Path, step: int, keep_last: int) -> Path:
    """Publish a written checkpoint: rename into place, switch ``latest``, prune old ones."""
    root = Path(root)
    final = root / step_dir_name(step)
    if _rank() == 0:
        current = latest_checkpoint(root)
        if final.exists():
            if current is not None and current.resolve() == final.resolve():
                raise RuntimeError(f"refusing to overwrite {final}, which 'latest' points to")
            shutil.rmtree(final)
        tmp.rename(final)
        pointer_tmp = root / (LATEST + ".tmp")
        pointer_tmp.write_text(final.name + "\n")
        os.replace(pointer_tmp, root / LATEST)
        _prune(root, final, keep_last)
    _barrier()
    return final


def _step_of(name: str) -> int | None:
    match = _STEP_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def _prune(root: Path, final: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints of this run, ``final`` (what ``latest`` now
    names) always among them. Only steps up to ``final``'s count as this run's: a higher one
    is not its lineage (a resumed run re-saves later steps under the same names anyway), so it
    is never deleted, nor is its temporary directory."""
    current = _step_of(final.name)
    ours = sorted(
        (step, p)
        for p in root.iterdir()
        if p.is_dir() and (step := _step_of(p.name)) is not None and step <= current
    )
    for _, old in ours[:-keep_last]:
        if old != final:
            shutil.rmtree(old)
    for leftover in root.glob(".tmp_step_*"):
        step = _step_of(leftover.name.removeprefix(".tmp_"))
        if step is not None and step <= current:
            shutil.rmtree(leftover)


def save_checkpoint(
    root: str | Path,
    step: int,
    chunks,
    optimizer,
    scheduler,
    trainer_state: dict[str, Any],
    keep_last: int,
    rank_state: Any = None,
) -> Path:
    """Write then publish a checkpoint (see the module docstring); returns ``root/step_N``."""
    tmp = write_checkpoint(root, step, chunks, optimizer, scheduler, trainer_state, rank_state)
    return commit_checkpoint(root, tmp, step, keep_last)


class CheckpointError(RuntimeError):
    """A checkpoint directory is damaged or unreadable (the message names the failing file)."""


def check_checkpoint_files(path: str | Path, fix: str | None = None) -> None:
    """Cheap integrity check of a torch_dist directory before loading: ``metadata.json``,
    ``common.pt`` and ``.metadata`` read, and every shard file is as long as ``.metadata`` says
    (a truncated shard otherwise surfaces as a bare ``EOFError`` deep inside torch). ``fix``:
    what the error says to do (default: resume from an earlier step)."""
    path = Path(path)
    fix = fix or f"Point {path.parent / LATEST} at an earlier step_* directory to resume from it"
    current = path / "metadata.json"
    try:
        json.loads(current.read_text())
        current = path / "common.pt"
        if not current.is_file():
            raise FileNotFoundError("missing")
        current = path / ".metadata"
        with open(current, "rb") as f:
            storage = pickle.load(f).storage_data
        for info in storage.values():
            current = path / info.relative_path
            size = current.stat().st_size
            if size < info.offset + info.length:
                raise EOFError(
                    f"truncated: {size} bytes, the metadata needs at least "
                    f"{info.offset + info.length}"
                )
    except Exception as e:  # noqa: BLE001 - any failure here means a damaged directory
        raise CheckpointError(
            f"checkpoint {path} is damaged: {current.name}: {type(e).__name__}: {e}. {fix}"
        ) from e


# LAYOUT_FIELDS: the parallel sizes that shape a checkpoint's model and optimizer shards. DP
# may change on resume (the trainer's optimizer states reload at any DP size); these may not.


def check_resume_layout(path: str | Path, parallel: Any) -> None:
    """Refuse (ConfigError naming both layouts) to resume checkpoint ``path`` with a model
    parallel layout other than the one that saved it: the optimizer state of the distributed
    optimizer does not reshard across TP / PP, and exact resume holds only in the same layout.
    A checkpoint without a saved config (none of this trainer's) is not checked."""
    common = dist_checkpointing.load_common_state_dict(str(path))
    saved = ((common.get("trainer_state") or {}).get("config") or {}).get("parallel")
    if not isinstance(saved, dict):
        return
    differ = [k for k in LAYOUT_FIELDS if saved.get(k) != getattr(parallel, k)]
    if differ:
        then = ", ".join(f"{k}={saved.get(k)}" for k in differ)
        now = ", ".join(f"{k}={getattr(parallel, k)}" for k in differ)
        sets = " ".join(f"--set parallel.{k}={_yaml(saved.get(k))}" for k in differ)
        raise ConfigError(
            f"--resume: {path} was saved with parallel {then}; this run has {now}. "
            f"Resume with the saved layout ({sets})"
        )


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value)


def load_checkpoint(path: str | Path, chunks, optimizer, scheduler) -> dict[str, Any]:
    """Restore model, optimizer, LR schedule and (same world size) RNG states from ``path``.

    Returns the saved trainer state (``step``, ``data_position``, ...; ``rank_state``: this
    rank's saved data at the same world size, else None). A damaged directory
    raises :class:`CheckpointError` naming the file.
    """
    check_checkpoint_files(path)
    try:
        return _load_checkpoint(path, chunks, optimizer, scheduler)
    except (EOFError, pickle.UnpicklingError, RuntimeError, OSError) as e:
        raise CheckpointError(f"loading checkpoint {path} failed: {_one_line(e)}") from e


def _one_line(e: BaseException) -> str:
    """``Type: message`` in one line: torch's CheckpointException holds every rank's whole
    traceback; its last line is the error itself."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return (
        f"{type(e).__name__}: {lines[-1] if lines else ''}"
        if len(lines) > 1
        else f"{type(e).__name__}: {e}"
    )


def _load_checkpoint(path: str | Path, chunks, optimizer, scheduler) -> dict[str, Any]:
    common = dist_checkpointing.load_common_state_dict(str(path))
    if "trainer_state" not in common:
        raise CheckpointError(
            f"{path} is not a trainer checkpoint (no trainer_state); use "
            "checkpoint.load for model-only checkpoints"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    same_world = common["trainer_state"].get("world_size") == world
    state = _sharded_state(chunks, optimizer, is_loading=True)
    has_rank_state = same_world and bool(common["trainer_state"].get("rank_state"))
    if same_world:
        state["rng"] = _rng_object(None)
    if has_rank_state:
        state["rank_state"] = _rank_object(None)
    with cuda_compat():
        loaded = dist_checkpointing.load(state, str(path))
    _load_model(chunks, loaded)
    if optimizer is not None:
        # megatron-core copies into parameter views outside no_grad on this path.
        with torch.no_grad(), cuda_compat():
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer)
    if scheduler is not None and loaded.get("scheduler") is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    if same_world:
        _set_rng_state(loaded["rng"])
    rank_state = loaded["rank_state"] if has_rank_state else None
    return dict(loaded["trainer_state"], rng_restored=same_world, rank_state=rank_state)


def _load_model(chunks, loaded: dict[str, Any]) -> None:
    if len(chunks) == 1:
        unwrap(chunks[0]).load_state_dict(loaded["model"])
        return
    for i, c in enumerate(chunks):
        unwrap(c).load_state_dict(loaded[f"model{i}"])


def load_model_weights(path: str | Path, chunks) -> None:
    """Load only the model tensors from a dist_checkpointing directory (a trainer checkpoint or
    one written by ``tools/convert_checkpoint.py``)."""
    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise CheckpointError(
            f"checkpoint.load {str(path)!r} is not a dist_checkpointing directory (no "
            "metadata.json): convert a Hugging Face model with tools/convert_checkpoint.py"
        )
    check_checkpoint_files(path, fix="checkpoint.load needs an intact checkpoint")
    try:
        with cuda_compat():
            loaded = dist_checkpointing.load(_model_state(chunks), str(path))
    except (EOFError, pickle.UnpicklingError, RuntimeError, OSError) as e:
        raise CheckpointError(f"loading checkpoint.load {path} failed: {_one_line(e)}") from e
    _load_model(chunks, loaded)
