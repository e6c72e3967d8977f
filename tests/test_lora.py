"""LoRA: peft adapters on the learner, GGUF adapters hot-swapped into llama.cpp, merged in transformers."""

import numpy as np
import pytest
import torch

from learner.config import GRPOConfig
from learner.orchestrate.publisher import Publisher
from learner.train.lora import add_lora
from learner.train.models import model_spec, tiny_policy
from learner.train.trainer import GRPOTrainer
from learner.train.wire_weights import wire_state, wire_tensors
from tests.test_trainer import make_rollouts
from worker.engines.hf import TransformersEngine
from worker.engines.llamacpp import LlamaCppEngine


def lora_policy(rank=4, alpha=8.0):
    policy = tiny_policy(0)
    add_lora(policy.model, rank, alpha)
    policy.lora_rank, policy.lora_alpha = rank, alpha
    return policy


def train(policy, steps):
    trainer = GRPOTrainer(policy.model, GRPOConfig(lr=2e-2), temperature=1.0)
    for _ in range(steps):
        trainer.step(make_rollouts(policy))


def torch_logits(policy, ids):
    with torch.no_grad():
        return policy.model(torch.tensor([ids])).logits[0].numpy()  # [T, V]


def test_only_adapters_train_and_a_fresh_adapter_changes_nothing():
    policy = lora_policy()
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    ids = policy.render_prompt("What is 2 + 2?")
    plain = tiny_policy(0)
    assert np.array_equal(torch_logits(policy, ids), torch_logits(plain, ids))  # B = 0 at the start
    base_before = {n: t.clone() for n, t in wire_state(policy.model).items() if ".lora_" not in n}
    train(policy, 3)
    state = wire_state(policy.model)
    assert all(torch.equal(state[n], t) for n, t in base_before.items())  # the base stays frozen
    assert any(state[n].abs().sum() > 0 for n in state if n.endswith(".lora_B.weight"))


def test_llamacpp_and_transformers_follow_the_trained_adapters(tmp_path):
    """After training, and again after a hot swap, both engines' logits agree with torch + peft."""
    policy = lora_policy()
    spec = model_spec(policy)
    ids = policy.render_prompt("What is 12 + 7? Think step by step, then answer.")
    train(policy, 4)
    llama = LlamaCppEngine(tmp_path, threads=2, max_batch=8)
    hf = TransformersEngine(threads=2)
    try:
        llama.load_policy(spec, wire_tensors(policy.model))  # a LoRA run's full snapshot: base + adapters
        hf.load_policy(spec, wire_tensors(policy.model))
        before = torch_logits(policy, ids)
        assert np.abs(llama.logits(ids) - before).max() < 1e-2  # F16 weights and adapters against float32
        model_handle = llama.model

        train(policy, 4)
        after = torch_logits(policy, ids)
        assert np.abs(after - before).max() > 0.05  # the adapters really moved the policy
        adapters = wire_tensors(policy.model, adapter_only=True)
        assert adapters and all(".lora_" in n for n in adapters)
        llama.load_adapters(spec, adapters)  # the hot swap
        hf.load_adapters(spec, adapters)
        assert llama.model is model_handle  # no model reload
        ours = llama.logits(ids)
        assert np.abs(ours - after).max() < 1e-2
        assert np.array_equal(ours.argmax(axis=1), after.argmax(axis=1))
        with torch.no_grad():
            ref_hf = hf.model(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(ref_hf - after).max() < 1e-4  # float32 merge: W + (alpha / r) B A
    finally:
        llama.close()


def test_an_adapter_version_is_a_small_fraction_of_the_weights():
    policy = lora_policy(rank=4)
    publisher = Publisher(seeder=None, run_id="r", full_every=10, dtype="f16", lora=True)
    full = publisher.snapshot(policy.model)
    assert any(".lora_A." in n for n in full) and "model.embed_tokens.weight" in full
    publisher.base = 0  # as after the first publication
    adapters = publisher.snapshot(policy.model)
    assert set(adapters) == {n for n in full if ".lora_" in n}
    assert sum(a.nbytes for a in adapters.values()) < 0.2 * sum(a.nbytes for a in full.values())


@pytest.mark.parametrize("rank", [0, 4])
def test_wire_names_are_hf_names(rank):
    policy = lora_policy(rank) if rank else tiny_policy(0)
    names = set(wire_state(policy.model))
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("base_layer" in n or ".default." in n for n in names)
    assert ("model.layers.0.mlp.down_proj.lora_B.weight" in names) == bool(rank)
