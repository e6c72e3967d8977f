import copy

import pytest
import torch

from learner.config import GRPOConfig
from learner.orchestrate.rollouts import Rollout
from learner.train.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from learner.train.models import tiny_policy
from learner.train.trainer import GRPOTrainer, completion_logprobs, micro_batches


def make_rollouts(policy, n=6):
    prompt = policy.render_prompt("Say something short.")
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        completion = torch.randint(3, 200, (5 + i,), generator=gen).tolist()
        with torch.no_grad():
            lp = completion_logprobs(policy.model, [Rollout(prompt, completion, [], 0.0)], 1.0).tolist()
        out.append(Rollout(prompt, completion, lp, reward=float(i % 2), advantage=1.0 if i % 2 else -1.0))
    return out


def test_step_raises_likelihood_of_positive_advantage():
    policy = tiny_policy(0)
    rollouts = make_rollouts(policy)
    trainer = GRPOTrainer(policy.model, GRPOConfig(lr=1e-2), temperature=1.0)
    before = completion_logprobs(policy.model, rollouts, 1.0).detach()
    stats = trainer.step(rollouts)
    after = completion_logprobs(policy.model, rollouts, 1.0).detach()
    assert stats["trained_tokens"] == sum(len(r.completion_ids) for r in rollouts)
    assert stats["grad_norm"] > 0
    sign = torch.cat([torch.full((len(r.completion_ids),), r.advantage) for r in rollouts])
    assert float(((after - before) * sign).sum()) > 0


@pytest.mark.parametrize("beta, objective, minibatches", [(0.0, "behaviour", 1), (0.05, "decoupled", 2)])
def test_every_tensor_of_a_step_is_created_on_the_models_device(beta, objective, minibatches):
    """With the default device set to `meta`, a tensor the step creates without naming the model's device
    lands on meta and mixing it with the model's (CPU) tensors fails: the step must create every tensor
    where the model is, as it must on a GPU (where a stray CPU tensor fails the same way)."""
    policy = tiny_policy(0)
    rollouts = make_rollouts(policy)
    cfg = GRPOConfig(lr=1e-2, beta=beta, objective=objective, minibatches=minibatches)
    trainer = GRPOTrainer(policy.model, cfg, temperature=1.0, top_p=0.9)
    with torch.device("meta"):
        stats = trainer.step(rollouts)
    assert stats["trained_tokens"] > 0 and stats["skipped_updates"] == 0


def test_micro_batching_gives_the_same_gradient():
    base = tiny_policy(0)
    rollouts = make_rollouts(base)
    grads = []
    for budget in (10_000, 64):
        policy = copy.deepcopy(base)
        trainer = GRPOTrainer(policy.model, GRPOConfig(micro_batch_tokens=budget, max_grad_norm=1e9), 1.0)
        trainer.optimizer.step = lambda: None  # keep the gradient for inspection
        trainer.optimizer.zero_grad = lambda set_to_none=True: None
        trainer.step(rollouts)
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None]))
    assert len(micro_batches(rollouts, 10_000)) == 1 and len(micro_batches(rollouts, 64)) > 1
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_equal_groups_are_skipped():
    policy = tiny_policy(0)
    rollouts = [Rollout([1, 2, 3], [4, 5], [-1.0, -1.0], reward=1.0, advantage=0.0)] * 4
    stats = GRPOTrainer(policy.model, GRPOConfig(), 1.0).step(rollouts)
    assert stats["trained_tokens"] == 0


def test_checkpoint_round_trip(tmp_path):
    policy = tiny_policy(0)
    trainer = GRPOTrainer(policy.model, GRPOConfig(lr=1e-3), 1.0)
    trainer.step(make_rollouts(policy))
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, policy.model, trainer.optimizer, {"wall_s": 1.5}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000003"]
    (tmp_path / "checkpoints" / "step-000004.tmp").mkdir()  # a crash mid-write is ignored
    assert list_checkpoints(tmp_path)[-1].name == "step-000003"

    fresh = tiny_policy(1)
    fresh_trainer = GRPOTrainer(fresh.model, GRPOConfig(lr=1e-3), 1.0)
    state = load_checkpoint(list_checkpoints(tmp_path)[-1], fresh.model, fresh_trainer.optimizer)
    assert state["step"] == 3 and state["wall_s"] == 1.5
    for a, b in zip(policy.model.state_dict().values(), fresh.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    sa, sb = trainer.optimizer.state_dict()["state"], fresh_trainer.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)


