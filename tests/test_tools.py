"""grpo_fast.tools: resolving tools, parsing and running calls, the built-in tools, the chat-template side.

No download: the tokenizer (one token a byte), its Hermes-style (Qwen2.5-like) tool-calling chat
template and response template are tests/_hermes.py's; the broken templates below are made from it.
"""

import asyncio
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time

import pytest
from _hermes import RESPONSE_TEMPLATE, hermes_template, make_tokenizer

from grpo_fast.tools import (
    TOOLS,
    Tool,
    ToolCall,
    ToolResult,
    ToolTemplate,
    parse_tool_calls,
    resolve_tools,
    run_tool_calls,
    truncate_middle,
)
from grpo_fast.tools.calculator import calculator

# Drops the content of every assistant turn but the last message: not prefix-preserving.
REWRITING_TEMPLATE = hermes_template(assistant_content="(m.content if loop.last else '') or ''")
# Plain ChatML: knows nothing of tools.
PLAIN_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Renders the tools in the prompt and tool results, but not the assistant's calls.
CALL_DROPPING_TEMPLATE = hermes_template(assistant_content="m.content", tool_calls="[]")


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def boom(reason: str) -> str:
    """Always fail.

    Args:
        reason: What to say.
    """
    raise ValueError(f"it broke: {reason}")


def sleep(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


async def async_sleep(seconds: float) -> dict:
    """Sleep on the event loop.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return {"slept": seconds}


def one_at_a_time(seconds: float) -> str:
    """Sleep, one call at a time.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "ok"


one_at_a_time.max_concurrency = 1


def table(*functions):
    return {tool.name: tool for tool in resolve_tools(list(functions))}


# --------------------------------------------------------------------------------------------
# resolve_tools
# --------------------------------------------------------------------------------------------


def test_importing_the_package_loads_neither_torch_nor_transformers():
    code = "import sys, grpo_fast.tools; assert not {'torch', 'transformers'} & set(sys.modules), sys.modules.keys()"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_builtin_schemas():
    python, calc = resolve_tools(["python", "calculator"])
    assert set(TOOLS) == {"python", "calculator"}
    assert (python.name, calc.name) == ("python", "calculator")
    assert python.schema["function"]["parameters"]["properties"]["code"]["type"] == "string"
    assert python.schema["function"]["parameters"]["required"] == ["code"]
    assert calc.schema["function"]["parameters"]["required"] == ["expression"]
    assert python.schema["function"]["description"] and calc.schema["function"]["description"]
    assert python.max_concurrency >= 1 and calc.max_concurrency is None
    assert not python.is_async and resolve_tools([async_sleep])[0].is_async
    assert resolve_tools(None) == [] and resolve_tools([python]) == [python]


def no_docstring(x: int) -> int:
    return x


def untyped(x):
    """Untyped.

    Args:
        x: a value.
    """
    return x


class Callable:
    def __call__(self, x: int) -> int:
        """Call.

        Args:
            x: a value.
        """
        return x


@pytest.mark.parametrize(
    "entry, error, words",
    [
        (42, TypeError, ["42", "int"]),
        (Callable(), TypeError, ["Callable", "wrap"]),
        (Callable, TypeError, ["Callable"]),
        (functools.partial(add, 1), TypeError, ["partial"]),
        (no_docstring, ValueError, ["'no_docstring'", "docstring"]),
        (untyped, ValueError, ["'untyped'", "type hint"]),
        (lambda x: x, ValueError, ["'<lambda>'"]),
        ("shell", ValueError, ["'shell'", "calculator, python"]),
    ],
)
def test_resolve_tools_refuses(entry, error, words):
    with pytest.raises(error) as info:
        resolve_tools([entry])
    for word in words:
        assert word in str(info.value)


def test_resolve_tools_refuses_duplicates_and_a_bare_string():
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        resolve_tools([add, add])
    with pytest.raises(TypeError, match="list"):
        resolve_tools("python")


# --------------------------------------------------------------------------------------------
# parse_tool_calls
# --------------------------------------------------------------------------------------------


def test_parse_hermes_calls():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2**10\\"}"}</tool_call><|im_end|>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute.\n\n<|im_end|>"  # without a tokenizer, no end-of-sequence token is known
    assert calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("calculator", {"expression": "2**10"})]
    content, calls = parse_tool_calls(text, make_tokenizer())
    assert content == "Let me compute." and len(calls) == 2  # the tokenizer's eos is taken off


