"""The typed config machinery: strict keys with suggestions, type checks, dotted overrides."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from megatron_grpo.config import (
    RUNTIME_ONLY,
    ConfigError,
    apply_overrides,
    from_dict,
    load_config,
    rename_keys,
    to_dict,
)


@dataclass
class Inner:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    mode: Literal["a", "b"] = "a"
    cap: float | None = None

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass
class Root:
    steps: int = 10
    name: str = "x"
    inner: Inner = field(default_factory=Inner)


def test_defaults_and_nested_values():
    cfg = from_dict(Root, {"steps": 3, "inner": {"lr": 1, "betas": [0.5, 0.6], "mode": "b"}})
    assert cfg.steps == 3 and cfg.inner.lr == 1.0 and isinstance(cfg.inner.lr, float)
    assert cfg.inner.betas == (0.5, 0.6) and cfg.inner.mode == "b"
    assert to_dict(cfg)["inner"]["betas"] == [0.5, 0.6]


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'inner\.betaz'.*'betas'"):
        from_dict(Root, {"inner": {"betaz": [0.1, 0.2]}})
    with pytest.raises(ConfigError, match=r"'stepz'.*did you mean 'steps'"):
        from_dict(Root, {"stepz": 1})


@pytest.mark.parametrize(
    "data, msg",
    [
        ({"steps": "ten"}, r"steps: expected an integer"),
        ({"steps": True}, r"steps: expected an integer"),
        ({"inner": {"mode": "c"}}, r"inner\.mode: 'c' is not one of"),
        ({"inner": {"betas": [0.1]}}, r"inner\.betas: expected 2 items"),
        ({"inner": {"lr": -1.0}}, r"inner\.lr must be > 0"),
        ({"inner": 3}, r"inner: expected a mapping"),
    ],
)
def test_bad_values_name_the_field(data, msg):
    with pytest.raises(ConfigError, match=msg):
        from_dict(Root, data)


def test_overrides_parse_yaml_scalars_and_create_sections(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 2\n")
    cfg = load_config(Root, path, ["inner.lr=3e-4", "inner.cap=null", "name=run1", "steps=7"])
    assert cfg.steps == 7 and cfg.inner.lr == 3e-4 and cfg.inner.cap is None and cfg.name == "run1"
    with pytest.raises(ConfigError, match=r"'inner\.lrr'.*'lr'"):
        apply_overrides({}, ["inner.lrr=1"], root=Root)
    with pytest.raises(ConfigError, match="a.b=value"):
        apply_overrides({}, ["steps"], root=Root)


@dataclass(frozen=True)
class Runtime:
    """A runtime class used as a section: frozen, with a field the program fills in."""

    scale: float = 1.0
    size: int | None = field(default=None, metadata=RUNTIME_ONLY)


@dataclass
class WithRuntime:
    runtime: Runtime = field(default_factory=Runtime)


def test_frozen_runtime_class_as_a_section():
    cfg = from_dict(WithRuntime, {"runtime": {"scale": 2}})
    assert cfg.runtime == Runtime(scale=2.0) and to_dict(cfg) == {"runtime": {"scale": 2.0}}
    with pytest.raises(ConfigError, match=r"unknown config key 'runtime\.size'; valid keys: scale"):
        from_dict(WithRuntime, {"runtime": {"size": 3}})
    with pytest.raises(ConfigError, match=r"unknown config key 'runtime\.size'"):
        apply_overrides({}, ["runtime.size=3"], root=WithRuntime)


def test_rename_keys_moves_scalars_only():
    data = {"a": {"old": 1, "sec": 2}}
    renamed = {"a.old": "a.new.x", "a.sec": "a.sec.kind"}
    with pytest.warns(FutureWarning, match=r"a\.old is deprecated .*: use a\.new\.x"):
        assert rename_keys(data, ["a.sec={kind: 3}"], renamed) == ["a.sec={kind: 3}"]
    assert data == {"a": {"new": {"x": 1}, "sec": {"kind": 2}}}


def test_collect_errors_finds_every_mistake_and_raising_stays_the_default():
    """Issue 39: under collect_errors every bad key and value is recorded (a failed section
    becomes an unchecked stand-in, so its parent's checks still run); outside it the first
    error is raised as before."""
    from megatron_grpo.config.base import collect_errors

    @dataclass
    class Inner:
        n: int = 1
        choice: int | list[int] = 1

        def __post_init__(self) -> None:
            if self.n < 0:
                raise ValueError(f"n must be >= 0, got {self.n}")

    @dataclass
    class Outer:
        inner: Inner = field(default_factory=Inner)
        flag: bool = False

    data = {"inner": {"n": -1, "nn": 2, "choice": "x"}, "flg": True, "flag": "yes"}
    with collect_errors() as errors:
        cfg = from_dict(Outer, data)
    messages = [str(e) for e in errors]
    assert len(messages) == 5, messages
    assert "unknown config key 'inner.nn'; did you mean 'n'?" in messages
    assert "unknown config key 'flg'; did you mean 'flag'?" in messages
    assert any(m.startswith("inner.choice: 'x' fits none of") for m in messages), messages
    assert "inner.n must be >= 0, got -1" in messages and cfg.inner.n == -1
    assert "flag: expected true/false, got 'yes'" in messages and cfg.flag is False
    with pytest.raises(ConfigError, match="unknown config key 'inner.nn'"):
        from_dict(Outer, data)


@dataclass
class Switches:
    overlap: Literal["auto", "off", "ring"] = "auto"
    light: Literal["on", "off"] = "on"
    name: str = "x"


def test_bare_on_off_in_yaml_are_the_choices(tmp_path):
    """YAML 1.1 reads a bare off / on as false / true: a choice field that has "off" / "on"
    takes the word; elsewhere the error says to quote it."""
    path = tmp_path / "c.yaml"
    path.write_text("overlap: off\nlight: off\n")
    cfg = load_config(Switches, path, ["light=on"])
    assert (cfg.overlap, cfg.light) == ("off", "on")
    with pytest.raises(ConfigError, match=r"overlap: True is not one of.*quote it, e\.g\. 'off'"):
        from_dict(Switches, {"overlap": True})  # "on" is not a choice of overlap
    with pytest.raises(ConfigError, match=r"name: expected a string, got False \(YAML reads"):
        from_dict(Switches, {"name": False})
