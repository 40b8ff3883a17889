"""MkDocs hooks (mkdocs.yml's ``hooks:``): the flag table of ``flags.md`` is generated from
the config, topic by topic as ``grpo-fast train --help`` prints it, so the two cannot differ."""

import dataclasses

MARKER = "<!-- flags -->"


def flags_markdown() -> str:
    """One table per topic of :data:`grpo_fast.trainer.config.TOPICS`: flag (and its TRL and
    short names), default, help."""
    from grpo_fast.cli import _ALIASES
    from grpo_fast.trainer.config import TOPICS, TRL_ALIASES, GRPOConfig

    fields = {field.name: field for field in dataclasses.fields(GRPOConfig)}
    other_names = {name: list(flags) for name, flags in _ALIASES.items()}
    for trl, ours in TRL_ALIASES.items():
        other_names.setdefault(ours, []).append(f"--{trl.replace('_', '-')}")
    parts = []
    for topic, names in TOPICS.items():
        parts += [f"## {topic[0].upper()}{topic[1:]}", "", "| flag | default | what it does |", "|---|---|---|"]
        for name in names:
            field = fields[name]
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            flags = " ".join(f"`{flag}`" for flag in [f"--{name.replace('_', '-')}", *other_names.get(name, [])])
            text = field.metadata["help"].replace("|", "\\|")
            parts.append(f"| {flags} | `{default!r}` | {text} |")
        parts.append("")
    return "\n".join(parts)


def on_page_markdown(markdown, page, config, files):
    return markdown.replace(MARKER, flags_markdown()) if MARKER in markdown else markdown
