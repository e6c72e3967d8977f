"""Playing episodes (a worker, the co-located learner) and replaying them (the learner's check).

An episode is recorded as one completion after its first prompt (p2p.messages.Completion): its tokens are
the model's turns and the environment's observations in order, `spans` their lengths [model, observation,
..., model], `logprobs` the behaviour logprob of every sampled token (0.0 for observation tokens, which are
never trained on), `reward` the return (the sum of the steps' rewards) and `finish_reason` "stop" when the
environment ended the episode, "length" when a budget did, "error" when its step raised.

Rules both sides follow, so the learner's replay reaches the same episode from the same turns:
- turn k (0-based) of episode j of group g samples at most min(turn_tokens, max_tokens - held) tokens,
  where held counts the episode's tokens so far; its draws are keyed (g, j, held + i) (p2p.draws);
- a turn that is not cut by its budget ends with a stop token, and only there;
- after each turn the environment steps on its text (step_env: a tool environment's calls go to its tools,
  envs.tools); the episode ends when the step says done, at the max_turns-th turn, or when the next
  observation would not fit in max_tokens; otherwise the observation's tokens follow and the next turn
  starts;
- a step that raises (the environment's bug, not the worker's) ends the episode there with finish "error";
  the replay must raise at the same turn, and the learner trains on nothing of that group
  (learner.orchestrate.rollouts.score_groups).

The policy version is fixed for a whole episode: a worker changes weights only between leases, so the
staleness of every turn is that of the version that started the episode.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from envs import EnvError, EnvFactory, EnvSpec, Step, close_env, failure, make_env
from envs.chat import ChatFormat
from envs.tools import TOOL_FORMATS, ToolEnv
from p2p.messages import Completion, EpisodeStep, EpisodeTurn, GenerationRequest, SamplingParams, sampled_count

Generate = Callable[[Sequence[GenerationRequest], SamplingParams], list[list[Completion]]]
Remote = Callable[[list[EpisodeTurn]], list[EpisodeStep]]  # a hosted environment's steps, asked of the learner
log = logging.getLogger(__name__)


class ReplayError(ValueError):
    """An episode the environment does not reproduce: a forged observation, outcome or turn structure."""


@dataclass(frozen=True)
class EpisodeRules:
    """Everything that decides an episode besides the policy: the environment and its budgets, and the chat
    format its observations are written in. The learner and its workers hold the same rules."""

    spec: EnvSpec
    make_env: EnvFactory | None  # None on a worker of a hosted environment: the learner steps it
    chat: ChatFormat

    @classmethod
    def of(cls, spec: EnvSpec, chat: ChatFormat) -> EpisodeRules:
        return cls(spec, None if spec.hosted else make_env(spec.name, spec.args), chat)


@dataclass
class _Live:
    """An episode being played."""

    env: object
    request: GenerationRequest
    index: int  # its completion index in the group
    record: Completion
    turns: int = 0
    reward: float = 0.0
    done: bool = False
    error: str | None = None  # the environment's exception, if its step raised


def generate_rollouts(
    generate: Generate,
    requests: Sequence[GenerationRequest],
    params: SamplingParams,
    rules: EpisodeRules | None = None,
    remote: Remote | None = None,
) -> list[list[Completion]]:
    """Every group of a lease or a step, in request order, the one way workers, the co-located loop and
    evaluation all turn requests into rollouts: an environment's (`rules` given) played as episodes, a task's
    completed once by `generate`; greedy requests (held-out evaluation) at temperature 0, apart from the rest.
    `remote`: a hosted environment's steps, asked of the learner (a worker's; see play_episodes)."""
    run = generate if rules is None else functools.partial(play_episodes, generate, rules=rules, remote=remote)
    greedy = [r for r in requests if r.greedy]
    sampled = [r for r in requests if not r.greedy]
    done = iter(run(greedy, dataclasses.replace(params, temperature=0.0)) if greedy else [])
    rest = iter(run(sampled, params) if sampled else [])
    return [next(done) if r.greedy else next(rest) for r in requests]


def play_episodes(
    generate: Generate,
    requests: Sequence[GenerationRequest],
    params: SamplingParams,
    rules: EpisodeRules,
    remote: Remote | None = None,
) -> list[list[Completion]]:
    """Play each request's group_size episodes of the environment reset with its `episode` seed (its first
    prompt: the request's prompt_ids) with `generate` (an engine's); returns one list of episode records
    per request, in order. With `remote` (a worker playing a hosted environment) the environment's part is
    the learner's: each round of turns goes to it in one request and its answers are recorded as they are.
    The first turns go to the engine as the requests themselves (a group's episodes share its prompt, so an
    engine prefills it once); every later turn of every live episode in one call per distinct token budget.
    params' max_new_tokens is replaced by the turn budgets. Callers go through generate_rollouts, which plays
    greedy requests (held-out evaluation) at temperature 0, apart from the others."""
    episodes: list[list[_Live]] = []
    try:
        for request in requests:
            if request.episode is None:
                raise ValueError(f"group {request.group} has no episode seed: it is not an environment's")
            group: list[_Live] = []
            episodes.append(group)
            for j in range(request.group_size):
                if remote is not None:  # a hosted environment: nothing of it runs here
                    group.append(_Live(None, request, request.completion + j, Completion([], [], "length", [], 0.0)))
                    continue
                if rules.make_env is None:
                    raise EnvError(f"environment {rules.spec.name} is hosted by the learner: it steps the episodes")
                env = rules.make_env()
                group.append(_Live(env, request, request.completion + j, Completion([], [], "length", [], 0.0)))
                try:
                    env.reset(request.episode)
                except Exception as exc:  # noqa: BLE001 - the learner started this seed: not deterministic
                    if rules.spec.hosted:  # the learner plays a hosted one itself: like HostedEpisode's
                        group[-1].error = f"start: {failure(exc)}"
                        continue
                    raise EnvError(
                        f"environment {rules.spec.name} failed to start episode {request.episode} ({failure(exc)}), "
                        "which started on the learner: is it deterministic?"
                    ) from None
        _play(generate, requests, params, rules, episodes, remote)
        for group in episodes:  # one line per group whose environment raised
            errors = [e.error for e in group if e.error]
            if errors:
                log.warning("environment %s raised in %d of %d episodes of seed %d (%s); they end there",
                            rules.spec.name, len(errors), len(group), group[0].request.episode, errors[0])  # fmt: skip
    finally:
        for e in (e for group in episodes for e in group):
            close_env(e.env)
    return [[e.record for e in group] for group in episodes]


def _play(
    generate: Generate,
    requests: Sequence[GenerationRequest],
    params: SamplingParams,
    rules: EpisodeRules,
    episodes: list[list[_Live]],
    remote: Remote | None,
) -> None:
    """Play the reset episodes turn by turn until each is done (see play_episodes)."""
    spec = rules.spec
    first = dataclasses.replace(params, max_new_tokens=min(spec.turn_tokens, spec.max_tokens))
    turns = generate(requests, first)
    _step_all([(e, t) for group, ts in zip(episodes, turns, strict=True) for e, t in zip(group, ts, strict=True)],
              rules, remote)  # fmt: skip
    for _ in range(spec.max_turns - 1):
        live = [e for group in episodes for e in group if not e.done]
        if not live:
            break
        by_budget: dict[int, list[_Live]] = {}
        for e in live:
            by_budget.setdefault(min(spec.turn_tokens, spec.max_tokens - len(e.record.tokens)), []).append(e)
        for budget, batch in by_budget.items():
            turn_requests = [
                GenerationRequest(
                    e.request.prompt_ids + e.record.tokens, 1, e.request.group, completion=e.index,
                    position=len(e.record.tokens),
                )
                for e in batch
            ]  # fmt: skip
            turns = generate(turn_requests, dataclasses.replace(params, max_new_tokens=budget))
            _step_all([(e, turn) for e, (turn,) in zip(batch, turns, strict=True)], rules, remote)


def _step_all(pairs: list[tuple[_Live, Completion]], rules: EpisodeRules, remote: Remote | None) -> None:
    """Step each episode on its new turn: here, or (a hosted environment) all at once by the learner."""
    if remote is None:
        for e, turn in pairs:
            _after_turn(e, turn.tokens, turn.logprobs, rules)
        return
    steps = remote([EpisodeTurn(e.request.group, e.index, e.turns, turn.tokens) for e, turn in pairs])
    for (e, turn), step in zip(pairs, steps, strict=True):
        record = e.record
        record.tokens += turn.tokens
        record.logprobs += turn.logprobs
        record.spans.append(len(turn.tokens))
        e.turns, record.reward = e.turns + 1, step.reward
        if step.done:
            e.done, record.finish_reason = True, step.finish
            e.error = "the hosted environment raised (the learner logged it)" if step.finish == "error" else None
        else:
            record.tokens += step.observation
            record.logprobs += [0.0] * len(step.observation)
            record.spans.append(len(step.observation))


def _after_turn(e: _Live, tokens: list[int], logprobs: list[float], rules: EpisodeRules) -> None:
    """Record a model turn, step the environment on it, and append its observation or end the episode."""
    record, spec, chat = e.record, rules.spec, rules.chat
    record.tokens += tokens
    record.logprobs += logprobs
    record.spans.append(len(tokens))
    e.turns += 1
    if e.error is not None:  # its reset raised: the episode ends at its first turn
        e.done, record.finish_reason = True, "error"
        return
    try:
        step, observation = step_env(e.env, tokens, chat)
        e.reward += step_reward(step.reward)
    except Exception as exc:  # noqa: BLE001 - the environment's failure ends its episode, as the replay will find
        e.error = f"turn {e.turns - 1}: {failure(exc)}"
        e.done, record.finish_reason, record.reward = True, "error", e.reward
        return
    record.reward = e.reward
    if step.done:
        e.done, record.finish_reason = True, "stop"
        return
    if e.turns >= spec.max_turns or len(record.tokens) + len(observation) >= spec.max_tokens:
        e.done, record.finish_reason = True, "length"
        return
    record.tokens += observation
    record.logprobs += [0.0] * len(observation)
    record.spans.append(len(observation))


def step_env(env: object, turn: list[int], chat: ChatFormat) -> tuple[Step, list[int]]:
    """Step `env` on a model turn, and the tokens that follow the turn unless the step is done: a tool
    environment's turn with calls (read in the run's tool format) runs its tools and is followed by their
    results as tool messages; any other turn is the environment's step(text), followed by its observation.
    Whatever fails here is the environment's failure at this turn, on the worker and in the replay alike."""
    calls = TOOL_FORMATS[chat.tool_format](chat.decode_calls(turn)) if isinstance(env, ToolEnv) else []
    step = env.call_tools(calls) if calls else env.step(chat.decode(turn))
    if step.done:
        return step, []
    if not isinstance(step.tool_results, tuple) or not all(isinstance(r, str) for r in step.tool_results):
        raise EnvError("an environment's Step.tool_results must be a tuple of strings")
    if step.tool_results:
        return step, chat.tool_result_ids(step.tool_results, turn)
    return step, chat.observation_ids(step.observation, turn)


