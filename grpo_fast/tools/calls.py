"""Parse the tool calls a model wrote, run them, and turn every outcome into the text it reads next.

Everything here faces text the policy wrote, which under optimisation pressure can be anything:
a malformed call, a tool it invented, arguments the function does not take, a call that never
returns. None of that may raise or stall a rollout. Each such outcome becomes the tool's answer,
`{"error": "..."}` as JSON text (the convention TRL's GRPOTrainer uses, so a model trained with
either reads the same thing), and is marked `failed` for the `tools/failure_frequency` metric.
Only the caller's own mistakes (a bad timeout, something that is not a ToolCall) raise.

Only the standard library is imported: the command line validates tools before torch loads.
"""

import inspect
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from grpo_fast.tools.concurrency import run_concurrently


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote.

    name:      the tool's name as written; None when the call had none (then `error` says so).
    arguments: keyword arguments, decoded from JSON; None when they could not be decoded.
    error:     why the call is unusable (malformed JSON, no name, arguments not an object), or
               None. run_tool_calls answers such a call with this error instead of running anything.
    """

    name: str | None
    arguments: dict | None
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """The answer to one call: what goes into the tool message.

    name:    the tool's name as the model wrote it ("unknown" when it wrote none).
    content: the text the model reads: the tool's result, or `{"error": "..."}` JSON.
    failed:  True when content is an error (counted by `tools/failure_frequency`).
    seconds: wall time of the call (the timeout for one that timed out; 0 for one never run).
    """

    name: str
    content: str
    failed: bool
    seconds: float


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(_HERMES_OPEN) + r"(.*?)" + re.escape(_HERMES_CLOSE), re.DOTALL)
# How much of a malformed call an error message quotes back to the model.
_QUOTE_CHARS = 200


def parse_tool_calls(
    text: str, tokenizer=None, *, prefix: str | list[int] = "", tools: list[dict] | None = None
) -> tuple[str, list[ToolCall]]:
    """Split one assistant turn into its plain content and the tool calls it makes.

    text:      the sampled turn, decoded WITHOUT skipping special tokens (tool-call markers such as
               `<tool_call>` are special tokens in some vocabularies).
    tokenizer: when it has a `response_template` (transformers >= 5.13), its own
               `parse_response` is used: the format is then whatever the model's template
               declares. Otherwise (or with None) the Hermes format of Qwen2.5/Qwen3 and many
               others: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, where
               "arguments" may also be a JSON string of an object (and "parameters" is taken
               for "arguments", as some models write).
    prefix:    for parse_response: the prompt the turn continues (text or ids), which some
               templates need to see (an opening `<think>` pre-written by the template). "" = none.
    tools:     for parse_response (transformers >= 5.15): the tools' JSON schemas, so that
               arguments are typed by them ("7" becomes 7 for an integer parameter).
    Returns (content, calls): content is the text outside the calls, stripped, without the
    tokenizer's end-of-sequence token; calls are in the order written. A call that cannot be
    used is a ToolCall with `error` set; this never raises for anything in `text`.

    A `<tool_call>` left open at the end of the turn counts as a call only when what follows it
    is a complete call (an engine that stopped at `</tool_call>` and dropped the stop string);
    otherwise the turn was cut short (length limit) and the fragment stays in the content.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_tool_calls: text must be the decoded turn as a str, got {type(text).__name__}")
    eos = getattr(tokenizer, "eos_token", None) if tokenizer is not None else None
    if tokenizer is not None and getattr(tokenizer, "response_template", None) is not None:
        return _parse_with_template(text, tokenizer, prefix, tools, eos)
    return _parse_hermes(text, eos)


def _parse_with_template(text: str, tokenizer, prefix, tools, eos) -> tuple[str, list[ToolCall]]:
    kwargs = {"prefix": prefix}
    # `tools=` (typed arguments) arrived in transformers 5.15; 5.13-5.14 would reject the keyword.
    if tools and "tools" in inspect.signature(tokenizer.parse_response).parameters:
        kwargs["tools"] = tools
    try:
        parsed = tokenizer.parse_response(text, **kwargs)
    except Exception as exc:  # the parser's JSON field failed: a malformed call, the model's doing
        content, calls = _parse_hermes(text, eos)
        if calls or _HERMES_OPEN in content:  # the Hermes reading says which call and why, or that
            return content, calls  # the turn was cut off inside its last call (no call, as below)
        reason = " ".join(str(exc).split())[:400]
        return _strip_eos(text, eos), [ToolCall(None, None, f"the tool call could not be parsed: {reason}")]
    if not isinstance(parsed, dict):
        return _strip_eos(text, eos), []
    content = parsed.get("content") if isinstance(parsed.get("content"), str) else ""
    calls = [_call_from_parsed(raw) for raw in parsed.get("tool_calls") or []]
    return _strip_eos(content, eos), calls