def test_sequence_normalisation_weighs_every_completion_equally():
    """token: a long completion weighs by its tokens; sequence: every completion weighs the same. Checked on
    the loss of two completions of different lengths with advantages +1 / -1 and ratio 1 (loss = -sum w A)."""
    policy = tiny_policy(0)
    short, long = make_rollouts(policy, n=6)[0], make_rollouts(policy, n=6)[5]  # 5 and 10 tokens
    batch = [Rollout(short.prompt_ids, short.completion_ids, short.behaviour_logprobs, 1.0, 1.0),
             Rollout(long.prompt_ids, long.completion_ids, long.behaviour_logprobs, 0.0, -1.0)]  # fmt: skip
    losses = {}
    for norm in ("token", "sequence"):
        trainer = GRPOTrainer(copy.deepcopy(policy).model, GRPOConfig(loss_norm=norm, lr=1e-9), 1.0)
        losses[norm] = trainer.step(batch)["loss"]
    trainer = GRPOTrainer(copy.deepcopy(policy).model, GRPOConfig(loss_norm="constant", lr=1e-9), 1.0,
                          max_completion_tokens=20)  # fmt: skip
    losses["constant"] = trainer.step(batch)["loss"]
    assert losses["token"] == pytest.approx(-(5 * 1.0 + 10 * -1.0) / 15, abs=1e-4)  # 1/3: the long one dominates
    assert losses["sequence"] == pytest.approx(0.0, abs=1e-4)  # one completion each way: they cancel
    assert losses["constant"] == pytest.approx(-(5 * 1.0 + 10 * -1.0) / (2 * 20), abs=1e-4)  # Dr. GRPO: 1/(n L)
    with pytest.raises(ValueError, match="max_completion_tokens"):
        GRPOTrainer(policy.model, GRPOConfig(loss_norm="constant"), 1.0)


@pytest.mark.parametrize("norm", ["token", "sequence", "constant"])
def test_tokens_a_correction_drops_leave_the_normaliser(norm):
    """A rollout whose every token mis drops (its sampler's logprobs far below the learner's: rho > ratio_cap)
    changes neither the loss nor the gradient: the step is the step without it."""
    base = tiny_policy(0)
    rollouts = make_rollouts(base)
    dropped = [Rollout(r.prompt_ids, r.completion_ids, [lp - 5.0 for lp in r.behaviour_logprobs], 1.0, 1.0)
               for r in make_rollouts(base, 2)]  # fmt: skip
    results = []
    for batch in (rollouts, rollouts + dropped):
        policy = copy.deepcopy(base)
        cfg = GRPOConfig(objective="cispo", correction="mis", loss_norm=norm, max_grad_norm=1e9)
        trainer = GRPOTrainer(policy.model, cfg, 1.0, max_completion_tokens=16)
        trainer.optimizer.step = lambda: None  # keep the gradient for inspection
        trainer.optimizer.zero_grad = lambda set_to_none=True: None
        stats = trainer.step(batch)
        grad = torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])
        results.append((stats, grad))
    (kept, g_kept), (with_dropped, g_dropped) = results
    assert with_dropped["loss"] == pytest.approx(kept["loss"], rel=1e-5)
    assert torch.allclose(g_kept, g_dropped, atol=1e-7, rtol=1e-4)
    assert with_dropped["trained_tokens"] == kept["trained_tokens"]
    n_dropped = sum(len(r.completion_ids) for r in dropped)
    assert with_dropped["dropped_frac"] == pytest.approx(n_dropped / (kept["trained_tokens"] + n_dropped))


