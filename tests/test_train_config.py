"""TrainConfig: the tiny recipe loads, --set overrides apply, and bad keys/values are errors
that name the field (and the closest valid key)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_grpo.config import ConfigError, to_dict
from megatron_grpo.train.__main__ import main, parse_args
from megatron_grpo.train.config import TrainConfig, load_train_config

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"


def test_tiny_recipe_loads_and_round_trips_through_yaml(tmp_path):
    cfg = load_train_config(RECIPE)
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.rollout.task == "reverse_digits"
    # The resolved config (as saved with each run) loads back to the same tree.
    path = tmp_path / "resolved.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    assert load_train_config(path) == cfg


def test_overrides_reach_every_section():
    cfg = load_train_config(
        RECIPE,
        [
            "training.steps=7",
            "optimizer.lr=0.0003",
            "loss.clip_eps_high=0.28",
            "rollout.reverse_digits.num_digits=2",
            "parallel.tensor_model_parallel_size=1",
            "checkpoint.dir=null",
            "logging.tensorboard_dir=tb",
        ],
    )
    assert cfg.training.steps == 7
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.loss.clip_eps_high == pytest.approx(0.28)
    assert cfg.rollout.reverse_digits.num_digits == 2
    assert cfg.parallel.tensor_model_parallel_size == 1
    assert cfg.checkpoint.dir is None
    assert cfg.logging.tensorboard_dir == "tb"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.stepz=3", "did you mean 'steps'"),
        ("rollout.group_sise=4", "did you mean 'group_size'"),
        ("optimiser.lr=1", "did you mean 'optimizer'"),
        ("training.steps=abc", "training.steps: expected an integer"),
        ("rollout.task=chess", "rollout.task: 'chess' is not one of"),
        ("optimizer.optimizer=lion", "optimizer.optimizer: 'lion' is not one of"),
        ("rollout.engine.kind=vllm", "rollout.engine.kind: 'vllm' is not one of"),
        ("rollout.engine.cuda_graphs=maybe", "rollout.engine.cuda_graphs"),
        ("rollout.sampling.stop_ids=5", "rollout.sampling.stop_ids: expected a list"),
        ("rollout.sampling.temprature=1", "did you mean 'temperature'"),
        ("rollout.sampling.eos_id=1", "unknown config key 'rollout.sampling.eos_id'"),
        ("rollout.engine.kv_cache=1", "did you mean 'kv_cache_gib'"),
        ("rollout.filter_groups.max_rounds=2", "did you mean 'max_extra_rounds'"),
        ("rollout.filter_groups.enabled=maybe", "rollout.filter_groups.enabled: expected true"),
        ("rollout.filter_groups=true", "rollout.filter_groups: expected a mapping"),
    ],
)
def test_unknown_keys_and_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(RECIPE, [override])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.group_size=1"], "group_size must be >= 2"),
        (["rollout.sampling.temperature=0"], "rollout.sampling.temperature must be > 0"),
        (["rollout.sampling.top_p=0"], "rollout.sampling.top_p must be in"),
        (["rollout.sampling.top_k=-1"], "rollout.sampling.top_k must be >= 0"),
        (["rollout.sampling.stop_ids=[3, -1]"], "sampling.stop_ids must be token ids >= 0, got -1"),
        (["rollout.engine.kv_cache_gib=0"], "rollout.engine.kv_cache_gib must be > 0"),
        (["rollout.engine.context_bucket=0"], "rollout.engine.context_bucket must be positive"),
        (["rollout.engine.max_prefill_tokens=-1"], "engine.max_prefill_tokens must be positive"),
        (["rollout.reward_fn=no_colon"], "reward_fn must look like"),
        (["rollout.task=math"], "math.data_path is required"),
        (
            ["rollout.filter_groups.reward_tolerance=-0.1"],
            "rollout.filter_groups.reward_tolerance must be a finite number >= 0, got -0.1",
        ),
        (["rollout.filter_groups.reward_tolerance=.nan"], "reward_tolerance must be a finite"),
        (
            ["rollout.filter_groups.max_extra_rounds=-1"],
            "max_extra_rounds must be in \\[0, 1024\\]",
        ),
        (["rollout.filter_groups.max_extra_rounds=1025"], "max_extra_rounds must be in"),
        (
            ["rollout.filter_groups.enabled=true", "rollout.input_path=x.jsonl"],
            "rollout.filter_groups.enabled needs generated rollouts",
        ),
        (["training.micro_batch_size=null"], "exactly one of micro_batch_size"),
        (["training.max_tokens_per_micro_batch=64"], "exactly one of micro_batch_size"),
        (["optimizer.min_lr=1.0"], "min_lr must be in"),
        (["loss.kl_coef=0.1", "training.use_reference_model=false"], "use_reference_model"),
        (["training.mini_batches_per_step=3"], "mini_batches_per_step=3 must divide"),
        (["rollout.max_response_length=100"], "exceeds model.max_sequence_length"),
        (["checkpoint.keep_last=0"], "keep_last must be positive"),
        (["training.logprob_max_tokens_per_micro_batch=0"], "must be positive"),
        (
            [
                "model.num_moe_experts=4",
                "parallel.expert_model_parallel_size=2",
                "model.moe_token_dispatcher_type=allgather",
                "training.logprob_max_tokens_per_micro_batch=4096",
            ],
            "logprob_max_tokens_per_micro_batch needs model.moe_token_dispatcher_type alltoall",
        ),
        (
            [
                "model.num_moe_experts=4",
                "parallel.expert_model_parallel_size=2",
                "model.moe_token_dispatcher_type=alltoall",
                "model.layer_kernels.moe_dispatch=gathered",
                "training.logprob_max_tokens_per_micro_batch=4096",
            ],
            "the allgather and gathered dispatches need the same token count",
        ),
    ],
)
def test_cross_field_checks_raise_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(RECIPE, overrides)


def test_defaults_are_a_valid_tree():
    assert isinstance(load_train_config(None), TrainConfig)


def test_cli_parses_repeated_set_and_resume():
    args = parse_args(["--config", "x.yaml", "--set", "a.b=1", "--set", "c=2", "--resume"])
    assert args.overrides == ["a.b=1", "c=2"] and args.resume and args.config == "x.yaml"


def test_cli_reports_config_errors_without_starting(capsys):
    assert main(["--config", str(RECIPE), "--set", "training.stepz=1"]) == 2
    assert "did you mean 'steps'" in capsys.readouterr().err


def test_checkpoint_architecture_check_names_the_field(tmp_path):
    """--resume (and checkpoint.load) refuse a checkpoint of another architecture."""
    from megatron_grpo.config import ConfigError
    from megatron_grpo.convert.layout import check_checkpoint_architecture, write_model_config
    from megatron_grpo.megatron.config import ModelConfig

    stored = ModelConfig(vocab_size=13, num_layers=2, hidden_size=64, num_attention_heads=4)
    write_model_config(tmp_path, stored)
    check_checkpoint_architecture(stored, str(tmp_path))  # same architecture: fine
    check_checkpoint_architecture(stored, str(tmp_path / "elsewhere"))  # no file: nothing to check
    other = ModelConfig(vocab_size=13, num_layers=2, hidden_size=64, num_attention_heads=4,
                        rotary_base=500000)  # fmt: skip
    with pytest.raises(ConfigError, match="rotary_base"):
        check_checkpoint_architecture(other, str(tmp_path))


_EP2 = ["model.num_moe_experts=4", "parallel.expert_model_parallel_size=2"]
_GATHERED = "model.layer_kernels.moe_dispatch=gathered"
_TP2_SP = [
    "parallel.tensor_model_parallel_size=2",
    "parallel.sequence_parallel=true",
    "parallel.expert_tensor_parallel_size=1",
]
_EP4 = ["model.num_moe_experts=4", "parallel.expert_model_parallel_size=4"]


@pytest.mark.parametrize(
    "overrides, merge",
    [
        ([], 32768),  # "auto" on a dense model
        (["model.num_moe_experts=4"], 32768),  # MoE at EP 1: merged as dense models
        # MoE at EP 2 under all-to-all: merged too (the ranks agree on the forward count)
        (_EP2 + ["model.moe_token_dispatcher_type=alltoall"], 32768),
        (
            _EP2
            + [
                "model.moe_token_dispatcher_type=alltoall",
                "training.logprob_max_tokens_per_micro_batch=4096",
            ],
            4096,
        ),  # fmt: skip
        # ... under allgather every forward needs equal tokens: the update's micro-batches
        (_EP2 + ["model.moe_token_dispatcher_type=allgather"], None),
        # ... and under the gathered dispatch in every forward (its all-gather takes equal shares)
        (_EP2 + ["model.moe_token_dispatcher_type=alltoall", _GATHERED], None),
        (["model.num_moe_experts=4", _GATHERED], 32768),  # EP 1: no dispatch to match
        # the expert group inside the TP group (expert-TP 1): its ranks share micro-batches
        (_EP2 + _TP2_SP + [_GATHERED], 32768),
        (_EP2 + _TP2_SP + ["model.moe_token_dispatcher_type=allgather"], 32768),
        (_EP2 + _TP2_SP[:2], None),  # expert-TP = TP (megatron-core's default): not inside
        (_EP4 + _TP2_SP + [_GATHERED], None),  # EP 4 spans 2 TP groups
        (["training.logprob_max_tokens_per_micro_batch=4096"], 4096),
        (["training.logprob_max_tokens_per_micro_batch=null"], None),
    ],
)
def test_logprob_merge_auto_is_resolved_per_model(overrides, merge):
    cfg = load_train_config(RECIPE, overrides)
    assert cfg.logprob_merge_tokens == merge


RECIPE_WITH_ERRORS = """\
rollout:
  task: reverse_digits
  num_prompt: 8
  sampling:
    temperature: -1
