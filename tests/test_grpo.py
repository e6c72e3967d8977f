import dataclasses
import math
import typing

import pytest
import torch

from learner.config import GRPOConfig
from learner.train.grpo import (
    CORRECTIONS,
    OBJECTIVES,
    REWARD_LIMIT,
    TokenBatch,
    clamp_reward,
    correction_weights,
    group_advantages,
    policy_loss,
)


def loss_of(logp, logp_mu, adv, weights, cfg, prox=None, sequence=None, logp_ref=None):
    """policy_loss on flat tokens; one sequence unless `sequence` says otherwise; the correction's weights
    computed per sequence, as the trainer does."""
    sequence = torch.zeros(len(logp), dtype=torch.long) if sequence is None else sequence
    correction = None
    if prox is not None:
        correction = torch.cat(
            [correction_weights(prox[sequence == i], logp_mu[sequence == i], cfg) for i in sequence.unique()]
        )
    t = TokenBatch(logp, logp_mu, adv, sequence, prox, correction)
    return policy_loss(t, weights, cfg, logp_ref)


def ppo(eps_low=0.2, eps_high=0.2, ratio_cap=3.0, **kw) -> GRPOConfig:
    return GRPOConfig(eps_low=eps_low, eps_high=eps_high, ratio_cap=ratio_cap, **kw)


def test_group_advantages_by_hand():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]))
    # mean 0.5, population std 0.5
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))


def test_loss_and_gradient_match_hand_computation():
    # three tokens: inside the clip range, clipped above (A > 0), truncated at the cap (A < 0)
    logp_mu = torch.tensor([-1.0, -2.0, -3.0])
    log_ratio = torch.tensor([0.1, 0.5, 1.5])  # ratios 1.105, 1.649, 4.48
    logp = (logp_mu + log_ratio).clone().requires_grad_(True)
    adv = torch.tensor([1.0, 2.0, -1.0])
    w = torch.full((3,), 1 / 3)
    loss, stats = loss_of(logp, logp_mu, adv, w, ppo())
    r = [math.exp(0.1), math.exp(0.5), math.exp(1.5)]
    # token 0: min(r*A, clip*A) = r*A (unclipped); token 1: clipped at 1.2 -> 2.4;
    # token 2: A<0: min(r*A, clip(r)*A) = -4.48, then max(-4.48, 3*-1) = -3 (truncated)
    expected = -(r[0] * 1.0 + 1.2 * 2.0 + -3.0) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # d/dlogp of -w*r*A = -w*A*r for the unclipped token, 0 for clipped/truncated ones
    assert logp.grad.tolist() == pytest.approx([-r[0] / 3, 0.0, 0.0], rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 3)


def test_negative_advantage_inside_range_has_gradient():
    logp_mu = torch.tensor([-1.0])
    logp = torch.tensor([-1.0 + math.log(0.9)], requires_grad=True)
    loss, _ = loss_of(logp, logp_mu, torch.tensor([-2.0]), torch.ones(1), ppo())
    loss.backward()
    assert loss.item() == pytest.approx(0.9 * 2.0)
    assert float(logp.grad) == pytest.approx(2.0 * 0.9)  # pushing logp down lowers the loss


def test_equal_reward_group_contributes_no_gradient():
    adv = group_advantages(torch.tensor([[0.7, 0.7, 0.7]]))[0]
    logp = torch.tensor([-0.5, -1.5, -2.5], requires_grad=True)
    loss, _ = loss_of(logp, logp.detach() - 0.1, adv, torch.full((3,), 1 / 3), ppo(eps_high=0.28))
    loss.backward()
    assert torch.count_nonzero(logp.grad) == 0


def test_kl_penalty_k3():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    loss, stats = loss_of(logp, logp.detach(), torch.zeros(2), torch.full((2,), 0.5), ppo(beta=0.1), logp_ref=ref)
    d = ref - logp.detach()
    k3 = torch.exp(d) - d - 1
    assert loss.item() == pytest.approx(float(0.1 * k3.mean()), rel=1e-6)
    assert stats["kl_ref"] == pytest.approx(float(k3.mean()), rel=1e-6)