def test_parse_plain_text_and_parameters_alias():
    assert parse_tool_calls("The answer is 4.") == ("The answer is 4.", [])
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "parameters": {"a": 1, "b": 2}}</tool_call>')
    assert calls == [ToolCall("add", {"a": 1, "b": 2})]
    _, calls = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')
    assert calls == [ToolCall("now", {})]


@pytest.mark.parametrize(
    "body, words",
    [
        ('{"name": "add", "arguments": {"a": 1', ["not valid JSON"]),
        ('{"arguments": {"a": 1}}', ['no "name"']),
        ('{"name": 3, "arguments": {}}', ['no "name"']),
        ("[1, 2]", ["JSON object"]),
        ('{"name": "add", "arguments": [1, 2]}', ["'add'", "JSON object"]),
        ('{"name": "add", "arguments": "{bad"}', ["'add'", "not valid JSON"]),
        ("[" * 100_000, ["not valid JSON"]),
        ('{"name": "add", "arguments": ' + "[" * 900 + "]" * 900 + "}", ["JSON object"]),
    ],
)
def test_parse_malformed_hermes_calls_are_errors_not_exceptions(body, words):
    content, calls = parse_tool_calls(f"Try.<tool_call>{body}</tool_call>")
    assert content == "Try." and len(calls) == 1 and calls[0].error is not None
    for word in words:
        assert word in calls[0].error


def test_parse_unclosed_call():
    # The engine stopped at "</tool_call>" and dropped it: a complete call is still a call.
    content, calls = parse_tool_calls('Run it.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n')
    assert content == "Run it." and calls == [ToolCall("add", {"a": 1, "b": 2})]
    # Cut off by the length limit: no call, the fragment stays in the content.
    content, calls = parse_tool_calls('Run it.\n<tool_call>\n{"name": "add", "argu')
    assert calls == [] and content.endswith('"argu')


def test_parse_with_the_tokenizers_response_template():
    tok = make_tokenizer()
    tok.response_template = RESPONSE_TEMPLATE
    text = 'I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
    content, calls = parse_tool_calls(text, tok)
    assert content == "I will add." and calls == [ToolCall("add", {"a": 1, "b": 2})]
    # Typed by the schemas (transformers >= 5.15): "2" stays a string only for a string parameter.
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', tok)
    assert calls == [ToolCall("add", {"a": 1})]
    # Malformed JSON: parse_response raises; the call becomes an error, the turn is not lost.
    content, calls = parse_tool_calls('Hm.<tool_call>{"name": "add", "arguments": {</tool_call><|im_end|>', tok)
    assert content == "Hm." and len(calls) == 1 and "not valid JSON" in calls[0].error
    assert parse_tool_calls("Just text.<|im_end|>", tok) == ("Just text.", [])
    assert parse_tool_calls('Cut.<tool_call>{"name": "ad', tok) == ('Cut.<tool_call>{"name": "ad', [])


# --------------------------------------------------------------------------------------------
# run_tool_calls
# --------------------------------------------------------------------------------------------


def test_run_success_and_every_failure_is_an_answer():
    calls = [
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("boom", {"reason": "no"}),
        ToolCall("search", {"q": "x"}),
        ToolCall("add", {"a": 1}),
        ToolCall("add", {"a": 1, "b": 2, "c": 3}),
        ToolCall(None, None, "the tool call is not valid JSON"),
        ToolCall("async_sleep", {"seconds": 0.01}),
    ]
    results = run_tool_calls(calls, table(add, boom, async_sleep))
    assert [r.name for r in results] == ["add", "boom", "search", "add", "add", "unknown", "async_sleep"]
    assert [r.failed for r in results] == [False, True, True, True, True, True, False]
    assert results[0].content == "5" and results[6].content == '{"slept": 0.01}'
    errors = [json.loads(r.content)["error"] for r in results if r.failed]
    assert "ValueError: it broke: no" in errors[0] and "'boom'" in errors[0]
    assert "unknown tool 'search'" in errors[1] and "add, async_sleep, boom" in errors[1]
    assert "'add' does not accept" in errors[2] and "missing" in errors[2] and "(a: int, b: int)" in errors[2]
    assert "unexpected keyword" in errors[3]
    assert errors[4] == "the tool call is not valid JSON"


