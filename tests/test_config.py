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
        ("", {"loss_norm": "batch"}, "must be one of token, sequence, constant"),
        ("", {"correction": "mis"}, "grpo.correction: mis needs an objective whose ratio is to the learner's"),
        ("", {"objective": "ppo"}, "must be one of behaviour, decoupled, gspo, cispo"),
        ("", {"objective": "gspo", "mismatch_high": "0.9"}, "grpo.mismatch_low: need 0 < mismatch_low < 1"),
        ("", {"engine": "vllm"}, "must be one of llamacpp, transformers"),
        ("", {"group_size": "64"}, "sampler.max_batch: must be >= grpo.group_size"),
        ("", {"temperature": "0"}, "sampler.temperature: must be > 0"),
        ("", {"wire_topk": "0"}, "swarm.wire_topk: must be in (0, 1]"),
        ("[swarm]\nwire_topk = 1.5\n", {}, "swarm.wire_topk: must be in (0, 1]"),
        ("", {"chunk_kib": "2"}, "swarm.chunk_kib: must be 0 (by size) or 4 to 4096"),
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


def test_workers_on_one_machine_get_their_own_identity_and_store_and_share_none(tmp_path):
    """--gpu N (or --name) gives a worker its own identity and work dir by default; two processes on one
    identity would be one peer to the swarm and fight over one store, so the second is refused in one line."""
    from p2p.identity import IdentityError, hold_identity
    from worker.config import WorkerRootConfig

    learner = "/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWExample"
    worker = lambda **flags: load_config(WorkerRootConfig, None, {"learner": learner, **flags}).worker  # noqa: E731
    plain, gpu1, named = worker(), worker(gpu="1"), worker(name="laptop", work_dir=str(tmp_path))
    assert plain.listen == "/ip4/0.0.0.0/tcp/0"  # reachable on a real network without a flag
    assert gpu1.name == "gpu1" and gpu1.identity.endswith("worker-gpu1.key") and gpu1.work_dir.endswith("worker-gpu1")
    assert named.identity.endswith("worker-laptop.key") and named.work_dir == str(tmp_path)  # given: kept
    assert len({plain.identity, gpu1.identity, named.identity}) == 3
    assert plain.upload_bps() is None and worker(uplink_mbit="20").upload_bps() == 20e6 * 0.9 / 8  # paced at 90%
    for bad, message in [({"name": "a/b"}, "worker.name"), ({"gpu": "-2"}, "worker.gpu"),
                         ({"announce": "1.2.3.4:4001"}, "worker.announce"),
                         ({"uplink_mbit": "-1"}, "worker.uplink_mbit"),
                         ({"uplink_mbit": "nan"}, "worker.uplink_mbit")]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            worker(**bad)

    held = hold_identity(tmp_path / "worker.key")
    with pytest.raises(IdentityError, match=r"in use by another worker on this machine \(pid \d+\).*--name"):
        hold_identity(tmp_path / "worker.key")
    held.close()  # the first worker left: the identity is free again
    hold_identity(tmp_path / "worker.key").close()
