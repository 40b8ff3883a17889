r"""The tools a run may use: the built-in ones by name (:data:`TOOLS`), and :func:`resolve_tools`,
which turns a configuration's entries into checked :class:`Tool`\ s before any model loads."""

import importlib
import inspect
from dataclasses import dataclass, field

# The built-in tools: name -> "module:function", imported when a configuration picks the name.
TOOLS = {
    "python": "grpo_fast.tools.python:python",
    "calculator": "grpo_fast.tools.calculator:calculator",
}


@dataclass(frozen=True)
class Tool:
    """One tool, ready to show to the model and to call.

    name:     the function's name, as the model calls it.
    function: the callable, sync or async (`is_async`), called with the model's keyword arguments.
    schema:   its JSON schema, {"type": "function", "function": {"name", "description", "parameters"}},
              as `transformers.utils.get_json_schema` builds it and `apply_chat_template(tools=...)` takes it.
    is_async: True for an `async def` (run on a shared event loop rather than a thread).
    max_concurrency: most calls of it running at once in this process, or None for no limit;
              read from the function's `max_concurrency` attribute (the python tool sets it to
              the CPU cores, one sandbox each).
    """

    name: str
    function: object = field(repr=False)
    schema: dict = field(repr=False)
    is_async: bool = False
    max_concurrency: int | None = None


def resolve_tools(tools) -> list[Tool]:
    """The `Tool`s of a configuration's entries, checked; raises before anything runs.

    tools: a list whose entries are built-in names (keys of `TOOLS`), "package.module:function"
           names, functions (sync or async,
           with a type hint on every argument and a docstring with an Args: section that
           describes each), or `Tool`s. None or [] gives [].
    Raises TypeError for an entry that is neither a name nor a function (a class, an instance,
    a functools.partial: wrap it in a def), ValueError for an unknown built-in name (listing the
    known ones), a function whose schema cannot be built (naming the function and the cause),
    or two tools of one name.
    """
    if tools is None:
        return []
    if isinstance(tools, (str, bytes)) or not hasattr(tools, "__iter__"):
        raise TypeError(f"tools must be a list of tool names or functions, got {tools!r}")
    resolved: list[Tool] = []
    for entry in tools:
        tool = entry if isinstance(entry, Tool) else _make_tool(_function_of(entry))
        clash = next((t for t in resolved if t.name == tool.name), None)
        if clash is not None:
            raise ValueError(
                f"tools: two tools are named {tool.name!r} ({clash.function!r} and {tool.function!r}); "
                "the model calls a tool by its name, so names must be unique"
            )
        resolved.append(tool)
    return resolved


def _function_of(entry):
    if isinstance(entry, str) and ":" in entry:  # package.module:function
        module, _, name = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"tools: {entry!r} cannot be imported: {exc}") from exc
    elif isinstance(entry, str):
        if entry not in TOOLS:
            raise ValueError(
                f"tools: unknown built-in tool {entry!r}; the built-in tools are: {', '.join(sorted(TOOLS))}"
            )
        module, name = TOOLS[entry].split(":")
        return getattr(importlib.import_module(module), name)
    if not (inspect.isfunction(entry) or inspect.ismethod(entry)):
        raise TypeError(
            f"tools: each entry must be a built-in tool name or a function (def or async def), got {entry!r} "
            f"of type {type(entry).__name__}; wrap other callables in a def with type hints and a docstring"
        )
    return entry


def _make_tool(function) -> Tool:
    from transformers.utils import get_json_schema  # here, not at import: transformers takes seconds

    name = getattr(function, "__name__", repr(function))
    try:
        schema = get_json_schema(function)
    except Exception as exc:  # DocstringParsingException, TypeHintParsingException, ...
        raise ValueError(
            f"tools: cannot build the JSON schema of tool {name!r}: {exc}. A tool needs a type hint on every "
            "argument and a Google-style docstring whose Args: section describes each argument"
        ) from exc
    limit = getattr(function, "max_concurrency", None)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"tools: {name}.max_concurrency must be a positive int or None, got {limit!r}")
    return Tool(
        name=schema["function"]["name"],
        function=function,
        schema=schema,
        is_async=inspect.iscoroutinefunction(function),
        max_concurrency=limit,
    )