def test_decoupled_objective_reweights_and_clips_to_the_proximal_policy():
    logp_mu = torch.tensor([-1.0, -2.0, -3.0])
    prox = logp_mu + torch.tensor([0.1, 0.5, 1.5])  # how far the learner had moved from the (stale) sampler
    iw = [math.exp(0.1), math.exp(0.5), 3.0]  # exp(1.5) = 4.48 is truncated at the cap
    adv = torch.tensor([1.0, 2.0, -1.0])
    w = torch.full((3,), 1 / 3)
    # first update of a step: pi_theta = pi_prox, ratio 1, every token keeps its gradient, weighted by iw
    logp = prox.clone().requires_grad_(True)
    loss, stats = loss_of(logp, logp_mu, adv, w, ppo(objective="decoupled", minibatches=2), prox)
    assert loss.item() == pytest.approx(-(iw[0] * 1 + iw[1] * 2 + iw[2] * -1) / 3, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-iw[0] / 3, -2 * iw[1] / 3, iw[2] / 3], rel=1e-6)
    assert stats["clip_frac"] == 0.0
    # a later update, the policy moved past the trust region on token 1 (A > 0, ratio 1.5 > 1.2): clipped
    logp = (prox + torch.tensor([0.0, math.log(1.5), 0.0])).requires_grad_(True)
    loss, stats = loss_of(logp, logp_mu, adv, w, ppo(objective="decoupled", minibatches=2), prox)
    loss.backward()
    assert logp.grad[1].item() == 0.0 and logp.grad[0].item() != 0.0
    assert stats["clip_frac"] == pytest.approx(1 / 3)


def test_extreme_behaviour_logprobs_give_finite_loss_and_gradient():
    # a forged logprob of -1000 made exp(logp - logp_mu) overflow to inf; its backward gave 0 * inf = NaN
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    logp_mu = torch.tensor([-1000.0, -2.0, 1000.0])
    for adv in (torch.tensor([1.0, 1.0, -1.0]), torch.tensor([-1.0, 1.0, 1.0])):
        for objective in OBJECTIVES:
            for correction in CORRECTIONS if objective != "behaviour" else ["tis"]:
                cfg = ppo(eps_high=0.28, objective=objective, correction=correction, minibatches=2)
                prox = None if objective == "behaviour" else logp.detach()
                logp.grad = None
                loss, stats = loss_of(logp, logp_mu, adv, torch.full((3,), 1 / 3), cfg, prox)
                loss.backward()
                assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all(), (objective, correction)
                assert all(math.isfinite(v) for v in stats.values())


def test_equal_rewards_give_exactly_zero_advantages():
    rewards = torch.tensor([[0.1] * 7, [0.7] * 7, [1 / 3] * 7], dtype=torch.float64)
    assert rewards[0].mean() != 0.1 and rewards[1].mean() != 0.7  # rounding: why "equal" must be tested
    assert torch.equal(group_advantages(rewards), torch.zeros_like(rewards))


def test_rewards_are_made_finite_and_bounded():
    assert [clamp_reward(x) for x in (math.inf, -math.inf, math.nan, 1e9, -1e9, 0.5)] == [
        0.0, 0.0, 0.0, REWARD_LIMIT, -REWARD_LIMIT, 0.5,
    ]  # fmt: skip
    adv = group_advantages(torch.tensor([[clamp_reward(r) for r in (math.inf, 1.0, -math.inf, 0.0)]]))
    assert torch.isfinite(adv).all()


def test_every_config_value_has_its_function():
    hints = typing.get_type_hints(GRPOConfig)
    assert set(typing.get_args(hints["objective"])) == set(OBJECTIVES)
    assert set(typing.get_args(hints["correction"])) == set(CORRECTIONS)


def test_correction_weights_by_hand():
    log_rho = torch.tensor([math.log(0.3), math.log(0.8), math.log(1.5), math.log(2.5), math.log(4.0)])
    mu = torch.tensor([-1.0, -2.0, -3.0, -1.5, -0.5])
    prox = mu + log_rho
    cfg = GRPOConfig(ratio_cap=3.0, mismatch_low=0.5, mismatch_high=2.0)

    def weights(name: str) -> list[float]:
        return correction_weights(prox, mu, dataclasses.replace(cfg, correction=name)).tolist()

    assert weights("none") == [1.0] * 5
    assert weights("tis") == pytest.approx([0.3, 0.8, 1.5, 2.5, 3.0])  # truncated at ratio_cap
    assert weights("mis") == pytest.approx([0.3, 0.8, 1.5, 2.5, 0.0])  # above the cap: dropped
    assert weights("icepop") == pytest.approx([0.0, 0.8, 1.5, 0.0, 0.0])  # outside [0.5, 2]: dropped
    # geometric mean of rho = exp(mean log rho) = (0.3 * 0.8 * 1.5 * 2.5 * 4) ** (1/5) = 1.46: kept whole
    assert weights("seq_mask") == [1.0] * 5
    # without the last token: (0.3 * 0.8 * 1.5 * 2.5) ** (1/4) = 0.97; a sequence sampled far likelier by mu
    far = correction_weights(mu - 1.0, mu, dataclasses.replace(cfg, correction="seq_mask"))  # g = e^-1 = 0.37
    assert far.tolist() == [0.0] * 5


