"""A verifiers (0.4, v1 API) tool environment defined in the tests, run through
`--env verifiers:tests.vf_tools`: a sum to work out with a toolset's `add` tool (advertised as `calc_add`);
the rubric rewards the right answer and, a little, a tool result that holds it. A stateful tool counts the
calls in the trace's state, and a @vf.stop ends the rollout after `max_calls` of them."""

import re

import verifiers.v1 as vf
from verifiers.v1.types import content_text


class SumData(vf.TaskData):
    answer: int


class CalcState(vf.State):
    calls: int = 0


class CalcToolset(vf.Toolset[vf.ToolsetConfig, CalcState]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers and return the sum.

        Args:
            a: the first integer
            b: the second integer
        """
        self.state.calls += 1
        return str(a + b)


class SumTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()
    max_calls: int = 3


class SumTask(vf.Task[SumData, CalcState, SumTaskConfig]):
    @classmethod
    def toolsets(cls, config: SumTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.stop
    async def too_many_calls(self, trace: vf.Trace) -> bool:
        return trace.state.calls >= self.config.max_calls

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(found) and int(found[-1]) == self.data.answer)

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(content_text(m.content) == str(self.data.answer) for m in trace.tool_messages))


class SumTasksetConfig(vf.TasksetConfig):
    task: SumTaskConfig = SumTaskConfig()
    count: int = 16


class SumTaskset(vf.Taskset[SumTask, SumTasksetConfig]):
    def load(self):
        for n in range(self.config.count):
            a, b = 17 + 3 * n, 25 + 7 * n
            yield SumTask(SumData(prompt=f"What is {a} + {b}? Use the tool.", answer=a + b), self.config.task)


__all__ = ["SumTaskset"]