def test_run_result_types():
    def values(kind: str):
        """Return a value.

        Args:
            kind: which.
        """
        return {"str": "plain", "dict": {"x": [1, 2]}, "none": None, "set": {1}}[kind]

    tools = table(values)
    results = run_tool_calls([ToolCall("values", {"kind": k}) for k in ("str", "dict", "none", "set")], tools)
    assert [r.content for r in results] == ["plain", '{"x": [1, 2]}', "null", "{1}"]


def test_run_timeout_abandons_a_hung_call():
    start = time.monotonic()
    results = run_tool_calls(
        [ToolCall("sleep", {"seconds": 30}), ToolCall("sleep", {"seconds": 0.01})], table(sleep), timeout_s=0.3
    )
    assert time.monotonic() - start < 1.0
    assert results[0].failed and json.loads(results[0].content) == {"error": "tool 'sleep' timed out after 0.3s"}
    assert results[1] == ToolResult("sleep", "slept 0.01", False, results[1].seconds)
    results = run_tool_calls([ToolCall("async_sleep", {"seconds": 30})], table(async_sleep), timeout_s=0.2)
    assert results[0].failed and "timed out after 0.2s" in results[0].content


def test_run_in_parallel_and_within_max_concurrency():
    start = time.monotonic()
    results = run_tool_calls(
        [ToolCall("sleep", {"seconds": 0.5})] * 2 + [ToolCall("async_sleep", {"seconds": 0.5})] * 2,
        table(sleep, async_sleep),
    )
    assert time.monotonic() - start < 0.9 and not any(r.failed for r in results)

    start = time.monotonic()
    results = run_tool_calls([ToolCall("one_at_a_time", {"seconds": 0.2})] * 3, table(one_at_a_time))
    assert time.monotonic() - start >= 0.6 and [r.content for r in results] == ["ok"] * 3


def test_a_hung_call_holding_the_only_slot_does_not_hang_the_batch():
    start = time.monotonic()
    first, second = run_tool_calls([ToolCall("one_at_a_time", {"seconds": 3})] * 2, table(one_at_a_time), timeout_s=0.2)
    assert time.monotonic() - start < 1.0
    assert "timed out after 0.2s" in first.content and "waiting for a free slot" in second.content


def test_run_refuses_bad_settings():
    with pytest.raises(ValueError, match="timeout_s"):
        run_tool_calls([], {}, timeout_s=0)
    with pytest.raises(ValueError, match="max_workers"):
        run_tool_calls([], {}, max_workers=0)
    with pytest.raises(TypeError, match="ToolCall"):
        run_tool_calls([{"name": "add"}], table(add))