def test_a_batch_whose_every_token_is_dropped_takes_no_step():
    policy = tiny_policy(0)
    dropped = [Rollout(r.prompt_ids, r.completion_ids, [lp - 5.0 for lp in r.behaviour_logprobs], 1.0, 1.0)
               for r in make_rollouts(policy, 4)]  # fmt: skip
    before = [p.detach().clone() for p in policy.model.parameters()]
    trainer = GRPOTrainer(policy.model, GRPOConfig(objective="cispo", correction="icepop", weight_decay=0.1), 1.0)
    stats = trainer.step(dropped)
    assert stats["trained_tokens"] == 0 and stats["dropped_frac"] == 1.0 and stats["skipped_updates"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.model.parameters(), strict=True))


def test_with_sequence_norm_a_partly_dropped_sequence_keeps_only_its_kept_share():
    """A worker's logprobs that drop all but one token of a completion must not give that token the whole
    completion's weight: with loss_norm = sequence each token weighs 1 / (len_i * n) whatever was dropped."""
    policy = tiny_policy(0)
    r = make_rollouts(policy, 6)[5]  # 10 tokens
    lying = [lp - 5.0 for lp in r.behaviour_logprobs]
    lying[0] = r.behaviour_logprobs[0]  # only the first token is kept by mis (rho = 1 there, e^5 elsewhere)
    batch = [Rollout(r.prompt_ids, r.completion_ids, lying, 1.0, 1.0)]
    cfg = GRPOConfig(objective="cispo", correction="mis", loss_norm="sequence", lr=1e-9)
    stats = GRPOTrainer(policy.model, cfg, 1.0).step(batch)
    # cispo's surrogate at ratio 1: w A log pi = log pi(token 0); one kept token of ten, one sequence
    with torch.no_grad():
        logp0 = completion_logprobs(policy.model, batch, 1.0)[0].item()
    assert stats["loss"] == pytest.approx(-logp0 / 10, rel=1e-4)
    assert stats["trained_tokens"] == 1 and stats["dropped_frac"] == pytest.approx(0.9)


@pytest.mark.parametrize(
    "objective, correction",
    [("behaviour", "tis"), ("decoupled", "tis"), ("decoupled", "icepop"), ("gspo", "seq_mask"), ("gspo", "none"),
     ("cispo", "tis"), ("cispo", "mis")],
)  # fmt: skip
def test_every_objective_raises_the_likelihood_of_positive_advantage(objective, correction):
    policy = tiny_policy(0)
    rollouts = make_rollouts(policy)
    cfg = GRPOConfig(lr=1e-2, objective=objective, correction=correction, minibatches=2)
    trainer = GRPOTrainer(policy.model, cfg, temperature=1.0)
    before = completion_logprobs(policy.model, rollouts, 1.0).detach()
    stats = trainer.step(rollouts)
    after = completion_logprobs(policy.model, rollouts, 1.0).detach()
    assert stats["skipped_updates"] == 0 and stats["grad_norm"] > 0
    sign = torch.cat([torch.full((len(r.completion_ids),), r.advantage) for r in rollouts])
    assert float(((after - before) * sign).sum()) > 0


@pytest.mark.parametrize("objective, correction", [("behaviour", "tis"), ("cispo", "mis")])
def test_skipping_equal_groups_does_not_rescale_the_gradient(objective, correction):
    base = tiny_policy(0)
    rollouts = make_rollouts(base)
    # equal-reward groups whose logprobs a masking correction would drop: an A = 0 token is never dropped
    equal = [Rollout(r.prompt_ids, r.completion_ids, [lp - 5.0 for lp in r.behaviour_logprobs], 0.5, 0.0)
             for r in make_rollouts(base, 4)]  # fmt: skip
    grads = []
    for skip in (True, False):
        policy = copy.deepcopy(base)
        cfg = GRPOConfig(skip_equal_groups=skip, max_grad_norm=1e9, objective=objective, correction=correction)
        trainer = GRPOTrainer(policy.model, cfg, 1.0)
        trainer.optimizer.step = lambda: None  # keep the gradient for inspection
        trainer.optimizer.zero_grad = lambda set_to_none=True: None
        trainer.step(rollouts + equal)
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-7, rtol=1e-4)