def test_gspo_uses_one_clipped_ratio_per_sequence():
    # two sequences: [t0, t1] moved by log-ratios 0.1 and 0.3 (geometric mean ratio e^0.2 = 1.22, clipped
    # at 1.2 for A > 0); [t2] moved by -0.1 (ratio 0.905, inside [0.8, 1.2])
    prox = torch.tensor([-1.0, -2.0, -3.0])
    logp = (prox + torch.tensor([0.1, 0.3, -0.1])).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -2.0])
    sequence = torch.tensor([0, 0, 1])
    cfg = ppo(objective="gspo", correction="none", minibatches=2)
    w = torch.tensor([1 / 4, 1 / 4, 1 / 2])  # sequence-level normalisation of 2 sequences
    loss, stats = loss_of(logp, prox, adv, w, cfg, prox, sequence)
    s1 = math.exp(-0.1)
    assert loss.item() == pytest.approx(-(1.2 * 1.0 + s1 * -2.0) / 2, rel=1e-6)
    loss.backward()
    # sequence 0 is clipped: no gradient; sequence 1: d(-s A / 2)/dlogp = -A s / 2 (its mean has one token)
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, 2.0 * s1 / 2], rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(0.5)
    # unclipped, every token of a sequence gets s_i A_i / |y_i| times its normalisation weight
    logp = (prox + torch.tensor([0.05, 0.05, 0.0])).requires_grad_(True)
    loss, _ = loss_of(logp, prox, adv, w, cfg, prox, sequence)
    loss.backward()
    s0 = math.exp(0.05)
    assert logp.grad[:2].tolist() == pytest.approx([-s0 * 1.0 / 2 / 2] * 2, rel=1e-6)


def test_cispo_keeps_the_gradient_of_clipped_tokens_with_a_clipped_weight():
    prox = torch.tensor([-1.0, -2.0, -3.0])
    logp = (prox + torch.tensor([0.0, 0.5, -0.5])).requires_grad_(True)  # ratios 1, 1.65, 0.61
    adv = torch.tensor([1.0, 2.0, -1.0])
    w = torch.full((3,), 1 / 3)
    loss, stats = loss_of(logp, prox, adv, w, ppo(objective="cispo", correction="none"), prox)
    clipped_w = [1.0, 1.2, 0.8]  # clip(ratio, 0.8, 1.2), no gradient through it
    logp_v = logp.detach().tolist()
    terms = [c * a * lp for c, a, lp in zip(clipped_w, adv.tolist(), logp_v, strict=True)]
    assert loss.item() == pytest.approx(-sum(terms) / 3)
    loss.backward()
    # d loss / d logp = -weight * A / 3 for every token: clipping the weight never removes a token's gradient
    assert logp.grad.tolist() == pytest.approx([-1.0 / 3, -2.4 / 3, 0.8 / 3], rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 3)


def test_a_correction_multiplies_each_objectives_surrogate():
    mu = torch.tensor([-1.0, -2.0])
    prox = mu + torch.tensor([math.log(4.0), math.log(0.5)])  # rho 4 (over the cap of 3), 0.5
    logp = prox.clone().requires_grad_(True)
    adv = torch.tensor([1.0, 1.0])
    w = torch.full((2,), 1 / 2)
    loss, _ = loss_of(logp, mu, adv, w, ppo(objective="decoupled", correction="mis", minibatches=2), prox)
    assert loss.item() == pytest.approx(-(0.0 + 0.5) / 2)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5 / 2])


def test_dr_grpo_advantages_are_not_scaled_by_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0]])
    assert group_advantages(rewards, scale_by_std=False)[0].tolist() == [0.75, -0.25, -0.25, -0.25]
    assert group_advantages(rewards, scale_by_std=False)[1].tolist() == [0.0] * 4


def test_gspo_gives_no_gradient_to_a_token_the_correction_dropped():
    mu = torch.tensor([-1.0, -2.0, -3.0])
    prox = mu + torch.tensor([0.0, 0.0, math.log(4.0)])  # rho 1, 1, 4: icepop drops the third token
    logp = (prox + torch.tensor([0.05, -0.05, 0.3])).requires_grad_(True)
    cfg = ppo(objective="gspo", correction="icepop", minibatches=2)
    loss, _ = loss_of(logp, mu, torch.ones(3), torch.full((3,), 1 / 3), cfg, prox)
    loss.backward()
    assert logp.grad[2].item() == 0.0 and logp.grad[0].item() != 0.0
    # s is the geometric mean of the kept tokens' ratios only: exp((0.05 - 0.05) / 2) = 1
    assert loss.item() == pytest.approx(-(1.0 + 1.0) / 3, rel=1e-6)
