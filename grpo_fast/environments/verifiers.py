"""verifiers 0.4 tasksets as environments: ``verifiers:<taskset id>``, or a ``Taskset`` object
through :func:`verifiers_factory`, runs in our turn loop, scored by its tasks' own rubric.

verifiers 0.4 (``import verifiers.v1 as vf``) is a rewrite: ``MultiTurnEnv``, ``env_response``,
``is_completed`` and ``Rubric`` are gone. A taskset yields tasks (``TaskData``: a prompt, a
system prompt, the task's own fields); a task brings its tools (``Toolset`` s of ``@vf.tool``
methods, each an MCP server), its stop hooks (``@vf.stop``) and its rubric (weighted
``@vf.reward`` s and ``@vf.metric`` s), which ``task.score(trace)`` runs over the episode's
``Trace``. verifiers itself runs the model inside an agent program (a harness) in a sandbox and
serves it over HTTP; here our turn loop is the harness, and everything else is verifiers' own::

    verifiers 0.4                                  here
    Taskset.load() -> Task(TaskData)               rows {"prompt", "verifiers_task": the TaskData}
                                                   (verifiers_rows); each episode rebuilds its Task
                                                   from its row, as verifiers' env server does
    the harness's first request: system + prompt   reset(row): the same messages
    the toolsets' tools, named <server>_<tool>,    tools(): the same names and schemas, each call
    over MCP; State synced with trace.state         run by the toolset's MCP server in process, its
                                                   State synced with the episode's trace.state
    @vf.stop (Trace) before each model call        after reset and after each tool call
    the harness ends at a reply without calls      step: the episode ends there
    task.score(trace): sum of reward x weight      step's reward (the environment_reward column);
                                                   reward functions read the traces (environments=)

What differs, because nothing runs outside this process:
  - No runtime (sandbox): a taskset whose tasks need a container is refused; rewards that need a
    runtime are skipped (a warning names them), as ``task.score(trace)`` without one does;
    ``setup`` and ``finalize`` get ``runtime=None``.
  - The environment sees each tool call, not the assistant message around it: the trace holds
    one assistant turn per call (its text, if any, is the completion's, not the trace's), and a
    stop that fires after one call of a turn refuses the turn's later calls.
  - A stop hook that fires after a tool call cannot take the model's next turn back: that turn
    and any later ones are outside verifiers' episode (their tool calls are refused), and the
    rubric scores the trace as it stood at the stop.
  - Refused with a ValueError: a taskset package that exports its own ``Env`` (whose ``run()``
    plays user turns: textarena, user simulators), ``@vf.intercept`` hooks and stop hooks on a
    ``Request`` or ``Response``, which read the model's HTTP traffic.
"""

import asyncio
import contextvars
import functools
import inspect
import json
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

from grpo_fast.environments.protocol import Environment, EnvStep, as_messages
from grpo_fast.tools.registry import Tool

logger = logging.getLogger("grpo_fast")

PREFIX = "verifiers:"
TASK_COLUMN = "verifiers_task"  # a row's TaskData, as JSON
UNBOUNDED_ROWS = 10_000  # rows drawn from an infinite taskset, unless a limit is given
INSTALL = "pip install 'grpo-fast[verifiers]' (verifiers==0.4.0)"

# The episode whose tool call is running, for its toolsets' State (see _connect_state).
_episode: contextvars.ContextVar = contextvars.ContextVar("verifiers_episode")


def is_verifiers(spec) -> bool:
    """Whether ``spec`` (a dataset or environment name) names a verifiers taskset."""
    return isinstance(spec, str) and spec.startswith(PREFIX)


def taskset_of(spec):
    """The ``vf.Taskset`` that ``spec`` names (``verifiers:<taskset id>`` or the bare id, built
    with the taskset's own config type) or is; ImportError naming the extra without verifiers."""
    vf = _verifiers()
    if isinstance(spec, vf.Taskset):
        return spec
    taskset_id = spec.removeprefix(PREFIX) if isinstance(spec, str) else None
    if not taskset_id:
        raise ValueError(f"verifiers: give a taskset id (verifiers:<taskset id>) or a vf.Taskset, got {spec!r}")
    return vf.load_taskset(vf.taskset_config_type(taskset_id)(id=taskset_id))