def test_truncate_middle(tokenizer):
    text = "".join(f"line {i}: print('hello world')\n" for i in range(200)) + "ünïcödé ending"
    assert truncate_middle("short", 50, tokenizer) == "short"
    cut = truncate_middle(text, 40, tokenizer)
    head, marker, tail = cut.partition("\n[... ")
    marker = "\n[... " + tail[: tail.index("...]\n") + 5]
    assert head.startswith("line 0:") and cut.endswith("ünïcödé ending") and "tokens cut" in marker
    count = lambda s: len(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    assert count(cut) <= 40 + count(marker)
    assert f"[... {count(text) - 40} tokens cut ...]" in cut
    with pytest.raises(ValueError, match="max_tokens"):
        truncate_middle(text, 0, tokenizer)


# --------------------------------------------------------------------------------------------
# The built-in tools
# --------------------------------------------------------------------------------------------


def test_calculator_exact():
    assert calculator("2**200 + 1") == str(2**200 + 1)
    assert calculator("(17 * 23 - 4) ** 2") == str((17 * 23 - 4) ** 2)
    assert calculator("0.1 + 0.2") == "0.3" and calculator("7 / 2") == "3.5" and calculator("-7 // 2") == "-4"
    assert calculator("1 / 3") == "1/3 (about 0.3333333333)" and calculator("-(3 - 10) % 4") == "3"
    assert calculator("2 ** -2") == "0.25" and calculator("1e3 * 2") == "2000" and calculator("10 / 5") == "2"


@pytest.mark.parametrize(
    "expression, error, words",
    [
        ("9**9**9", ValueError, ["bits"]),
        ("10**5000", ValueError, ["bits"]),
        ("1 / 0", ZeroDivisionError, ["division by zero"]),
        ("5 % (2 - 2)", ZeroDivisionError, ["division by zero"]),
        ("__import__('os').system('ls')", ValueError, ["not allowed"]),
        ("x + 1", ValueError, ["'x' is not allowed"]),
        ("2 ** 0.5", ValueError, ["whole exponents"]),
        ("1 +", ValueError, ["not an arithmetic expression"]),
        ("1e100000", ValueError, ["exponent"]),
        ("-" * 1500 + "1", ValueError, ["nested too deeply"]),
        ("-" * 201 + "1", ValueError, ["nested too deeply", "200 levels"]),
    ],
)
def test_calculator_errors(expression, error, words):
    # The depth bound must not hang on the process's recursion limit, which torch's inductor
    # raises to 2000 once anything in the session compiles: run under a higher one.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(5000)
    start = time.monotonic()
    try:
        with pytest.raises(error) as info:
            calculator(expression)
    finally:
        sys.setrecursionlimit(limit)
    assert time.monotonic() - start < 1.0
    for word in words:
        assert word in str(info.value)


def test_calculator_errors_reach_the_model_as_answers():
    (result,) = run_tool_calls([ToolCall("calculator", {"expression": "9**9**9"})], table(calculator))
    assert result.failed and "more than" in json.loads(result.content)["error"]


def test_python_tool(monkeypatch):
    import grpo_fast.tools.python as python_tool

    monkeypatch.setattr(python_tool, "LIMITS", dataclasses.replace(python_tool.LIMITS, wall_time_s=1.0))
    python = python_tool.python
    assert python("print(6 * 7)") == "42"
    answer = python("x = 1\nprint('before')\nprint(x / 0)")
    assert answer.startswith("before\nstderr:\nTraceback") and "ZeroDivisionError: division by zero" in answer
    assert "_boot.py" not in answer and 'File "<string>", line 3' in answer
    assert python("x = 1") == "(no output)"
    start = time.monotonic()
    assert "timed out after 1s" in python("while True: pass")
    assert time.monotonic() - start < 5
    flood = python("while True: print('spam' * 100)")
    assert flood.startswith("spam") and "characters cut" in flood and len(flood) < 2 * python_tool.OUTPUT_CHARS
    assert python(123).startswith("error: the argument code must be a string")
    # A batch runs in parallel through run_tool_calls, each call in its own sandbox; nothing is shared.
    calls = [ToolCall("python", {"code": f"import time; time.sleep(0.3); print({i})"}) for i in range(2)]
    calls.append(ToolCall("python", {"code": "print(x)"}))
    start = time.monotonic()
    results = run_tool_calls(calls, {t.name: t for t in resolve_tools(["python"])})
    assert [r.content for r in results[:2]] == ["0", "1"] and "NameError" in results[2].content
    assert not any(r.failed for r in results) and time.monotonic() - start < 3.0


# --------------------------------------------------------------------------------------------
# The chat template
# --------------------------------------------------------------------------------------------


def assistant_text(content, calls):
    """The assistant turn exactly as _hermes.CHAT_TEMPLATE renders it, ending with its end-of-turn token."""
    blocks = [f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>' for n, a in calls]
    return content + ("\n" if content and blocks else "") + "\n".join(blocks) + "<|im_end|>"


def test_template_properties(tokenizer):
    template = ToolTemplate(tokenizer, resolve_tools(["python", "calculator"]))
    assert template.end_of_turn_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert template.stop_strings == ["</tool_call>"]
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    ids = template.prompt_ids(messages)
    text = tokenizer.decode(ids)
    assert '"name": "python"' in text and '"name": "calculator"' in text and text.endswith("<|im_start|>assistant\n")
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert ToolTemplate(tokenizer, ["calculator"]).tools[0].name == "calculator"


def test_suffix_ids_give_the_template_rendering_token_for_token(tokenizer):
    """prompt + sampled turn + suffix == the whole conversation as the template renders it, for 1 and 2 calls."""
    template = ToolTemplate(tokenizer, resolve_tools(["python", "calculator"]))
    user = [{"role": "user", "content": "What is 6 * 7? Then square it."}]
    prompt = template.prompt_ids(user)
    turns = [
        ("Let me compute.", [("python", {"code": "print(6 * 7)"})], ["42"]),
        ("", [("calculator", {"expression": "42**2"}), ("python", {"code": "print(42**2)"})], ["1764", "1764\n"]),
    ]
    ids, messages = list(prompt), list(user)
    for content, calls, outputs in turns:
        sampled = tokenizer.encode(assistant_text(content, calls), add_special_tokens=False)
        results = [ToolResult(name, out, False, 0.0) for (name, _), out in zip(calls, outputs)]
        ids += sampled + template.tool_suffix_ids(results, sampled)
        tool_calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
        messages.append({"role": "assistant", "content": content, "tool_calls": tool_calls})
        messages += [{"role": "tool", "name": r.name, "content": r.content} for r in results]
        whole = tokenizer.apply_chat_template(
            messages, tools=template.schemas, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert ids == list(whole)
    # The suffix starts with what the template renders after the model's <|im_end|>: "\n".
    suffix = template.tool_suffix_ids(["42"])
    assert tokenizer.decode(suffix).startswith("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>")
    assert tokenizer.decode(suffix).endswith("<|im_start|>assistant\n")


def test_suffix_after_a_turn_stopped_at_the_stop_string(tokenizer):
    # An engine that stopped at "</tool_call>": the turn lacks <|im_end|>, so the suffix brings it.
    template = ToolTemplate(tokenizer, resolve_tools(["python"]))
    full_turn = tokenizer.encode(assistant_text("", [("python", {"code": "print(1)"})]), add_special_tokens=False)
    stopped = full_turn[:-1]
    assert tokenizer.decode(stopped).endswith("</tool_call>")
    assert stopped + template.tool_suffix_ids(["1"], stopped) == full_turn + template.tool_suffix_ids(["1"], full_turn)


@pytest.mark.parametrize(
    "chat_template, words",
    [
        (PLAIN_TEMPLATE, ["does not support tools", "'python'"]),
        (CALL_DROPPING_TEMPLATE, ["tool_calls"]),
        (REWRITING_TEMPLATE, ["not prefix-preserving", "rewrites earlier turns", "Let me check."]),
    ],
    ids=["no-tools", "drops-calls", "rewrites-turns"],
)
def test_template_refusals(chat_template, words):
    with pytest.raises(ValueError) as info:
        ToolTemplate(make_tokenizer(chat_template), resolve_tools(["python"]))
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    "name, special",
    [
        ("qwen2_5", []),
        ("qwen3_training", []),
        ("llama3_1", ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>", "<|eom_id|>"]),
    ],
)
def test_real_templates(name, special):
    """Real models' templates, as TRL ships them: the suffix made from the dummy exchange continues a real one."""
    trl = pytest.importorskip("trl")
    path = os.path.join(os.path.dirname(trl.__file__), "chat_templates", f"{name}.jinja")
    tok = make_tokenizer(open(path, encoding="utf-8").read(), special)
    template = ToolTemplate(tok, resolve_tools(["python", "calculator"]))
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}}
    user = [{"role": "user", "content": "What is 6 * 7?"}]
    turn = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    answer = [{"role": "tool", "name": "calculator", "content": "42"}]

    def render(messages, generation_prompt):
        ids = tok.apply_chat_template(
            messages, tools=template.schemas, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
        )
        return list(ids)

    prompt, with_turn = template.prompt_ids(user), render(user + turn, False)
    assert with_turn[: len(prompt)] == prompt
    # The model samples up to and including its end-of-turn token; the template's rest is the suffix's.
    end = len(with_turn) - with_turn[::-1].index(template.end_of_turn_ids[0])
    sampled = with_turn[len(prompt) : end]
    results = [ToolResult("calculator", "42", False, 0.0)]
    assert prompt + sampled + template.tool_suffix_ids(results, sampled) == render(user + turn + answer, True)


def test_template_refuses_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match="at least one tool"):
        ToolTemplate(tokenizer, [])
    template = ToolTemplate(tokenizer, resolve_tools(["python"]))
    with pytest.raises(ValueError, match="non-empty list"):
        template.tool_suffix_ids("42")
    with pytest.raises(TypeError, match="messages"):
        template.prompt_ids("What is 6 * 7?")


def test_tool_dataclass_is_frozen():
    tool = resolve_tools([add])[0]
    assert isinstance(tool, Tool)
    with pytest.raises(AttributeError):
        tool.name = "other"