def _call_from_parsed(raw) -> ToolCall:
    """One entry of parse_response's `tool_calls`: {"type": "function", "function": {"name", "arguments"}}."""
    if not isinstance(raw, dict):
        return ToolCall(None, None, f"the tool call must be a JSON object, got {_quote(raw)}")
    if raw.get("type", "function") != "function":
        return ToolCall(None, None, f"unsupported tool call type {raw.get('type')!r}; only 'function' is supported")
    function = raw.get("function")
    if not isinstance(function, dict):
        return ToolCall(
            None, None, f'the tool call must be a JSON object with "name" and "arguments", got {_quote(function)}'
        )
    return _call_from_fields(function.get("name"), function.get("arguments"))


def _parse_hermes(text: str, eos: str | None) -> tuple[str, list[ToolCall]]:
    calls, pieces, end = [], [], 0
    for match in _HERMES_BLOCK.finditer(text):
        pieces.append(text[end : match.start()])
        calls.append(_call_from_json(match.group(1)))
        end = match.end()
    rest = text[end:]
    opened = rest.find(_HERMES_OPEN)
    if opened >= 0:
        body = _strip_eos(rest[opened + len(_HERMES_OPEN) :], eos)
        call = _call_from_json(body)
        if call.error is None:  # a complete call whose closing tag the engine dropped
            calls.append(call)
            rest = rest[:opened]
    pieces.append(rest)
    return _strip_eos("".join(pieces), eos), calls