def verifiers_rows(spec, limit: int | None = None) -> list:
    """Rows ``{"prompt": messages, "verifiers_task": the TaskData as JSON}``, one per task of the
    taskset ``spec`` (see :func:`taskset_of`) in its order: its first ``limit`` tasks, every task
    of a finite taskset by default, UNBOUNDED_ROWS of an infinite one."""
    taskset = taskset_of(spec)
    if limit is not None or not taskset.bounded:
        taskset = taskset.take(UNBOUNDED_ROWS if limit is None else limit)
    # the TaskData without its defaults: validated back, the same data
    rows = [
        {"prompt": _chat_messages(task.data), TASK_COLUMN: task.data.model_dump(mode="json", exclude_defaults=True)}
        for task in taskset
    ]
    if not rows:
        raise ValueError(f"verifiers taskset {type(taskset).__name__} gave no task")
    return rows


def verifiers_factory(spec) -> "VerifiersFactory":
    """The environment factory of the taskset ``spec`` (see :func:`taskset_of`): give it as a
    trainer's ``environment``, or name ``verifiers:<taskset id>``."""
    return VerifiersFactory(taskset_of(spec))


class VerifiersTool(Tool):
    """A toolset's tool, bound to one episode, with the name and JSON schema that verifiers shows
    the model. A :class:`Tool` (the factory's probe keeps the schema) that is also the episode's
    function (``EnvironmentFactory.episode_tools`` binds it by ``__name__``, the loop calls it)."""

    @property
    def __name__(self) -> str:
        return self.name

    def __call__(self, **arguments):
        return self.function(**arguments)


class VerifiersFactory:
    """Makes one :class:`VerifiersEnvironment` per episode of ``taskset`` (``factory()``).

    Made once a run (a rollout worker makes its own: it pickles as its taskset), it checks on the
    taskset's first task that its episodes can run here (ValueError naming what cannot), serves
    the taskset's shared toolsets, and reads every tool's name and schema.

    Attributes:
        taskset: the ``vf.Taskset``.
        task_type, data_type: its Task and TaskData classes (a row's task is rebuilt from them).
        schemas: ``{tool name: JSON schema}``, the shared toolsets' tools and a task's.
        shared: ``{tool name: (MCP server, its tool name)}`` of the shared toolsets, one
            instance each for every episode of this process.
    """

    def __init__(self, taskset):
        self.taskset = taskset
        self.task_type = type(taskset).task_type()
        self.data_type = self.task_type.data_type()
        probe = next(iter(taskset.take(1)), None)
        if probe is None:
            raise ValueError(f"verifiers taskset {type(taskset).__name__} gave no task")
        _check_runs_here(taskset, probe)
        self.shared_toolsets = type(taskset).toolsets(taskset.config)
        self.shared, schemas = _blocking(_serve(self.shared_toolsets))
        _, own = _blocking(_serve(self.task_type.toolsets(probe.config)))
        if schemas.keys() & own.keys():
            raise ValueError(f"verifiers: tools {sorted(schemas.keys() & own.keys())} are both shared and a task's")
        self.schemas = {**schemas, **own}
        self._shared_setup = None  # the shared toolsets' setup, started by the first reset

    def __call__(self) -> "VerifiersEnvironment":
        return VerifiersEnvironment(self)

    def __reduce__(self):
        return verifiers_factory, (self.taskset,)

    async def set_up_shared(self) -> None:
        """The shared toolsets' ``setup()``, once (on the event loop every episode's calls share)."""
        if not self.shared_toolsets:
            return
        if self._shared_setup is None:
            self._shared_setup = asyncio.ensure_future(_set_up(self.shared_toolsets))
        await asyncio.shield(self._shared_setup)


