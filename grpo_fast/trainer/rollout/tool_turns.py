"""The tool loop of a multi-turn rollout: between two turns of the model, its tool calls run.

It sits inside the rollout stage, under the engine (``engines/``), which calls it whenever
every row of its batch has ended a turn:

    engine.generate(prompts, G, keys, turns=loop(N))       # loop = ToolLoop(template, config)
        turn 1 sampled (stops at EOS / a call's end) -> ToolTurns.suffixes: parse the calls,
        run them all at once (grpo_fast.tools.run_tool_calls), append the results as the chat
        template's suffix -> turn 2 sampled from the KV cache -> ... -> no call, or no room
    ToolTurns.trajectories(generation) -> each row's messages, for the rewards

Token in, token out: the model's tokens stay as sampled; only the suffixes are made, by the
template (``grpo_fast.tools.template``). The whole trajectory, tool tokens included, is one
completion under one ``max_new_tokens`` budget: a suffix that would leave no room is rolled
back and the trajectory ends there, as in TRL. ``completion_mask`` is 0 on the suffixes.
"""

import time

import torch

from grpo_fast.tools.calls import parse_tool_calls, run_tool_calls, truncate_middle
from grpo_fast.trainer.rollout.engines import Turns


class ToolLoop:
    """Makes each rollout's :class:`ToolTurns` (``loop(N)``) for ``template`` (a
    :class:`grpo_fast.tools.template.ToolTemplate`: the tokenizer and the tools) and the run's
    ``config`` (max_tool_calling_iterations, max_tool_response_tokens, tool_timeout_s), and adds
    up the seconds the tools took, for the log line."""

    def __init__(self, template, config):
        self.template, self.config, self.seconds = template, config, 0.0

    def __call__(self, num_rows: int) -> "ToolTurns":
        return ToolTurns(self, num_rows)

    def metrics(self) -> dict:
        """``tools/seconds``, the tools' wall time since the last read (then reset)."""
        seconds, self.seconds = self.seconds, 0.0
        return {"tools/seconds": seconds}


class ToolTurns(Turns):
    """One batch's tool loop (N = ``num_rows`` rows), made by its :class:`ToolLoop` per rollout
    and read after it (``trajectories``, ``counts``)."""

    def __init__(self, loop: ToolLoop, num_rows: int):
        self.loop, self.template, self.config = loop, loop.template, loop.config
        self.tokenizer = self.template.tokenizer
        self.tools = {tool.name: tool for tool in self.template.tools}
        self.stop_token_ids = list(self.template.end_of_turn_ids)
        self.messages = [[] for _ in range(num_rows)]  # the assistant and tool messages of each row
        self.calls = [0] * num_rows
        self.failures = [0] * num_rows
        self.turn_start = [0] * num_rows  # where each row's current turn starts in its completion

    def suffixes(self, rows: list, turns: list, room: list) -> list:
        parsed = [self._parse(turn) for turn in turns]
        limit = self.config.max_tool_calling_iterations
        asking = [
            i for i, (_, calls) in enumerate(parsed) if calls and (limit is None or self._turns_run(rows[i]) < limit)
        ]
        calls = [call for i in asking for call in parsed[i][1]]
        start = time.perf_counter()
        results = run_tool_calls(calls, self.tools, timeout_s=self.config.tool_timeout_s) if calls else []
        self.loop.seconds += time.perf_counter() - start
        out = [None] * len(rows)
        for i in asking:
            mine, results = results[: len(parsed[i][1])], results[len(parsed[i][1]) :]
            if self.config.max_tool_response_tokens is not None:
                cap = self.config.max_tool_response_tokens
                mine = [r._replace(content=truncate_middle(r.content, cap, self.tokenizer)) for r in mine]
            suffix = self.template.tool_suffix_ids(mine, completion_ids=turns[i])
            if len(suffix) >= room[i]:  # no room for the results and one more token: roll back, end
                continue
            row = rows[i]
            content, row_calls = parsed[i]
            self.messages[row].append(_assistant(content, row_calls))
            self.messages[row] += [{"role": "tool", "name": r.name, "content": r.content} for r in mine]
            self.calls[row] += len(mine)
            self.failures[row] += sum(r.failed for r in mine)
            self.turn_start[row] += len(turns[i]) + len(suffix)
            out[i] = suffix
        return out

    def trajectories(self, completion_ids: list) -> list:
        """Each row's messages, TRL's shape: its continued turns and their tool messages, then its
        last turn (the tokens after its last suffix), as an assistant message. ``completion_ids``
        [N] lists: each row's completion tokens (sampled and tools')."""
        for row, ids in enumerate(completion_ids):
            content, calls = self._parse(ids[self.turn_start[row] :])
            self.messages[row].append(_assistant(content, calls))
        return self.messages

    def counts(self) -> torch.Tensor:
        """[N, 3] float32: each row's tool calls, failed calls and turns (read after
        :meth:`trajectories`; the log line's tools/* metrics)."""
        turns = [sum(m["role"] == "assistant" for m in messages) for messages in self.messages]
        return torch.tensor(list(zip(self.calls, self.failures, turns)), dtype=torch.float32)

    def _parse(self, ids: list) -> tuple:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return parse_tool_calls(text, self.tokenizer, tools=self.template.schemas)

    def _turns_run(self, row: int) -> int:
        """The row's turns that were answered by tools so far."""
        return sum(m["role"] == "assistant" for m in self.messages[row])


def _assistant(content: str, calls: list) -> dict:
    """An assistant message with its tool calls in the chat templates' shape."""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": call.name, "arguments": call.arguments or {}}} for call in calls
        ]
    return message
