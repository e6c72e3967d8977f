"""A verifiers (0.4, v1 API) multi-turn environment defined in the tests, run through
`--env verifiers:tests.vf_guess`: guess a number, told "Higher." or "Lower." after each wrong guess by the
environment's own code (Env.run, a scripted user). Its tasks are built here; nothing is downloaded."""

import re

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    target: int


class GuessTask(vf.Task[GuessData]):
    @vf.reward
    async def solved(self, trace: vf.Trace) -> float:
        """1 for a game solved at the first guess, 0.1 less for each further guess."""
        return max(0.0, 1.1 - 0.1 * trace.num_turns) if _guess(trace.last_reply) == self.data.target else 0.0

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class GuessTasksetConfig(vf.TasksetConfig):
    high: int = 8


class GuessTaskset(vf.Taskset[GuessTask, GuessTasksetConfig]):
    def load(self):
        for target in range(1, self.config.high + 1):  # prompt None: the environment opens the conversation
            yield GuessTask(GuessData(prompt=None, system_prompt="Play a guessing game.", target=target))


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    max_guesses: int = 4


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        high = max(self.taskset_high, task.data.target)
        async with agents.agent.interaction(task) as game:
            segment = await game.turn(f"I picked a whole number from 1 to {high}. Guess it: reply with one number.")
            for _ in range(self.config.max_guesses - 1):
                guess = _guess(segment.last_reply)
                if segment.terminated or guess == task.data.target:
                    break
                hint = "No number found. Reply with one number." if guess is None else "Higher."
                segment = await game.turn(hint if guess is None or guess < task.data.target else "Lower.")

    taskset_high = 8


def _guess(text: str) -> int | None:
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


__all__ = ["GuessTaskset", "GuessEnv"]