class VerifiersEnvironment(Environment):
    """One episode of a verifiers task (see the module's docstring for the mapping).

    Attributes:
        task: the episode's ``vf.Task``, rebuilt from its row by :meth:`reset`.
        trace: its ``vf.Trace``: the messages, the State its tools and hooks share, and after the
            last step the rubric's ``rewards`` and ``metrics``; what reward functions read.
    """

    def __init__(self, factory: VerifiersFactory):
        self.factory = factory
        self.task = self.trace = None
        self.toolsets: list = []  # the task's own toolsets, served for this episode alone
        self.routes: dict = {}  # tool name -> (MCP server, its tool name)

    async def reset(self, row: dict) -> list:
        """The task's system prompt and prompt; serves and sets up its toolsets, runs its setup."""
        from verifiers.v1.state import state_cls
        from verifiers.v1.utils.decorators import invoke

        vf, factory = _verifiers(), self.factory
        if TASK_COLUMN not in row:
            raise ValueError(
                f"a verifiers task's row has a {TASK_COLUMN!r} column: verifiers_rows (verifiers:<id>) makes them"
            )
        data = factory.data_type.model_validate(row[TASK_COLUMN])
        self.task = factory.task_type(data, factory.taskset.config.task)
        trace_task = vf.TraceTask(type=factory.task_type.__name__, data=data, key=self.task.key, hash=self.task.hash)
        state = state_cls(factory.task_type)()
        self.trace = vf.Trace(task=trace_task, state=state, agent=vf.AgentInfo(config=vf.AgentConfig()))
        messages = _task_messages(data)
        for message in messages:
            self._record(message)
        self.toolsets = factory.task_type.toolsets(self.task.config)
        self.routes = {**factory.shared, **(await _serve(self.toolsets))[0]}
        await factory.set_up_shared()
        await _set_up(self.toolsets, data)
        await invoke(self.task.setup, {"trace": self.trace, "runtime": None})
        await self._check_stops()
        return _chat_messages(data)

    def tools(self) -> list:
        return [
            VerifiersTool(name, functools.partial(self.call, name), schema, is_async=True)
            for name, schema in self.factory.schemas.items()
        ]

    async def call(self, name: str, **arguments) -> str:
        """Runs the tool ``name`` through its toolset's MCP server (which checks the arguments and
        words the result as verifiers' harness shows it); records the call and its result in the
        trace, then checks the stop hooks. Raises for a failed call (its error recorded)."""
        vf = _verifiers()
        from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content

        if self.trace.stop_condition is not None:
            raise RuntimeError(f"the episode is over ({self.trace.stop_condition}); answer without calling a tool")
        server, tool_name = self.routes[name]
        token, error = _episode.set(self), None
        try:
            content = mcp_content_to_chat_content((await server.call_tool(tool_name, arguments)).content)
        except Exception as exc:  # the tool's error, or the MCP server's on its arguments
            content, error = str(exc), exc
        finally:
            _episode.reset(token)
        call = vf.ToolCall(id=f"call_{len(self.trace.nodes)}", name=name, arguments=json.dumps(arguments))
        self._record(vf.AssistantMessage(content=None, tool_calls=[call]), sampled=True)
        self._record(vf.ToolMessage(tool_call_id=call.id, name=name, content=content))
        await self._check_stops()
        if error is not None:
            raise error
        return content

    async def step(self, message: dict) -> EnvStep:
        """A turn without a tool call ends the episode (verifiers' harness ends there): the turn
        joins the trace unless a stop hook ended it before, the task finalizes, and its rubric
        scores the trace; the reward is the sum of its rewards times their weights."""
        from verifiers.v1.utils.decorators import invoke

        if self.trace.stop_condition is None:
            reply = self._assistant(message)
            self._record(reply, sampled=True)
            if reply.tool_calls:  # calls left unanswered: our loop's turn limit ended the episode
                self.trace.stop("max_turns")
        await invoke(self.task.finalize, {"trace": self.trace, "runtime": None})
        await self.task.score(self.trace)
        self.trace.is_completed = self.trace.ok = True
        for toolset in self.toolsets:
            await toolset._exit_stack.aclose()  # what its setup entered (verifiers closes it as the server stops)
        return EnvStep([], True, self.trace.reward)

    @property
    def state(self):
        """What reward functions read of the episode (``environments=``): its ``vf.Trace``."""
        return self.trace

    def _record(self, message, sampled: bool = False) -> None:
        nodes, parent = self.trace.nodes, len(self.trace.nodes) - 1 if self.trace.nodes else None
        nodes.append(_verifiers().MessageNode(message=message, parent=parent, sampled=sampled))

    def _assistant(self, message: dict):
        """Our loop's assistant message as verifiers' (its tool calls with ids, arguments as JSON)."""
        from verifiers.v1.dialects import parse_message

        calls = [
            {
                "id": f"call_{len(self.trace.nodes)}_{i}",
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": json.dumps(call["function"]["arguments"])},
            }
            for i, call in enumerate(message.get("tool_calls") or [])
        ]
        return parse_message({"role": "assistant", "content": message["content"], "tool_calls": calls})

    async def _check_stops(self) -> None:
        """verifiers checks the stop hooks before each model call; here after reset and after each
        tool call. The first to fire stops the trace: what follows is outside its episode."""
        from verifiers.v1.session import call_hook

        Trace = _verifiers().Trace
        for stop in self.task.hooks("stop"):
            if self.trace.stop_condition is None and await call_hook(stop, {Trace: self.trace}):
                self.trace.stop(stop.__name__)


