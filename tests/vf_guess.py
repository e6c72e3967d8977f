"""A verifiers (0.1.x) environment defined in the tests, run through `--env verifiers:tests.vf_guess`: guess a
number, told "higher" or "lower" after each wrong guess. Its dataset is built here; nothing is downloaded.
`variant` builds the kinds echo-rl refuses: "tools" (a tool-calling environment), "group" (a group reward)."""

import re

import verifiers as vf
from datasets import Dataset


class GuessNumberEnv(vf.MultiTurnEnv):
    """Each turn the model guesses; the environment answers "higher" or "lower" until a guess is right."""

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        guess = _guess(messages[-1]["content"] or "")
        target = int(state["answer"])
        if guess == target:  # final_env_response ends the rollout (verifiers' way to stop after a reply)
            state["solved"] = True
            state["final_env_response"] = [vf.UserMessage(content="Correct!")]
            return state["final_env_response"]
        hint = "No number found. Reply with one number." if guess is None else "Higher." if guess < target else "Lower."
        return [vf.UserMessage(content=hint)]


def _guess(text: str) -> int | None:
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


def solved_reward(state: vf.State, **kwargs) -> float:
    """1 for a solved game in one turn, 0.1 less for each further turn."""
    return max(0.0, 1.1 - 0.1 * len(state["trajectory"])) if state.get("solved") else 0.0


def rank_reward(states: list[vf.State], **kwargs) -> list[float]:
    """A group reward (plural parameters): the fewer turns among the group, the better."""
    return [-float(len(s["trajectory"])) for s in states]


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def load_environment(high: int = 8, max_turns: int = 4, variant: str = "") -> vf.Environment:
    """Targets 1..high, one per dataset row."""
    rows = [
        {"question": f"I picked a whole number from 1 to {high}. Guess it: reply with one number.", "answer": str(n)}
        for n in range(1, high + 1)
    ]
    if variant == "tools":
        return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], rubric=vf.Rubric(funcs=[solved_reward]))
    funcs = [solved_reward, rank_reward] if variant == "group" else [solved_reward]
    return GuessNumberEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=funcs), max_turns=max_turns)
