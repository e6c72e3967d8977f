"""A supervised warm start for the calculator's tool environment: a model that never writes a tool call gives
RL nothing to reinforce (SmolLM2-135M answered 128 of 128 episodes without one), so it first imitates a few
solved ones (docs/benchmarks.md, "A tool environment"):

    python scripts/warm_start_tools.py --out /tmp/smollm2-tools --max-new-tokens 48 --max-episode-tokens 192
    echo-rl learner start --model /tmp/smollm2-tools --env calculator-tools --max-new-tokens 48 ...

The demonstrations are played through the environment's own episode rules, the way the learner plays and
replays episodes (learner.rollout_source): the first prompt rendered by the model's chat template with the
tool's schema, a scripted demonstrator in place of the engine (call `calculate` with the question's
expression in the Hermes format, then answer with the tool's result), the tool's result as the template
writes tool messages. Each demonstration is replayed by the environment (the best return) before it is
trained on. Training is cross-entropy on the model's turns only (never the prompt or the tool's results),
AdamW, then the weights and tokenizer are saved as a transformers folder that `--model` loads. Seeds come
from the training split, so held-out evaluation sees none of these problems.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_cli.config import parse_key_values  # noqa: E402
from envs import EnvError, EnvFactory, make_env  # noqa: E402
from envs.chat import ChatFormat  # noqa: E402
from envs.episode import Generate  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.rollout_source import RolloutSource  # noqa: E402
from learner.run import environment_task  # noqa: E402
from learner.tasks.split import split_task  # noqa: E402
from learner.train.devices import resolve_device  # noqa: E402
from learner.train.models import Policy, load_run_policy  # noqa: E402
from learner.train.trainer import completion_logprobs  # noqa: E402
from p2p.config import ConfigError  # noqa: E402
from p2p.messages import Completion, GenerationRequest, SamplingParams  # noqa: E402

ENV = "calculator-tools"
RESULT = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.DOTALL)  # the Hermes tool message


def demonstrator(policy: Policy, stop: int, envs: EnvFactory) -> Generate:
    """An engine stand-in that solves calculator-tools episodes: on the first turn it calls `calculate` with
    the question's expression (in the Hermes format the generic tool instructions ask for, or the template's
    own), on the next it answers with the last tool result it was shown. Every turn ends with `stop`. The
    expression is the environment's own for the episode's seed (`envs()`: a CalculatorToolEnv)."""
    if policy.tool_format[0] != "hermes":
        raise SystemExit(f"the demonstrator writes Hermes tool calls; this model's uses {policy.tool_format[0]}")

    def turn(request: GenerationRequest) -> str:
        if request.position == 0:  # the first turn: the request carries the episode's seed
            call = {"name": "calculate", "arguments": {"expression": envs().draw(request.episode)}}
            return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        episode = policy.tokenizer.decode(request.prompt_ids[-request.position :], skip_special_tokens=False)
        return f"The answer is {RESULT.findall(episode)[-1]}."

    def generate(requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        groups = []
        for request in requests:
            tokens = policy.tokenizer.encode(turn(request), add_special_tokens=False) + [stop]
            if len(tokens) > params.max_new_tokens:
                raise SystemExit(f"a demonstrated turn takes {len(tokens)} tokens: raise --max-new-tokens")
            groups.append([Completion(tokens, [0.0] * len(tokens), "stop") for _ in range(request.group_size)])
        return groups

    return generate


def demonstrations(cfg: LearnerConfig, policy: Policy, count: int, seed: int) -> list[Demonstration]:
    """`count` demonstrated episodes of the training split, each replayed by the environment with the best
    return (1 less one call's cost; SystemExit if one is not: the demonstrator would teach a mistake)."""
    envs = make_env(ENV, cfg.env.env_args)
    task = split_task(environment_task(cfg, policy, envs), "train")
    source = RolloutSource(task, policy)
    rng = random.Random(seed)
    problems = [task.sample(rng) for _ in range(count)]
    prompts = [source.prompt(p) for p in problems]
    requests = [source.request(p, ids, 1, k) for k, (p, ids) in enumerate(zip(problems, prompts, strict=True))]
    params = SamplingParams(0.0, 1.0, cfg.sampler.max_new_tokens, seed)
    assert source.episodes is not None
    groups = source.generate(demonstrator(policy, turn_end(source.episodes.chat), envs), requests, params)
    best = 1.0 - float(cfg.env.env_args.get("call_cost", 0.0))
    for problem, group in zip(problems, groups, strict=True):
        if source.returns(problem, group).values != [best]:
            episode = policy.tokenizer.decode(group[0].tokens)
            raise SystemExit(f"a demonstration of seed {problem.answer} does not earn {best} on replay: {episode!r}")
    return [Demonstration(ids, g[0].tokens, g[0].spans) for ids, g in zip(prompts, groups, strict=True)]


def turn_end(chat: ChatFormat) -> int:
    """The stop token that ends an assistant message in the chat template (<|im_end|>, where the observation
    after a turn opens with it), not a base model's end-of-text: the one a sampled turn ends with."""
    for stop in chat.stop_ids:
        if chat.observation_open.startswith(chat.tokenizer.decode([stop], skip_special_tokens=False) or "\0"):
            return stop
    return chat.stop_ids[0]


@dataclass
class Demonstration:
    """A demonstrated episode as the trainer reads a sequence (learner.train.trainer.TrainingSequence): only
    its model turns are targets (its spans), never the prompt or the tool's results."""

    prompt_ids: list[int]
    completion_ids: list[int]
    spans: list[int]
    behaviour_logprobs: list[float] = field(default_factory=list)  # unused: no importance ratio in SFT
    advantage: float = 0.0


def train(policy: Policy, shown: list[Demonstration], epochs: int, lr: float, batch: int, seed: int) -> list[float]:
    """Cross-entropy on the model turns (the mean over the batch's target tokens of -log pi, as the trainer
    computes log pi: learner.train.trainer.completion_logprobs), AdamW; the loss of every batch."""
    model = policy.model
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    losses = []
    for epoch in range(epochs):
        order = list(range(len(shown)))
        rng.shuffle(order)
        for start in range(0, len(order), batch):
            chosen = [shown[i] for i in order[start : start + batch]]
            loss = -completion_logprobs(model, chosen, temperature=1.0).mean()  # [N] target tokens -> scalar
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            print(f"epoch {epoch + 1} batch {start // batch + 1}: loss {loss.item():.4f}", flush=True)
    model.eval()
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="what `--model` of learner start takes")
    parser.add_argument("--out", required=True, help="the transformers folder to write (must not exist)")
    parser.add_argument("--episodes", type=int, default=32, help="demonstrated episodes")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--batch", type=int, default=8, help="episodes per AdamW step")
    parser.add_argument("--device", default="auto", help="auto (cuda if any), cpu, cuda, cuda:N")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--env-args", action="append", default=[], help="KEY=VALUE, as learner start takes them")
    defaults = LearnerConfig()
    parser.add_argument("--max-new-tokens", type=int, default=defaults.sampler.max_new_tokens, help="per turn")
    parser.add_argument("--max-episode-tokens", type=int, default=defaults.env.max_episode_tokens)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"{out} exists: choose another --out (nothing is overwritten)")
    if min(args.episodes, args.epochs, args.batch) < 1 or not args.lr > 0:
        raise SystemExit("--episodes, --epochs and --batch must be at least 1, --lr above 0")
    cfg = LearnerConfig()
    cfg.model.model, cfg.model.device, cfg.env.env = args.model, args.device, ENV
    cfg.sampler.max_new_tokens, cfg.env.max_episode_tokens = args.max_new_tokens, args.max_episode_tokens
    try:
        cfg.env.env_args = parse_key_values(args.env_args, "--env-args")
        make_env(ENV, cfg.env.env_args)  # a bad knob fails before the model loads
        device = resolve_device(cfg.model.device)
    except (ConfigError, EnvError) as exc:
        raise SystemExit(f"error: {exc}") from None
    policy = load_run_policy(cfg.model, args.seed)
    policy.model.to(device)
    shown = demonstrations(cfg, policy, args.episodes, args.seed)
    print(f"{len(shown)} demonstrations, each replayed with the best return; e.g.:\n"
          f"{policy.tokenizer.decode(shown[0].completion_ids)}", flush=True)  # fmt: skip
    losses = train(policy, shown, args.epochs, args.lr, args.batch, args.seed)
    policy.model.save_pretrained(out)
    policy.tokenizer.save_pretrained(out)
    print(json.dumps({"out": str(out), "episodes": len(shown), "first_loss": losses[0], "last_loss": losses[-1]}))


if __name__ == "__main__":
    main()
