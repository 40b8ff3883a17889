"""Test helpers for tool calling, Hermes-style (Qwen2.5-like), built here with no download: the
chat template, transformers' response template for it, and a local tokenizer.

Used by tests/test_tools.py (grpo_fast.tools) and tests/test_integration_trl_tools.py (TRL's own
tool loop): the template is prefix-preserving and renders tool calls, as both need.
"""

import pytest


def hermes_template(assistant_content: str = "m.content or ''", tool_calls: str = "m.tool_calls or []") -> str:
    """ChatML with tools the way Qwen2.5 does it: schemas in a system turn, calls as <tool_call>
    JSON in the assistant turn, results as <tool_response> blocks of one user turn, `<|im_end|>\n`
    after each. ``assistant_content`` and ``tool_calls`` are the Jinja expressions of an assistant
    message ``m``'s text and calls (test_tools makes its broken templates by changing them)."""
    return (
        "{%- if tools %}"
        "{{- '<|im_start|>system\\nYou may call these tools:\\n<tools>' }}"
        "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
        '{{- \'\\n</tools>\\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\\n\' }}'
        "{%- endif %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'assistant' %}"
        "{{- '<|im_start|>assistant\\n' + (" + assistant_content + ") }}"
        "{%- for call in " + tool_calls + " %}"
        "{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}"
        '{{- \'<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' }}'
        "{{- (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- elif m.role == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- else %}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


CHAT_TEMPLATE = hermes_template()

# transformers' response template (what tokenizer.parse_response reads): TRL's Qwen3 one without <think>.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<tool_call>", "</tool_call>"]


def make_tokenizer(chat_template: str = CHAT_TEMPLATE, special=()):
    """One token a byte (byte-level, no merges: any text, a character of ASCII a token), the chat
    markers and ``special`` as special tokens, the tool-call tags as single ordinary tokens; eos
    <|im_end|>, pad <pad> on the left. No response template: set ``response_template`` for one."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    backend = tokenizers.Tokenizer(tokenizers.models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL + list(special))
    backend.add_tokens(TAGS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=chat_template,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", *special],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