def test_a_non_finite_update_never_reaches_the_weights():
    policy = tiny_policy(0)
    rollouts = make_rollouts(policy)
    before = [p.detach().clone() for p in policy.model.parameters()]
    trainer = GRPOTrainer(policy.model, GRPOConfig(lr=1e-2), 1.0)
    poisoned = [Rollout(r.prompt_ids, r.completion_ids, r.behaviour_logprobs, r.reward, float("nan")) for r in rollouts]
    stats = trainer.step(poisoned)
    assert stats["skipped_updates"] == 1 and stats["trained_tokens"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.model.parameters(), strict=True))
    # extreme (but finite) behaviour logprobs: the clamped ratio keeps the update finite
    extreme = [Rollout(r.prompt_ids, r.completion_ids, [-1000.0] * len(r.completion_ids), r.reward, r.advantage)
               for r in rollouts]  # fmt: skip
    stats = trainer.step(extreme)
    assert stats["skipped_updates"] == 0 and all(torch.isfinite(p).all() for p in policy.model.parameters())


def test_minibatches_take_several_updates_and_the_decoupled_clip_binds():
    policy = tiny_policy(0)
    rollouts = make_rollouts(policy, n=8)
    trainer = GRPOTrainer(policy.model, GRPOConfig(lr=5e-2, objective="decoupled", minibatches=4), 1.0)
    steps = []
    trainer.optimizer.step = (lambda real: lambda: (steps.append(1), real())[1])(trainer.optimizer.step)
    stats = trainer.step(rollouts + make_rollouts(policy, n=8))
    assert len(steps) == 4 and stats["skipped_updates"] == 0
    assert stats["clip_frac"] > 0  # later minibatches moved past the trust region of pi_prox


def test_trainer_and_verifier_score_top_p_alike():
    """With top_p < 1 the trainer scores under the sampler's nucleus: on-policy ratios are 1."""
    from learner.orchestrate.replay_torch import replay_sampling

    policy = tiny_policy(0)
    model = policy.model.float().eval()
    batch = make_rollouts(policy, n=3)
    with torch.no_grad():
        trainer_lp = completion_logprobs(model, batch, 0.9, top_p=0.7).double()  # [N]
        verifier_lp, _ = replay_sampling(model, batch, 0.9, 0.7)  # [2, N]
        full = completion_logprobs(model, batch, 0.9).double()
    inside = torch.isfinite(verifier_lp[0])
    assert inside.any() and torch.allclose(trainer_lp[inside], verifier_lp[0][inside], atol=1e-5)
    assert (trainer_lp[inside] > full[inside]).all()  # renormalised over the nucleus, unlike the full softmax


def test_resume_with_beta_keeps_the_initial_policy_as_kl_anchor(tmp_path):
    from learner.config import LearnerConfig
    from learner.run import open_run

    cfg = LearnerConfig()
    cfg.model.model, cfg.run.run_dir, cfg.grpo.beta, cfg.grpo.lr = "tiny", str(tmp_path), 0.1, 1e-2
    cfg.run.checkpoint_every = 1
    run = open_run(cfg, resume=False)
    initial = {k: v.clone() for k, v in run.policy.model.state_dict().items()}
    run.trainer.step(make_rollouts(run.policy))
    run.record(1, {"step": 1, "wall_s": 0.0})
    resumed = open_run(cfg, resume=True)
    assert resumed.start_step == 1
    ref = resumed.trainer.reference.state_dict()
    assert all(torch.equal(ref[k], v) for k, v in initial.items())  # not the checkpoint's weights
    assert not all(torch.equal(resumed.policy.model.state_dict()[k], v) for k, v in initial.items())