def _call_from_json(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
        return ToolCall(None, None, f"the tool call is not valid JSON ({exc}): {_quote(body.strip())}")
    if not isinstance(obj, dict):
        return ToolCall(
            None, None, f'the tool call must be a JSON object with "name" and "arguments", got {_quote(obj)}'
        )
    arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    return _call_from_fields(obj.get("name"), arguments)


def _call_from_fields(name, arguments) -> ToolCall:
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, f'the tool call has no "name" (a non-empty string), got {_quote(name)}')
    if arguments is None:
        return ToolCall(name, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string of an object
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            return ToolCall(name, None, f"the arguments of {name!r} are not valid JSON ({exc}): {_quote(arguments)}")
    if not isinstance(arguments, dict):
        return ToolCall(name, None, f"the arguments of {name!r} must be a JSON object, got {_quote(arguments)}")
    return ToolCall(name, arguments)


def _strip_eos(text: str, eos: str | None) -> str:
    text = text.strip()
    if eos and text.endswith(eos):
        text = text[: -len(eos)].rstrip()
    return text


def _quote(value) -> str:
    try:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
    except (ValueError, RecursionError):
        text = f"a {type(value).__name__} nested too deeply to show"
    return repr(text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "...")


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def error_text(message: str) -> str:
    """The `{"error": message}` JSON text a failed call answers with."""
    return json.dumps({"error": message}, ensure_ascii=False)


def run_tool_calls(
    calls: Iterable[ToolCall],
    tools,
    *,
    timeout_s: float = 10.0,
    max_workers: int | None = None,
    tables: list | None = None,
) -> list[ToolResult]:
    """Run a batch of calls in parallel; one ToolResult per call, in the same order. Never raises for the calls.

    calls:       ToolCalls (from parse_tool_calls), of one turn or of many rollouts together.
    tools:       {name: Tool} (or an iterable of Tool), as resolve_tools makes them.
    timeout_s:   wall-clock seconds one call may take from its start. A sync function cannot be
                 interrupted: past its deadline its thread is abandoned (a daemon thread, it
                 neither blocks the batch nor the interpreter's exit, but keeps running until the
                 function returns, and its answer is dropped). An async call is cancelled.
    max_workers: calls running at once (threads); default: every call of the batch at once, up
                 to 32. A tool with `max_concurrency` (the python tool: one sandbox per core) is
                 further held to that many running calls in the whole process; a call waiting
                 for one of its slots fails once none has freed up for 2 * timeout_s (hung calls).
    tables:      instead of `tools`, one {name: Tool} per call (None for `tools`): each
                 episode's own tools, bound to its environment (`tools` is then ignored).
    A result is the tool's return value as text (a str as is, anything else as JSON, or str()
    when it is not JSON-serialisable), or `{"error": ...}` with failed=True for: a malformed call,
    a tool name the model invented (the error lists the tools), arguments the function does not
    accept, an exception in the tool, a timeout.
    """
    calls = list(calls)
    if tables is not None and len(tables) != len(calls):
        raise ValueError(f"run_tool_calls: tables must give one table per call ({len(calls)}), got {len(tables)}")
    table = _tool_table(tools) if tables is None else None
    for call in calls:
        if not isinstance(call, ToolCall):
            raise TypeError(f"run_tool_calls: calls must be ToolCall objects (see parse_tool_calls), got {call!r}")

    results: list[ToolResult | None] = [None] * len(calls)
    jobs, indices = [], []  # the calls that really run: (tool, arguments), and their places
    for i, call in enumerate(calls):
        name = call.name if call.name is not None else "unknown"
        mine = table if tables is None else _tool_table(tables[i])
        refusal = _refusal(call, mine)
        if refusal is not None:
            results[i] = ToolResult(name, error_text(refusal), True, 0.0)
        else:
            jobs.append((mine[call.name], call.arguments))
            indices.append(i)
    outcomes = run_concurrently(jobs, timeout_s=timeout_s, max_workers=max_workers)
    for i, (tool, _), outcome in zip(indices, jobs, outcomes):
        content = None if outcome.error is not None else _as_text(outcome.value)
        if content is None:
            content = error_text(f"tool {tool.name!r} {outcome.error or 'returned a value that cannot be shown'}")
        results[i] = ToolResult(calls[i].name, content, outcome.error is not None, outcome.seconds)
    return results


def _tool_table(tools) -> dict:
    if isinstance(tools, Mapping):
        return dict(tools)
    try:
        return {tool.name: tool for tool in tools}
    except (TypeError, AttributeError):
        raise TypeError(
            f"run_tool_calls: tools must be a dict {{name: Tool}} or a list of Tool (see resolve_tools), got {tools!r}"
        ) from None


def _refusal(call: ToolCall, table: dict) -> str | None:
    """Why the call cannot run at all (checked before any thread starts), or None."""
    if call.error is not None:
        return call.error
    if call.name not in table:
        known = ", ".join(sorted(table)) or "(none)"
        return f"unknown tool {call.name!r}; the available tools are: {known}"
    function = table[call.name].function
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # no signature to check against: let the call itself tell
        return None
    try:
        signature.bind(**call.arguments)
    except TypeError as exc:
        return f"tool {call.name!r} does not accept these arguments ({exc}); its parameters are {signature}"
    return None


def _as_text(value) -> str | None:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        pass
    try:
        return str(value)
    except Exception:  # a __str__ that raises: the call reads as failed
        return None


# --------------------------------------------------------------------------------------------
# Truncation
# --------------------------------------------------------------------------------------------


def truncate_middle(text: str, max_tokens: int, tokenizer) -> str:
    """`text` cut in the middle to `max_tokens` tokens, keeping its head and tail, or `text` if it fits.

    A tool's output can be longer than the room left in a completion; its beginning (what ran)
    and end (the result, the traceback's last line) matter most. The cut is marked with
    `\\n[... N tokens cut ...]\\n`. Tokens are counted with `tokenizer` (no special tokens added).
    The result encodes to at most `max_tokens` tokens plus the marker's own (the pieces are
    re-encoded and shrunk until they fit, since a token boundary can re-merge differently).
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"truncate_middle: max_tokens must be a positive int, got {max_tokens!r}")
    if not isinstance(text, str):
        raise TypeError(f"truncate_middle: text must be a str, got {type(text).__name__}")

    def count(piece: str) -> int:
        return len(tokenizer.encode(piece, add_special_tokens=False))

    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    spans = _char_spans(tokenizer, text, len(ids))
    keep = max_tokens
    while True:
        head_n = (keep + 1) // 2
        tail_n = keep - head_n
        if spans is not None:  # cut at character offsets: no half-decoded multi-byte character
            head = text[: spans[head_n - 1][1]] if head_n else ""
            tail = text[spans[len(ids) - tail_n][0] :] if tail_n else ""
        else:
            head = tokenizer.decode(ids[:head_n]) if head_n else ""
            tail = tokenizer.decode(ids[len(ids) - tail_n :]) if tail_n else ""
        marker = f"\n[... {len(ids) - head_n - tail_n} tokens cut ...]\n"
        result = head + marker + tail
        overflow = count(result) - count(marker) - max_tokens
        if overflow <= 0 or keep == 0:
            return result
        keep = max(0, keep - overflow)


def _char_spans(tokenizer, text: str, n_ids: int) -> list[tuple[int, int]] | None:
    """Each token's (start, end) character offsets in `text`, from a fast tokenizer; else None."""
    try:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except Exception:  # a slow tokenizer has no offsets: decode the pieces instead
        return None
    return [tuple(span) for span in offsets] if len(offsets) == n_ids else None


__all__ = ["ToolCall", "ToolResult", "parse_tool_calls", "run_tool_calls", "truncate_middle", "error_text"]
