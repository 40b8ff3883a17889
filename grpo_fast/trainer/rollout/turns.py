"""The turn loop of a multi-turn rollout: between two of the model's turns, its tool calls run
and its environment answers.

It sits inside the rollout stage, under the engine (``engines/``), which calls it whenever
every row of its batch has ended a turn:

    loop = TurnLoop(template, config, environment)     # one per run (trainer, worker, evaluation)
    episodes = loop(rows, G)                           # a batch: a fresh environment per episode
    engine.generate(episodes.prompts or the rows' prompts, G, keys, turns=episodes)
        turn 1 sampled (stops at EOS / the end of turn) -> Episodes.suffixes: its tool calls run
        all at once (grpo_fast.tools.run_tool_calls), or its environment steps (every episode's
        at once, grpo_fast.tools.run_concurrently), and their messages are appended as the chat
        template's suffix -> turn 2 sampled from the KV cache -> ... -> done, max_turns, no room
    episodes.trajectories(ids) -> each row's messages, for the rewards (episodes.columns(): what
        else they read: tool counts, the environments, their rewards)

Token in, token out: the model's tokens stay as sampled; only the suffixes are made, by the
template (``grpo_fast.tools.template``). The whole trajectory, tool and environment tokens
included, is one completion under one ``max_new_tokens`` budget: a suffix that would leave no
room is rolled back and the trajectory ends there, as in TRL. ``completion_mask`` is 0 on the
suffixes. An environment that raises, times out or answers out of protocol ends its episode
with reward 0, counted (``env/errors``) and logged; the batch goes on.
"""

import collections
import copy
import inspect
import logging
import time

import torch

from grpo_fast.environments.protocol import EnvStep, as_messages
from grpo_fast.tools import ChatTemplate, Tool, ToolTemplate, parse_tool_calls, run_concurrently, run_tool_calls
from grpo_fast.tools.calls import truncate_middle
from grpo_fast.trainer.rollout.engines import Turns
from grpo_fast.trainer.sections import ToolConfig

logger = logging.getLogger("grpo_fast")


def turn_loop(tokenizer, tools: list, environment, config) -> "TurnLoop | None":
    """The run's turn loop, for its resolved ``tools`` and ``environment`` (an
    EnvironmentFactory, or None); None without either. Checks the tokenizer's chat template
    (ValueError naming the cause): with tools, the run's and the environment's, a ToolTemplate."""
    if not tools and environment is None:
        return None
    every = [*tools, *(environment.tools if environment is not None else [])]
    template = ToolTemplate(tokenizer, every) if every else ChatTemplate(tokenizer)
    options = dict(system_prompt=config.system_prompt, pass_threshold=config.eval_pass_threshold)
    return TurnLoop(template, config.tooling, environment, **options)


class TurnLoop:
    """Makes each rollout's :class:`Episodes` (``loop(rows, G)``) for ``template`` (its tools: the
    run's and the environment's), the run's ``tooling`` section (the turns' and results' limits,
    the timeouts) and ``environment`` (an EnvironmentFactory, or None: tools alone), and adds up
    the seconds the tools and the environments took, for the log line. ``system_prompt`` starts
    an environment's episodes that have none; an episode succeeds when its reward reaches
    ``pass_threshold`` (the run's eval_pass_threshold)."""

    def __init__(
        self, template, tooling: ToolConfig, environment=None, *, system_prompt=None, pass_threshold: float = 1.0
    ):
        self.template, self.tooling, self.environment = template, tooling, environment
        self.system_prompt, self.pass_threshold = system_prompt, pass_threshold
        env_tools = {tool.name for tool in environment.tools} if environment else set()
        self.tools = {tool.name: tool for tool in template.tools if tool.name not in env_tools}  # the run's own
        self.tool_seconds = self.env_seconds = 0.0

    def __call__(self, rows: list, group_size: int) -> "Episodes":
        return Episodes(self, rows, group_size)

    def columns(self) -> dict:
        """What the rewards get from an episode besides the dataset's columns (``Episodes.columns``),
        for one empty episode: the names and the kind of value, to check reward functions by."""
        out = {"tool_calls": [0], "tool_failures": [0]} if self.template.tools else {}
        if self.environment is not None:
            out.update(environments=[None], environment_reward=[0.0])
        return out

    def copy(self) -> "TurnLoop":
        """The same loop with its own seconds (the evaluation's are not the training step's)."""
        loop = copy.copy(self)
        loop.tool_seconds = loop.env_seconds = 0.0
        return loop

    def metrics(self) -> dict:
        """The tools' and environments' wall time since the last read (then reset)."""
        out = {"tools/seconds": self.tool_seconds} if self.template.tools else {}
        if self.environment is not None:
            out["env/seconds"] = self.env_seconds
        self.tool_seconds = self.env_seconds = 0.0
        return out