def test_kl_reference_is_kept_only_with_beta():
    policy = tiny_policy(0)
    assert GRPOTrainer(policy.model, GRPOConfig(), 1.0).reference is None
    trainer = GRPOTrainer(policy.model, GRPOConfig(beta=0.05, lr=1e-2), 1.0)
    trainer.step(make_rollouts(policy))
    assert trainer.step(make_rollouts(policy))["kl_ref"] > 0


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_published_snapshot_rounds_like_numpy(dtype):
    """The publisher's torch conversion gives the very bits of the numpy reference (f16 cast, bf16_bits)."""
    import numpy as np

    from learner.orchestrate.publisher import Publisher
    from learner.train.wire_weights import wire_tensors
    from p2p.codec import bf16_bits

    model = tiny_policy(seed=3).model
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 1e-3 * torch.randn_like(p))  # off the initial values' round numbers
    publisher = Publisher(seeder=None, run_id="r", full_every=10, dtype=dtype)
    snapshot = publisher.snapshot(model)
    reference = wire_tensors(model)
    assert set(snapshot) == set(reference)
    for name, x in reference.items():
        want = x if x.ndim < 2 else bf16_bits(x) if dtype == "bf16" else x.astype(np.float16)
        assert snapshot[name].dtype == want.dtype and np.array_equal(snapshot[name].view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_wire_tensors_are_a_copy_of_the_weights(dtype):
    """A version is encoded (and remembered by the verifier) in the background while the next step trains:
    its arrays must not change when the optimizer updates the weights in place (float32 norms did)."""
    import numpy as np

    from learner.train.wire_weights import wire_tensors

    policy = tiny_policy(0)
    tensors = wire_tensors(policy.model, dtype)
    before = {name: a.copy() for name, a in tensors.items()}
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(1.0)
    assert all(np.array_equal(before[name], a) for name, a in tensors.items())


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_sparse_deltas_carry_the_rest_forward(dtype):
    """wire_topk < 1: a delta version changes only the largest share of each matrix's changes; what is
    left stays owed and is sent later (error feedback), so the workers' weights reach the learner's; the
    chain of deltas rebuilds exactly the carried weights; a full snapshot sends everything."""
    import numpy as np

    from learner.orchestrate.publisher import Publisher
    from p2p.versions import build_version, rebuild_raw, tensors_of
    from p2p.weights import to_float32

    model = tiny_policy(seed=3).model
    publisher = Publisher(seeder=None, run_id="r", full_every=100, dtype=dtype, topk=0.1)

    def publish(version: int) -> dict:
        tensors = publisher.carry(publisher.snapshot(model))
        pv, raw = build_version("r", version, tensors, base=publisher.previous)
        publisher.previous, publisher.published = (version, raw), publisher.published + 1
        return tensors, pv

    first, pv0 = publish(0)  # the first version is full: workers get the weights exactly
    held = rebuild_raw(pv0.manifest, pv0.chunks)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # one large step, then the target stays put
    target = publisher.snapshot(model)
    for version in range(1, 40):
        carried, pv = publish(version)
        held = rebuild_raw(pv.manifest, pv.chunks, held)  # what a worker following the chain holds
        assert all(np.array_equal(tensors_of(pv.manifest, held)[n], carried[n]) for n in carried)
        if version == 1:
            for name, a in carried.items():
                if a.ndim < 2:
                    assert np.array_equal(a, target[name])  # norms go whole
                    continue
                changed = (a != first[name]).mean()
                assert 0 < changed <= 0.1 + 1e-3, (name, changed)  # at most topk of the matrix changes
                # and those are the largest changes: every changed coordinate moved at least as far as any unsent one
                gap = np.abs(to_float32(target[name]) - to_float32(first[name]))
                sent = a != first[name]
                assert gap[sent].min() >= gap[~sent].max() - 1e-12
    assert all(np.array_equal(carried[n], target[n]) for n in target)  # nothing lost: all of it arrived