def _verifiers():
    """``verifiers.v1``, imported on first use (it takes seconds); ImportError naming the extra."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(f"verifiers environments need verifiers 0.4: {INSTALL}") from exc
    return vf


def _task_messages(data) -> list:
    """A task's first messages as verifiers' types: its system prompt, then its prompt."""
    vf = _verifiers()
    if data.prompt is None:
        raise ValueError(
            f"verifiers task {data.idx}: no prompt (its user opens the conversation: an Env's run() plays it)"
        )
    messages = [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt)
    if data.system_prompt is not None:
        messages.insert(0, vf.SystemMessage(content=data.system_prompt))
    return messages


def _chat_messages(data) -> list:
    """:func:`_task_messages` as chat dicts (TypeError for content that is not text)."""
    from verifiers.v1.dialects.chat import message_to_wire

    return as_messages([message_to_wire(m) for m in _task_messages(data)], f"verifiers task {data.idx}'s prompt")


def _check_runs_here(taskset, task) -> None:
    """ValueError naming what of ``taskset`` (its first ``task`` read) our loop cannot run; a
    warning naming the rewards that need a runtime (skipped, as verifiers' offline scoring does)."""
    from verifiers.v1.session import hook_boundary
    from verifiers.v1.utils.decorators import discover_decorated

    vf = _verifiers()
    module = sys.modules[type(taskset).__module__]
    exported = [getattr(module, name, None) for name in getattr(module, "__all__", ())]
    envs = [obj.__name__ for obj in exported if isinstance(obj, type) and issubclass(obj, vf.Env)]
    hooks = [fn.__name__ for fn in discover_decorated(task, "intercept")]
    hooks += [fn.__name__ for fn in task.hooks("stop") if hook_boundary(fn, allow_trace=True) is not vf.Trace]
    data_type = type(task.data)
    excluded = [name for name, field in data_type.model_fields.items() if field.exclude]
    problems = []
    if envs:
        problems.append(f"its package exports an Env ({envs[0]}) whose run() plays the conversation")
    if type(task).NEEDS_CONTAINER or task.data.image:
        problems.append("its tasks run in a container")
    if hooks:
        problems.append(f"its hooks {hooks} read the model's requests or responses")
    if excluded:
        problems.append(f"{data_type.__name__} excludes {excluded} from serialization (a row carries the task whole)")
    rewards = task.hooks("reward")
    offline = [fn for fn in rewards if not _needs_runtime(fn)]
    if not offline and not task.config.judges:
        problems.append("no reward of its rubric runs without a runtime" if rewards else "its rubric has no reward")
    if problems:
        raise ValueError(f"verifiers taskset {type(taskset).__name__} cannot run in this loop: {'; '.join(problems)}")
    if len(offline) < len(rewards):
        skipped = sorted({fn.__name__ for fn in rewards} - {fn.__name__ for fn in offline})
        logger.warning("verifiers taskset %s: rewards %s need a runtime: skipped", type(taskset).__name__, skipped)


def _needs_runtime(fn) -> bool:
    """Whether a hook takes a ``runtime`` without a default (verifiers' rule in ``Task.score``)."""
    parameter = inspect.signature(fn).parameters.get("runtime")
    return parameter is not None and parameter.default is inspect.Parameter.empty


async def _serve(toolsets: list) -> tuple:
    """``({tool name: (MCP server, its tool name)}, {tool name: JSON schema})``: each toolset
    served in process by an MCP server of its own, each tool named and described as verifiers'
    harness shows it the model."""
    from mcp.server.mcpserver import MCPServer

    routes, schemas = {}, {}
    for toolset in toolsets:
        server = MCPServer(toolset.server_name or type(toolset).__name__)
        toolset.register(server)
        _connect_state(toolset)
        for tool in await server.list_tools():
            name = f"{toolset.server_name}_{tool.name}" if toolset.server_name else tool.name
            if name in routes:
                raise ValueError(f"verifiers: two tools are named {name!r}; give a toolset a distinct TOOL_PREFIX")
            routes[name] = (server, tool.name)
            function = {"name": name, "description": tool.description or "", "parameters": tool.input_schema}
            schemas[name] = {"type": "function", "function": function}
    return routes, schemas


def _connect_state(toolset) -> None:
    """verifiers syncs a toolset's State with ``trace.state`` around each tool call, over HTTP
    (pull, call, push); here the running call's episode (``_episode``) is read and written."""
    from verifiers.v1.state import state_cls

    own = state_cls(type(toolset))

    async def pull():
        return own.model_validate_json(_episode.get().trace.state.model_dump_json())

    async def push(before):
        trace = _episode.get().trace
        trace.state = type(trace.state).model_validate_json(toolset.state.model_dump_json())

    toolset._pull_state, toolset._push_state = pull, push


async def _set_up(toolsets: list, data=None) -> None:
    """Each toolset's ``setup()``, then, for a task's own (``data`` given), ``setup_task(data)``."""
    for toolset in toolsets:
        await toolset.setup()
        if data is not None:
            await toolset.setup_task(data)


def _blocking(coroutine):
    """Runs ``coroutine`` to its end from sync code, under a running event loop (a notebook's) too."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
