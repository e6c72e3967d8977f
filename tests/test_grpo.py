import math

import pytest
import torch

from learner.train.grpo import REWARD_LIMIT, clamp_reward, group_advantages, policy_loss


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
    loss, stats = policy_loss(logp, logp_mu, adv, w, eps_low=0.2, eps_high=0.2, ratio_cap=3.0)
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
    loss, _ = policy_loss(logp, logp_mu, torch.tensor([-2.0]), torch.ones(1), 0.2, 0.2, 3.0)
    loss.backward()
    assert loss.item() == pytest.approx(0.9 * 2.0)
    assert float(logp.grad) == pytest.approx(2.0 * 0.9)  # pushing logp down lowers the loss


def test_equal_reward_group_contributes_no_gradient():
    adv = group_advantages(torch.tensor([[0.7, 0.7, 0.7]]))[0]
    logp = torch.tensor([-0.5, -1.5, -2.5], requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach() - 0.1, adv, torch.full((3,), 1 / 3), 0.2, 0.28, 3.0)
    loss.backward()
    assert torch.count_nonzero(logp.grad) == 0


def test_kl_penalty_k3():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    loss, stats = policy_loss(logp, logp.detach(), torch.zeros(2), torch.full((2,), 0.5), 0.2, 0.2, 3.0, ref, beta=0.1)
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
    loss, stats = policy_loss(logp, logp_mu, adv, w, 0.2, 0.2, ratio_cap=3.0, logp_proximal=prox)
    assert loss.item() == pytest.approx(-(iw[0] * 1 + iw[1] * 2 + iw[2] * -1) / 3, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-iw[0] / 3, -2 * iw[1] / 3, iw[2] / 3], rel=1e-6)
    assert stats["clip_frac"] == 0.0
    # a later update, the policy moved past the trust region on token 1 (A > 0, ratio 1.5 > 1.2): clipped
    logp = (prox + torch.tensor([0.0, math.log(1.5), 0.0])).requires_grad_(True)
    loss, stats = policy_loss(logp, logp_mu, adv, w, 0.2, 0.2, ratio_cap=3.0, logp_proximal=prox)
    loss.backward()
    assert logp.grad[1].item() == 0.0 and logp.grad[0].item() != 0.0
    assert stats["clip_frac"] == pytest.approx(1 / 3)


def test_extreme_behaviour_logprobs_give_finite_loss_and_gradient():
    # a forged logprob of -1000 made exp(logp - logp_mu) overflow to inf; its backward gave 0 * inf = NaN
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    logp_mu = torch.tensor([-1000.0, -2.0, 1000.0])
    for adv in (torch.tensor([1.0, 1.0, -1.0]), torch.tensor([-1.0, 1.0, 1.0])):
        for prox in (None, logp.detach()):
            logp.grad = None
            loss, stats = policy_loss(logp, logp_mu, adv, torch.full((3,), 1 / 3), 0.2, 0.28, 3.0, logp_proximal=prox)
            loss.backward()
            assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
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
