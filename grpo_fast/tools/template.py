"""The chat-template side of multi-turn rollouts (tool calls, environments), token-in / token-out.

A multi-turn rollout is one token sequence that is never re-tokenised:

    prompt_ids | turn 1 (sampled) | suffix 1 (tool results, observations) | turn 2 (sampled) | ...

The sampled tokens are the model's, exactly as the engine produced them (their log-probs are
the ones the loss uses); only the suffixes are made here, from the chat template, as the
difference between a dummy conversation rendered with and without the messages that follow the
model's turn (`ChatTemplate.suffix_ids`; tool results: `ToolTemplate.tool_suffix_ids`). That is
sound only when the template is prefix-preserving (rendering more messages never changes how
earlier ones render), which `ChatTemplate` checks before anything runs, along with the template
rendering tools at all when there are tools.

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


class ChatTemplate:
    """A tokenizer's chat template, checked prefix-preserving, and the token ids a multi-turn rollout
    appends to the model's turns: observations (tool results, an environment's answers) rendered as
    the template renders them after an assistant turn, up to the next generation prompt.

    tokenizer: a transformers tokenizer with a `chat_template`.
    tools:     the `Tool`s (from resolve_tools; other entries are resolved) shown in every prompt;
               () for none.
    chat_template_kwargs: extra variables for the template (e.g. {"enable_thinking": False}).

    Raises ValueError, naming the cause, when the tokenizer has no template, the template does
    not render the tools, tool calls or tool messages (with tools), or is not prefix-preserving.

    Attributes:
    schemas:         the tools' JSON schemas, as the template receives them; None without tools.
    end_of_turn_ids: the token(s) that end an assistant turn and that the model samples (e.g.
                     [id of <|im_end|>]); engines must stop on them. [] when the template ends a
                     turn with no special token.
    """

    def __init__(self, tokenizer, tools=(), *, chat_template_kwargs: dict | None = None):
        tools = list(tools)
        if not all(isinstance(t, Tool) for t in tools):
            tools = resolve_tools(tools)
        self.tokenizer = tokenizer
        self.tools = tools
        self.schemas = [tool.schema for tool in tools] or None
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._dummy_prompt: list[int] | None = None
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"{type(self).__name__}: the tokenizer has no chat_template; a multi-turn rollout (tools, an "
                "environment) needs one"
            )
        if tools:
            self._check_renders_tools()
            observation = [{"role": "tool", "name": tools[0].name, "content": _RESULT}]
        else:
            observation = [{"role": "user", "content": _RESULT}]
        self.end_of_turn_ids = self._turn_boundary(observation)["end_of_turn_ids"]  # checks prefix preservation

    # ----------------------------------------------------------------------------------------

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` with the tools' schemas and the generation prompt: what the model continues.

        messages: [{"role": ..., "content": ...}, ...], as for apply_chat_template.
        """
        _check_messages("prompt_ids", messages)
        return self._ids(messages, generation_prompt=True)

    def prompt_text(self, messages: list[dict]) -> str:
        """The text of :meth:`prompt_ids` (what an engine takes as a prompt)."""
        _check_messages("prompt_text", messages)
        return self._render(messages, generation_prompt=True, tokenize=False)

    def suffix_ids(self, messages: list[dict], completion_ids: list[int] | None = None) -> list[int]:
        """Token ids to append after a sampled assistant turn so that `messages` follow it, before the model goes on.

        messages:       the observations, e.g. [{"role": "tool", "name": ..., "content": ...}] or
                        [{"role": "user", "content": ...}].
        completion_ids: the sampled turn's ids; when given and they do not end with
                        `end_of_turn_ids` (the engine stopped at a stop string), the suffix starts
                        with the end-of-turn tokens. Without it the turn is taken to end with them.
        Returns the ids of: what the template renders after the assistant's end-of-turn token,
        the messages, and the next assistant generation prompt. None of them are the model's:
        mask them out of the loss (tool_mask = 0).
        """
        if not messages:
            raise ValueError(f"suffix_ids: messages must be a non-empty list of messages, got {messages!r}")
        _check_messages("suffix_ids", messages)
        suffix = self._turn_boundary(list(messages))["suffix_ids"]
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
    def _head(names: list[str]) -> list[dict]:
        """A dummy [user, assistant] exchange; the assistant calls the tools `names` (none: it only talks)."""
        assistant = {"role": "assistant", "content": _DUMMY_CONTENT}
        if names:
            assistant["tool_calls"] = [
                {"type": "function", "function": {"name": name, "arguments": {_ARG_KEY: _ARG_VALUE}}} for name in names
            ]
        return [{"role": "user", "content": _DUMMY_USER}, assistant]

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
        name = self.tools[0].name
        exchange = self._head([name]) + [{"role": "tool", "name": name, "content": _RESULT}]
        try:
            text = self._render(exchange, generation_prompt=True, tokenize=False)
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

    def _turn_boundary(self, observations: list[dict]) -> dict:
        """Render a dummy exchange (its assistant calling the tools that answer among
        `observations`) with and without `observations`; split at the assistant's end of turn.

        Returns {"end_of_turn_ids", "suffix_ids"}. Raises ValueError when the longer rendering
        does not start with the shorter one (the template is not prefix-preserving).
        """
        head = self._head([m.get("name", "") for m in observations if m["role"] == "tool"])
        if self._dummy_prompt is None:  # the same for every call: rendered once
            self._dummy_prompt = self._ids(head[:1], generation_prompt=True)
        prompt = self._dummy_prompt
        short = self._ids(head, generation_prompt=False)
        full = self._ids(head + observations, generation_prompt=True)
        if full[: len(short)] != short:
            at = (
                next(i for i, (a, b) in enumerate(zip(short, full)) if a != b) if len(full) >= len(short) else len(full)
            )
            alone = self.tokenizer.decode(short[at : at + 24])
            followed = self.tokenizer.decode(full[at : at + 24])
            raise ValueError(
                f"{type(self).__name__}: the chat template is not prefix-preserving: it rewrites earlier turns once "
                "more messages follow (e.g. it drops reasoning or content from past assistant turns). At token "
                f"{at}, the assistant turn alone renders {alone!r} but followed by a {observations[0]['role']} "
                f"message {followed!r}. A multi-turn rollout appends what follows to the sampled tokens, so the "
                "template must render earlier turns the same whatever follows; use or set a template that does"
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


class ToolTemplate(ChatTemplate):
    """A :class:`ChatTemplate` with at least one tool, and the stop strings of a call.

    tokenizer: a transformers tokenizer whose `chat_template` renders tools (apply_chat_template(tools=...)).
    tools:     the `Tool`s (from resolve_tools; other entries are resolved) shown in every prompt.

    Attributes (besides the ChatTemplate's):
    stop_strings:    the text that closes a tool call (e.g. ["</tool_call>"]), for engines that
                     stop a turn at its first call; [] when a call is closed by the end of turn.
    """

    def __init__(self, tokenizer, tools, *, chat_template_kwargs: dict | None = None):
        tools = list(tools)
        if not tools:
            raise ValueError("ToolTemplate: tools must name at least one tool")
        super().__init__(tokenizer, tools, chat_template_kwargs=chat_template_kwargs)
        self.stop_strings = self._find_stop_strings()

    def tool_suffix_ids(self, results: list, completion_ids: list[int] | None = None) -> list[int]:
        """:meth:`suffix_ids` of the tool messages answering a turn that called tools.

        results:        one entry per call of the turn, in order: ToolResults (their names go into
                        the tool messages, which some templates render) or plain result strings
                        (named after the first tool).
        """
        if isinstance(results, (str, ToolResult)) or not results:
            raise ValueError(f"tool_suffix_ids: results must be a non-empty list of ToolResult or str, got {results!r}")
        messages = []
        for result in results:
            if isinstance(result, ToolResult):
                messages.append({"role": "tool", "name": result.name, "content": result.content})
            elif isinstance(result, str):
                messages.append({"role": "tool", "name": self.tools[0].name, "content": result})
            else:
                raise TypeError(f"tool_suffix_ids: each result must be a ToolResult or a str, got {result!r}")
        return self.suffix_ids(messages, completion_ids)

    def _find_stop_strings(self) -> list[str]:
        """The tag closing a call, e.g. ["</tool_call>"]: the last line the template renders between the
        call's arguments and the end of turn, when it is `</X>` and `<X>` opens the call before its name.
        Anything else (Llama's calls end with the turn; GLM's last tag closes an argument) gives []."""
        name = self.tools[0].name
        text = self._render(self._head([name]), generation_prompt=False, tokenize=False)
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


def _check_messages(where: str, messages) -> None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise TypeError(f"{where}: messages must be a list of {{'role', 'content'}} dicts, got {messages!r}")


__all__ = ["ChatTemplate", "ToolTemplate"]