"""


@pytest.mark.parametrize(
    ("fix", "overrides", "message"),
    [
        # every mistake at once, in file order, each with its line
        (
            "",
            [],
            "2 mistakes in {path}:\n  {path}:3: unknown config key 'rollout.num_prompt'; did you "
            "mean 'num_prompts'?\n  {path}:5: rollout.sampling.temperature must be > 0, got -1.0",
        ),
        ("num_prompts", [], "{path}:5: rollout.sampling.temperature must be > 0, got -1.0"),
        # a value from --set: no line of the file is at fault
        ("num_prompts", ["rollout.sampling.temperature=-2"], "rollout.sampling.temperature must"),
        (
            "num_prompts",
            ["training.seeds=1"],
            "2 mistakes in {path} (with its --set overrides):\n  unknown config key "
            "'training.seeds'; did you mean 'seed'?\n  {path}:5: rollout.sampling.temperature",
        ),
    ],
)
def test_errors_in_a_recipe_name_its_file_and_line(tmp_path, fix, overrides, message):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE_WITH_ERRORS.replace("num_prompt:", f"{fix or 'num_prompt'}:"))
    with pytest.raises(ConfigError) as e:
        load_train_config(path, overrides)
    assert str(e.value).startswith(message.format(path=path)), str(e.value)