class Episodes(Turns):
    """One batch's turns: N = len(rows) * G episodes, those of a row adjacent. Made by its
    :class:`TurnLoop` per rollout; read after it (``trajectories``, ``columns``, ``counts``).

    ``prompts``: with an environment, each row's prompt text from its episodes' ``reset`` (every
    episode of a row must start alike); None: the rows' own prompts."""

    def __init__(self, loop: TurnLoop, rows: list, group_size: int):
        self.loop, self.template, self.tooling = loop, loop.template, loop.tooling
        self.tokenizer = self.template.tokenizer
        self.stop_token_ids = list(self.template.end_of_turn_ids)
        N = len(rows) * group_size
        self.messages = [[] for _ in range(N)]  # the assistant and observation messages of each row
        self.calls, self.failures, self.tool_turns = [0] * N, [0] * N, [0] * N
        self.turns, self.errors = [0] * N, [0] * N  # the model's turns; environment errors (0 or 1)
        self.turn_start = [0] * N  # where each row's current turn starts in its completion
        self.stepped = [False] * N  # the environment has answered the row's last turn
        self.rewards: list = [None] * N  # each episode's reward (the sum of its steps')
        self.failed: list = []  # (row, error) of the episodes that failed, until reported
        self.envs = self.prompts = None
        self.tables = [loop.tools] * N
        factory = loop.environment
        if factory is not None:
            self.envs = [factory() for _ in range(N)]
            self.tables = [{**loop.tools, **factory.episode_tools(env)} for env in self.envs]
            self.prompts = self._reset(rows, group_size)

    # ------------------------------------------------------------------ the engine's side
    def suffixes(self, rows: list, turns: list, room: list) -> list:
        parsed = [self._parse(turn) for turn in turns]  # (assistant message, its tool calls)
        limit, max_turns = self.tooling.max_tool_calling_iterations, self.tooling.max_turns
        last = [max_turns is not None and self.turns[row] + 1 >= max_turns for row in rows]  # no answer follows
        calling = [
            i
            for i, (row, (_, calls)) in enumerate(zip(rows, parsed))
            if calls and not last[i] and self._going(row) and (limit is None or self.tool_turns[row] < limit)
        ]
        answers = [None] * len(rows)  # each row's observations, or None: its episode ends
        results = dict(zip(calling, self._run_calls([rows[i] for i in calling], [parsed[i][1] for i in calling])))
        for i, (observations, _) in results.items():
            answers[i] = observations
        if self.envs is not None:
            stepping = [i for i in range(len(rows)) if i not in results and self._going(rows[i])]
            for i, step in zip(stepping, self._step([rows[i] for i in stepping], [parsed[i][0] for i in stepping])):
                answers[i] = None if step.done else step.observations
        out = [None] * len(rows)
        for i, (row, turn) in enumerate(zip(rows, turns)):
            self.turns[row] += 1
            if answers[i] is None or last[i]:
                continue
            observations = self._truncated(answers[i])
            suffix = self.template.suffix_ids(observations, completion_ids=turn)
            if len(suffix) >= room[i]:  # no room for the answer and one more token: roll back, end
                continue
            if i in results:  # the calls count once their answers are in the trajectory
                self.tool_turns[row] += 1
                self.calls[row] += len(results[i][1])
                self.failures[row] += sum(r.failed for r in results[i][1])
            self.messages[row] += [parsed[i][0], *observations]
            self.turn_start[row] += len(turn) + len(suffix)
            self.stepped[row] = False  # its next turn is the environment's to see
            out[i] = suffix
        return out

    # ------------------------------------------------------------------ after the rollout
    def trajectories(self, completion_ids: list) -> list:
        """Each row's messages, TRL's shape: its continued turns and what answered them, then its
        last turn (the tokens after its last suffix), as an assistant message. An environment not
        yet shown the last turn (the budget ran out in it) steps it now, for its reward.
        ``completion_ids`` [N] lists: each row's completion tokens (sampled and appended)."""
        last = [self._parse(ids[self.turn_start[row] :])[0] for row, ids in enumerate(completion_ids)]
        if self.envs is not None:
            pending = [row for row in range(len(last)) if not self.stepped[row] and self._going(row)]
            self._step(pending, [last[row] for row in pending])
        for row, message in enumerate(last):
            self.messages[row].append(message)
        return self.messages

    def columns(self) -> dict:
        """What the reward functions get besides the dataset's columns: ``tool_calls`` and
        ``tool_failures`` (with tools), ``environments`` (what each episode exposes: TRL's
        instances) and ``environment_reward`` (each episode's reward) with an environment."""
        out = {}
        if self.template.tools:
            out.update(tool_calls=list(self.calls), tool_failures=list(self.failures))
        if self.envs is not None:
            out.update(environments=[env.state for env in self.envs], environment_reward=list(self.rewards))
        return out

    def counts(self) -> tuple:
        """``(tool_counts [N, 3] (calls, failed calls, turns) or None without tools, env_counts
        [N, 4] (turns, errors, successes, scored) or None without an environment)``, float32 (the
        log line's tools/* and env/* metrics): an episode succeeds when its reward reaches
        the loop's pass_threshold."""
        assistant = [sum(m["role"] == "assistant" for m in messages) for messages in self.messages]
        tools = envs = None
        if self.template.tools:
            tools = torch.tensor(list(zip(self.calls, self.failures, assistant)), dtype=torch.float32)
        if self.envs is not None:
            threshold = self.loop.pass_threshold
            scored = [r is not None for r in self.rewards]
            success = [r is not None and r >= threshold for r in self.rewards]
            envs = torch.tensor(list(zip(assistant, self.errors, success, scored)), dtype=torch.float32)
        return tools, envs

    # ------------------------------------------------------------------ the pieces
    def _going(self, row: int) -> bool:
        """Whether the row's episode may still act (its environment has not failed)."""
        return not self.errors[row]

    def _parse(self, ids: list) -> tuple:
        """A turn's tokens as ``(assistant message, its ToolCalls)``; no calls without tools."""
        if not self.template.tools:
            return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}, []
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        content, calls = parse_tool_calls(text, self.tokenizer, tools=self.template.schemas)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": call.name, "arguments": call.arguments or {}}}
                for call in calls
            ]
        return message, calls

    def _run_calls(self, rows: list, calls: list) -> list:
        """``(tool messages, ToolResults)`` answering each row's ``calls`` (every call of the batch
        at once)."""
        flat = [call for mine in calls for call in mine]
        tables = [self.tables[row] for row, mine in zip(rows, calls) for _ in mine]
        start = time.perf_counter()
        results = run_tool_calls(flat, {}, timeout_s=self.tooling.tool_timeout_s, tables=tables) if flat else []
        self.loop.tool_seconds += time.perf_counter() - start
        out = []
        for mine in calls:
            answered, results = results[: len(mine)], results[len(mine) :]
            out.append(([{"role": "tool", "name": r.name, "content": r.content} for r in answered], answered))
        return out

    def _truncated(self, observations: list) -> list:
        cap = self.tooling.max_tool_response_tokens
        if cap is None:
            return observations
        return [{**m, "content": truncate_middle(m["content"], cap, self.tokenizer)} for m in observations]

    def _call_environments(self, method: str, rows: list, arguments: list) -> list:
        """``env.<method>(**arguments)`` of each row's environment, all at once; the value of
        each, or None where it failed (the episode is then ended and its error counted)."""
        jobs = []
        for row, kwargs in zip(rows, arguments):
            function = getattr(self.envs[row], method)
            name = f"{self.loop.environment.name}.{method}"
            jobs.append((Tool(name, function, {}, is_async=inspect.iscoroutinefunction(function)), kwargs))
        start = time.perf_counter()
        outcomes = run_concurrently(jobs, timeout_s=self.tooling.environment_timeout_s) if jobs else []
        self.loop.env_seconds += time.perf_counter() - start
        values = []
        for row, (tool, _), outcome in zip(rows, jobs, outcomes):
            if outcome.error is not None:
                self._fail(row, f"{tool.name} {outcome.error}")
            values.append(outcome.value if outcome.error is None else None)
        return values

    def _reset(self, rows: list, group_size: int) -> list:
        """Each row's prompt text from its episodes' first messages (the system prompt first)."""
        N = len(self.envs)
        episodes = list(range(N))
        starts = self._call_environments("reset", episodes, [{"row": rows[e // group_size]} for e in episodes])
        prompts = []
        for r, row in enumerate(rows):
            first = None
            for e in range(r * group_size, (r + 1) * group_size):
                if self.errors[e]:
                    continue
                try:
                    messages = as_messages(starts[e], f"{self.loop.environment.name}.reset")
                except TypeError as exc:
                    self._fail(e, str(exc))
                    continue
                if first is not None and messages != first:
                    raise ValueError(
                        f"environment {self.loop.environment.name}: the episodes of one row started from different "
                        f"messages ({first!r} and {messages!r}); GRPO compares a group's answers to one prompt, so "
                        "reset(row) must give every episode of a row the same messages"
                    )
                first = messages
            if first is None:  # every episode of the row failed: they end at their first turn
                first = as_messages(row.get("prompt") or "", "the row's prompt")
            system = self.loop.system_prompt
            if system is not None and first[0]["role"] != "system":
                first = [{"role": "system", "content": system}, *first]
            prompts.append(self.template.prompt_text(first))
        self._report()
        return prompts

    def _step(self, rows: list, messages: list) -> list:
        """Each row's environment's :class:`EnvStep` for its turn ``message`` (all at once; a
        failed one reads as done). Adds the rewards, marks the rows stepped."""
        where = f"{self.loop.environment.name}.step" if self.envs else ""
        values = self._call_environments("step", rows, [{"message": m} for m in messages])
        steps = []
        for row, value in zip(rows, values):
            self.stepped[row] = True
            step = None
            if not self.errors[row]:
                try:
                    step = EnvStep.of(value, where)
                except TypeError as exc:
                    self._fail(row, str(exc))
            if step is None:
                steps.append(EnvStep([], True, None))
                continue
            if step.reward is not None:
                self.rewards[row] = (self.rewards[row] or 0.0) + step.reward
            steps.append(step)
        self._report()
        return steps

    def _fail(self, row: int, error: str) -> None:
        """The row's environment failed: its episode ends with reward 0, counted (and logged by
        :meth:`_report`)."""
        self.errors[row], self.rewards[row] = 1, 0.0
        self.failed.append((row, error))

    def _report(self) -> None:
        """One log line for the episodes that failed since the last: how many, and each
        distinct error (the first three) with its count."""
        if self.failed:
            errors = collections.Counter(error for _, error in self.failed)
            said = "; ".join(f"{error} ({n}x)" for error, n in list(errors.items())[:3])
            logger.warning("%d environment episode(s) ended with reward 0: %s", len(self.failed), said)
            self.failed = []
