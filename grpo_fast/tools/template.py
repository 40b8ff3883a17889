"""The chat-template side of tool calling, token-in / token-out.

A multi-turn rollout is one token sequence that is never re-tokenised:

    prompt_ids | turn 1 (sampled) | suffix 1 (tool results) | turn 2 (sampled) | suffix 2 | ...

The sampled tokens are the model's, exactly as the engine produced them (their log-probs are
the ones the loss uses); only the suffixes are made here, from the chat template, as the
difference between a dummy conversation rendered with and without the tool messages. That is
sound only when the template is prefix-preserving (rendering more messages never changes how
earlier ones render), which `ToolTemplate` checks before anything runs, along with the template
rendering tools at all.

Where the model's turn ends and the suffix begins: the model's turn ends with the template's
end-of-turn token (`end_of_turn_ids`, e.g. Qwen's `<|im_end|>`; the engine stops there, the model
is trained to emit it). Whatever the template renders after that token belongs to the suffix
(Qwen's `\\n` after `<|im_end|>`, then the tool turn, then the next generation prompt), since the
model never samples it. When the engine stopped earlier, at a stop string such as `</tool_call>`,
the turn lacks its end token: `tool_suffix_ids(results, completion_ids)` then starts the suffix
with it.
"""

from grpo_fast.tools.calls import ToolResult
from grpo_fast.tools.registry import Tool, resolve_tools

# Placeholders that the checks look for in the rendered text; unlikely in any real template.
_ARG_KEY, _ARG_VALUE, _RESULT = "arg_key_5c1e", "arg_value_9d2f", "tool_result_7a3b"
_DUMMY_USER = "Hello."
_DUMMY_CONTENT = "Let me check."


