import pytest

from echo_cli.config import field_docs, load_config, parse_key_values
from learner.config import GRPOConfig, LearnerConfig
from p2p.config import ConfigError


def test_defaults_are_valid():
    cfg = load_config(LearnerConfig, None, {})
    assert cfg.model.model == "smollm2-135m" and cfg.grpo.group_size == 8


def test_toml_then_cli_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[grpo]\nlr = 1e-5\ngroup_size = 4\n[task]\ntask = "countdown"\ntask_args = {count = 4}\n')
    cfg = load_config(LearnerConfig, path, {"group_size": "6", "steps": None})
    assert cfg.grpo.lr == 1e-5 and cfg.grpo.group_size == 6 and cfg.run.steps == 100
    assert cfg.task.task == "countdown" and cfg.task.task_args == {"count": 4}


@pytest.mark.parametrize(
    "toml, overrides, message",
    [
        ("[grpo]\nlr = -1\n", {}, "grpo.lr: must be > 0"),
        ("[grpo]\nlrr = 1\n", {}, "unknown key grpo.lrr"),
        ("[trainer]\nx = 1\n", {}, "unknown table [trainer]"),
        ("[grpo]\ngroup_size = 'eight'\n", {}, "grpo.group_size: must be an integer"),
        ("", {"loss_norm": "batch"}, "must be one of token, sequence"),
        ("", {"engine": "vllm"}, "must be one of llamacpp, transformers"),
        ("", {"group_size": "64"}, "sampler.max_batch: must be >= grpo.group_size"),
        ("", {"temperature": "0"}, "sampler.temperature: must be > 0"),
        ("", {"wire_topk": "0"}, "swarm.wire_topk: must be in (0, 1]"),
        ("[swarm]\nwire_topk = 1.5\n", {}, "swarm.wire_topk: must be in (0, 1]"),
        ("", {"min_workers": "0"}, "swarm.min_workers: must be >= 1"),
        ("[grpo\n", {}, "is not valid TOML"),
    ],
)
def test_bad_values_name_the_key(tmp_path, toml, overrides, message):
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as err:
        load_config(LearnerConfig, path, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(LearnerConfig, "/nonexistent/run.toml", {})


def test_every_field_is_documented():
    import dataclasses

    for table in dataclasses.fields(LearnerConfig):
        cls = table.default_factory().__class__
        docs = field_docs(cls)
        assert set(docs) == {f.name for f in dataclasses.fields(cls)}, cls
    assert "learning rate" in field_docs(GRPOConfig)["lr"]


def test_key_values():
    assert parse_key_values(["a=1", "b=x", "c=0.5", "d=true"], "--task-args") == {"a": 1, "b": "x", "c": 0.5, "d": True}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_key_values(["oops"], "--task-args")