def step_reward(reward: object) -> float:
    """A step's reward as a float; a non-finite one counts 0, as a task's reward does (learner.tasks)."""
    if not isinstance(reward, int | float):  # bool is an int: True counts 1
        raise EnvError(f"an environment's Step.reward must be a number, got {type(reward).__name__} {reward!r:.40}")
    return float(reward) if math.isfinite(reward) else 0.0


@dataclass(frozen=True)
class Replayed:
    """What the learner's replay of an episode found: the return it computes itself, and the shape."""

    reward: float
    turns: int
    model_tokens: int
    observation_tokens: int
    error: str | None = None  # the environment's exception, when its step raised (finish "error")


def replay_episode(episode: Completion, seed: int, rules: EpisodeRules) -> Replayed:
    """Replay a claimed episode on a fresh environment; raise ReplayError at the first token, observation,
    ending or reward the environment does not reproduce (the rules are in the module docstring)."""
    spec, spans, tokens = rules.spec, episode.spans, episode.tokens
    if not spans or len(spans) % 2 == 0 or sum(spans) != len(tokens) or min(spans) < 1:
        raise ReplayError("an episode's spans must be [model, observation, ..., model] lengths summing to its tokens")
    if len(spans) // 2 + 1 > spec.max_turns:
        raise ReplayError(f"an episode has {len(spans) // 2 + 1} model turns; the run allows {spec.max_turns}")
    env = rules.make_env()
    try:
        env.reset(seed)
        reward, error = _replay_turns(env, episode, rules)
    finally:
        close_env(env)
    if episode.reward is None or episode.reward != reward:
        raise ReplayError(f"the episode claims reward {episode.reward}, the environment gives {reward}")
    sampled = sampled_count(len(tokens), spans)
    return Replayed(reward, len(spans) // 2 + 1, sampled, len(tokens) - sampled, error)


def check_turn(turn: list[int], held: int, k: int, rules: EpisodeRules) -> None:
    """Raise ReplayError unless model turn `k`, after `held` tokens of its episode, keeps the token budget and
    ends at its first stop token or at the budget (the module docstring's rules)."""
    budget = min(rules.spec.turn_tokens, rules.spec.max_tokens - held)
    stops = rules.chat.stop_ids
    if not turn or len(turn) > budget or any(t in stops for t in turn[:-1]):
        raise ReplayError(f"turn {k} is empty, or runs past its budget of {budget} tokens or past a stop token")
    if len(turn) < budget and turn[-1] not in stops:
        raise ReplayError(f"turn {k} ends before its budget without a stop token")


class HostedEpisode:
    """The learner's half of one episode of a hosted environment (EnvSpec.hosted): the worker samples the
    model's turns, the learner steps its own environment on each (turn: the rules of this module, as play
    applies them) and answers with what follows the turn, so the observations need not be reproducible and
    are never replayed; check() compares the worker's record of the whole episode with the learner's."""

    def __init__(self, rules: EpisodeRules, request: GenerationRequest, index: int) -> None:
        assert rules.make_env is not None, "the learner holds a hosted environment's factory"
        self.rules, self.last = rules, None
        self.live = _Live(None, request, index, Completion([], [], "length", [], 0.0))
        try:
            self.live.env = rules.make_env()
            self.live.env.reset(request.episode)
        except Exception as exc:  # noqa: BLE001 - the environment's failure: the episode ends at its first turn
            self.live.error = f"start: {failure(exc)}"

    def turn(self, k: int, tokens: list[int]) -> EpisodeStep:
        """Step on the episode's turn `k`; the same turn sent again (a reply lost on the way) gets the same
        answer. Raises ReplayError for a turn out of order or against the rules."""
        e = self.live
        if self.last is not None and self.last[0] == k and self.last[1] == tokens:
            return self.last[2]
        if e.done or k != e.turns:
            state = f"it has {e.turns} turns" + (" and has ended" if e.done else "")
            raise ReplayError(f"turn {k} is not episode {e.index}'s next ({state})")
        check_turn(tokens, len(e.record.tokens), k, self.rules)
        start = len(e.record.tokens) + len(tokens)
        _after_turn(e, list(tokens), [0.0] * len(tokens), self.rules)
        if e.error is not None:
            log.warning("hosted environment %s raised in an episode of seed %d (%s); it ends there",
                        self.rules.spec.name, e.request.episode, e.error)  # fmt: skip
        step = EpisodeStep(e.record.tokens[start:], e.done, e.record.finish_reason if e.done else "", e.record.reward)
        self.last = (k, list(tokens), step)
        return step

    def check(self, claimed: Completion) -> Replayed:
        """The episode as the learner hosted it; ReplayError if the worker's record differs in anything but its
        logprobs (the verifier checks those), or was not played to its end."""
        e, record = self.live, self.live.record
        if not e.done:
            raise ReplayError(f"episode {e.index} was not played to its end with the learner")
        for what, ours, theirs in [("tokens", record.tokens, claimed.tokens), ("turns", record.spans, claimed.spans),
                                   ("finish", record.finish_reason, claimed.finish_reason),
                                   ("return", record.reward, claimed.reward)]:  # fmt: skip
            if ours != theirs:
                raise ReplayError(f"the episode's {what} are not those of the episode the learner hosted")
        sampled = sampled_count(len(record.tokens), record.spans)
        return Replayed(record.reward, e.turns, sampled, len(record.tokens) - sampled, e.error)

    def close(self) -> None:
        close_env(self.live.env)


def _replay_turns(env: object, episode: Completion, rules: EpisodeRules) -> tuple[float, str | None]:
    """Step `env` through the episode's model turns, checking each against the rules; the return, and the
    environment's exception if a step raised."""
    spec, chat = rules.spec, rules.chat
    spans, tokens = episode.spans, episode.tokens
    reward, held = 0.0, 0
    for k in range(0, len(spans), 2):
        turn = tokens[held : held + spans[k]]
        check_turn(turn, held, k // 2, rules)
        held += len(turn)
        last = k == len(spans) - 1
        try:
            step, observation = step_env(env, turn, chat)
            reward += step_reward(step.reward)
        except Exception as exc:  # noqa: BLE001 - an environment's failure is part of the episode it ends
            if last and episode.finish_reason == "error":
                return reward, failure(exc)
            claim = "the record goes on" if not last else f"the episode's finish is {episode.finish_reason!r}"
            raise ReplayError(f"the environment raised at turn {k // 2} ({failure(exc)}); {claim}") from None
        if last and episode.finish_reason == "error":
            raise ReplayError(f"the episode claims the environment raised at turn {k // 2}; it did not")
        if step.done:
            if not last:
                raise ReplayError(f"the environment ended the episode after turn {k // 2}, the record goes on")
            if episode.finish_reason != "stop":
                raise ReplayError("the environment ended the episode; its finish must be 'stop'")
            break
        if last:
            out_of_budget = k // 2 + 1 >= spec.max_turns or held + len(observation) >= spec.max_tokens
            if not out_of_budget:
                raise ReplayError(f"the episode stops after turn {k // 2}, yet the environment and budgets go on")
            if episode.finish_reason != "length":
                raise ReplayError("a budget ended the episode; its finish must be 'length'")
            break
        if tokens[held : held + spans[k + 1]] != observation:
            raise ReplayError(f"the observation after turn {k // 2} is not the environment's")
        held += spans[k + 1]
    return reward, None