class ToolTemplate:
    """A tokenizer's chat template, checked for tool calling, and the token ids a tool loop needs.

    tokenizer: a transformers tokenizer whose `chat_template` renders tools (apply_chat_template(tools=...)).
    tools:     the `Tool`s (from resolve_tools; other entries are resolved) shown in every prompt.
    chat_template_kwargs: extra variables for the template (e.g. {"enable_thinking": False}).

    Raises ValueError, naming the cause, when the template does not render the tools, tool
    calls or tool messages, or is not prefix-preserving.

    Attributes:
    schemas:         the tools' JSON schemas, as the template receives them.
    end_of_turn_ids: the token(s) that end an assistant turn and that the model samples (e.g.
                     [id of <|im_end|>]); engines must stop on them. [] when the template ends a
                     turn with no special token.
    stop_strings:    the text that closes a tool call (e.g. ["</tool_call>"]), for engines that
                     stop a turn at its first call; [] when a call is closed by the end of turn.
    """

    def __init__(self, tokenizer, tools, *, chat_template_kwargs: dict | None = None):
        tools = list(tools)
        if not tools:
            raise ValueError("ToolTemplate: tools must name at least one tool")
        if not all(isinstance(t, Tool) for t in tools):
            tools = resolve_tools(tools)
        self.tokenizer = tokenizer
        self.tools = tools
        self.schemas = [tool.schema for tool in tools]
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._dummy_prompt: list[int] | None = None
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "ToolTemplate: the tokenizer has no chat_template; tool calling needs one that renders tools"
            )
        self._check_renders_tools()
        turn = self._turn_boundary([tools[0].name])  # also checks prefix preservation
        self.end_of_turn_ids = turn["end_of_turn_ids"]
        self.stop_strings = self._find_stop_strings()

    # ----------------------------------------------------------------------------------------

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` with the tools' schemas and the generation prompt: what the model continues.

        messages: [{"role": ..., "content": ...}, ...], as for apply_chat_template.
        """
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError(f"prompt_ids: messages must be a list of {{'role', 'content'}} dicts, got {messages!r}")
        return self._ids(messages, generation_prompt=True)

    def tool_suffix_ids(self, results: list, completion_ids: list[int] | None = None) -> list[int]:
        """Token ids to append after a sampled assistant turn that called tools, before the model goes on.

        results:        one entry per call of the turn, in order: ToolResults (their names go into
                        the tool messages, which some templates render) or plain result strings
                        (named after the first tool).
        completion_ids: the sampled turn's ids; when given and they do not end with
                        `end_of_turn_ids` (the engine stopped at a stop string), the suffix starts
                        with the end-of-turn tokens. Without it the turn is taken to end with them.
        Returns the ids of: what the template renders after the assistant's end-of-turn token,
        the tool message(s), and the next assistant generation prompt. None of them are the
        model's: mask them out of the loss (tool_mask = 0).
        """
        if isinstance(results, (str, ToolResult)) or not results:
            raise ValueError(f"tool_suffix_ids: results must be a non-empty list of ToolResult or str, got {results!r}")
        names, contents = [], []
        for result in results:
            if isinstance(result, ToolResult):
                names.append(result.name)
                contents.append(result.content)
            elif isinstance(result, str):
                names.append(self.tools[0].name)
                contents.append(result)
            else:
                raise TypeError(f"tool_suffix_ids: each result must be a ToolResult or a str, got {result!r}")
        suffix = self._turn_boundary(names, contents)["suffix_ids"]
        if completion_ids is not None and self.end_of_turn_ids:
            n = len(self.end_of_turn_ids)
            if list(completion_ids[-n:]) != self.end_of_turn_ids:
                suffix = self.end_of_turn_ids + suffix
        return suffix

    # ----------------------------------------------------------------------------------------

    def _render(self, messages: list[dict], *, generation_prompt: bool, tokenize: bool):
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.schemas,
            add_generation_prompt=generation_prompt,
            tokenize=tokenize,
            **({"return_dict": False} if tokenize else {}),
            **self.chat_template_kwargs,
        )

    def _ids(self, messages: list[dict], *, generation_prompt: bool) -> list[int]:
        ids = self._render(messages, generation_prompt=generation_prompt, tokenize=True)
        if hasattr(ids, "keys"):  # a BatchEncoding despite return_dict=False (older versions)
            ids = ids["input_ids"]
        return list(ids)

    @staticmethod
    def _exchange(names: list[str], contents: list[str] | None = None) -> tuple[list[dict], list[dict]]:
        """A dummy [user, assistant calling `names`] and the tool messages answering it."""
        calls = [
            {"type": "function", "function": {"name": name, "arguments": {_ARG_KEY: _ARG_VALUE}}} for name in names
        ]
        head = [
            {"role": "user", "content": _DUMMY_USER},
            {"role": "assistant", "content": _DUMMY_CONTENT, "tool_calls": calls},
        ]
        contents = contents if contents is not None else [_RESULT] * len(names)
        answers = [{"role": "tool", "name": name, "content": c} for name, c in zip(names, contents)]
        return head, answers

    def _check_renders_tools(self) -> None:
        try:
            prompt = self._render([{"role": "user", "content": _DUMMY_USER}], generation_prompt=True, tokenize=False)
        except Exception as exc:
            raise ValueError(f"ToolTemplate: the chat template fails to render a prompt with tools: {exc}") from exc
        missing = [tool.name for tool in self.tools if tool.name not in prompt]
        if missing:
            raise ValueError(
                f"ToolTemplate: the chat template does not support tools: the tool {missing[0]!r} is not in the "
                "rendered prompt (the template ignores apply_chat_template's tools=). Use a model whose chat "
                "template renders tools (e.g. Qwen2.5-Instruct's), or set one that does"
            )
        head, answers = self._exchange([self.tools[0].name])
        try:
            text = self._render(head + answers, generation_prompt=True, tokenize=False)
        except Exception as exc:
            raise ValueError(
                f"ToolTemplate: the chat template cannot render a tool-calling exchange "
                f"(user, assistant with tool_calls, tool): {exc}"
            ) from exc
        if _ARG_VALUE not in text:
            raise ValueError(
                "ToolTemplate: the chat template does not support tool calls: it drops an assistant message's "
                "tool_calls (the call's arguments are not in the rendered text)"
            )
        if _RESULT not in text:
            raise ValueError(
                "ToolTemplate: the chat template does not support tool results: it drops messages of role 'tool'"
            )

    def _turn_boundary(self, names: list[str], contents: list[str] | None = None) -> dict:
        """Render the dummy exchange with and without its tool messages; split at the assistant's end of turn.

        Returns {"end_of_turn_ids", "suffix_ids"}. Raises ValueError when the longer rendering
        does not start with the shorter one (the template is not prefix-preserving).
        """
        head, answers = self._exchange(names, contents)
        if self._dummy_prompt is None:  # the same for every call: rendered once
            self._dummy_prompt = self._ids(head[:1], generation_prompt=True)
        prompt = self._dummy_prompt
        short = self._ids(head, generation_prompt=False)
        full = self._ids(head + answers, generation_prompt=True)
        if full[: len(short)] != short:
            at = (
                next(i for i, (a, b) in enumerate(zip(short, full)) if a != b) if len(full) >= len(short) else len(full)
            )
            alone = self.tokenizer.decode(short[at : at + 24])
            followed = self.tokenizer.decode(full[at : at + 24])
            raise ValueError(
                "ToolTemplate: the chat template is not prefix-preserving: it rewrites earlier turns once more "
                f"messages follow (e.g. it drops reasoning or content from past assistant turns). At token {at}, "
                f"the assistant turn alone renders {alone!r} but followed by a tool message {followed!r}. Tool "
                "calling appends tool results to the sampled tokens, so the template must render earlier turns "
                "the same whatever follows; use or set a template that does"
            )
        # The assistant's turn starts where the rendering stops agreeing with the bare prompt;
        # its end-of-turn token is the last end-of-sequence token in it, else its last special token.
        start = next((i for i, (a, b) in enumerate(zip(prompt, short)) if a != b), min(len(prompt), len(short)))
        end = self._end_of_turn(short, start)
        if end is None:  # no end token: the whole rendered turn is the model's, the suffix what follows it
            return {"end_of_turn_ids": [], "suffix_ids": full[len(short) :]}
        return {"end_of_turn_ids": [short[end]], "suffix_ids": full[end + 1 :]}

    def _end_of_turn(self, ids: list[int], start: int) -> int | None:
        """Index of the assistant's end-of-turn token in ids[start:], or None when it has none."""
        eos = self.tokenizer.eos_token_id
        eos_ids = set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())
        for wanted in (eos_ids, self._special_ids()):
            for i in range(len(ids) - 1, start - 1, -1):
                if ids[i] in wanted:
                    return i
        return None

    def _special_ids(self) -> set[int]:
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        for token_id, token in (getattr(self.tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(token, "special", False):
                special.add(token_id)
        return special

    def _find_stop_strings(self) -> list[str]:
        """The tag closing a call, e.g. ["</tool_call>"]: the last line the template renders between the
        call's arguments and the end of turn, when it is `</X>` and `<X>` opens the call before its name.
        Anything else (Llama's calls end with the turn; GLM's last tag closes an argument) gives []."""
        name = self.tools[0].name
        head, _ = self._exchange([name])
        text = self._render(head, generation_prompt=False, tokenize=False)
        turn = text[text.rfind(_DUMMY_CONTENT) :]  # the assistant turn
        after = turn[turn.rfind(_ARG_VALUE) + len(_ARG_VALUE) :]
        if self.end_of_turn_ids:
            end = self.tokenizer.decode(self.end_of_turn_ids)
            if end and end in after:
                after = after[: after.index(end)]
        lines = [line.strip() for line in after.splitlines() if line.strip()]
        closing = lines[-1].lstrip("\"'}]) \t") if lines else ""
        if not (closing.startswith("</") and closing.endswith(">")):
            return []
        opening = "<" + closing[2:]
        return [closing] if opening in turn[: turn.find(name)] else []


__all__ = ["ToolTemplate"]
