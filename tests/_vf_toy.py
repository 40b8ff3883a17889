"""A tiny offline verifiers 0.4 taskset for tests/test_verifiers.py, loaded by its id ``_vf_toy``:
verifiers imports a taskset id as a top-level module that exports one ``Taskset`` subclass in
``__all__`` (so the tests put tests/ on sys.path).

Sums with a calculator: a stateful tool (``ToyState.calls``, which the tool writes and the stop
hook and a reward read), a stop hook that ends the episode after two calls, and a rubric of two
weighted rewards (the right sum: 1.0; the calculator used: 0.5) and a metric.
"""

import verifiers.v1 as vf


class ToyData(vf.TaskData):
    answer: str


class ToyState(vf.State):
    calls: int = 0


class Calculator(vf.Toolset[vf.ToolsetConfig, ToyState]):
    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        self.state.calls += 1
        return str(a + b)


class ToyTask(vf.Task[ToyData, ToyState, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list:
        return [Calculator(vf.ToolsetConfig())]

    @vf.stop
    async def out_of_calls(self, trace: vf.Trace) -> bool:
        return trace.state.calls >= 2

    @vf.reward(weight=1.0)
    async def correct(self, task: ToyData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def used_calculator(self, trace: vf.Trace) -> float:
        return float(trace.state.calls > 0)

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class ToyTaskset(vf.Taskset[ToyTask, vf.TasksetConfig]):
    def load(self):
        for a, b in ((2, 3), (10, 7), (40, 2)):
            data = ToyData(prompt=f"{a}+{b}", system_prompt="Add with the calculator.", answer=str(a + b))
            yield ToyTask(data, self.config.task)


__all__ = ["ToyTaskset"]
