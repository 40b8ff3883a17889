"""Tools the model may call during a rollout (ToRL / ReTool-style multi-turn GRPO).

A tool is a plain Python function (sync or async) with type hints and a Google-style docstring,
from which `transformers.utils.get_json_schema` builds the JSON schema the chat template shows the
model. `resolve_tools` (registry.py) turns a configuration's entries (built-in names from `TOOLS`, or callables)
into `Tool`s and refuses a bad one before any model loads. Then, per turn:

    content, calls = parse_tool_calls(text, tokenizer)            # calls.py
    results = run_tool_calls(calls, {t.name: t for t in tools})   # calls.py, in parallel
    ids += template.tool_suffix_ids(results, completion_ids)      # template.py, token-in/out

Importing this package loads neither torch nor transformers: the command line validates a
configuration before torch loads. The built-in tools are imported only when picked.
"""

from grpo_fast.tools.calls import (
    ToolCall,
    ToolResult,
    error_text,
    parse_tool_calls,
    run_tool_calls,
    truncate_middle,
)
from grpo_fast.tools.concurrency import Outcome, run_concurrently
from grpo_fast.tools.registry import TOOLS, Tool, resolve_tools
from grpo_fast.tools.template import ChatTemplate, ToolTemplate

__all__ = [
    "TOOLS",
    "ChatTemplate",
    "Outcome",
    "Tool",
    "ToolCall",
    "ToolResult",
    "ToolTemplate",
    "error_text",
    "parse_tool_calls",
    "resolve_tools",
    "run_concurrently",
    "run_tool_calls",
    "truncate_middle",
]
