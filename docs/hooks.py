"""MkDocs hooks (mkdocs.yml's ``hooks:``): the flag table of ``flags.md`` is generated from
the config, topic by topic as ``grpo-fast train --help`` prints it, so the two cannot differ."""

import dataclasses

MARKER = "<!-- flags -->"


def flags_markdown() -> str:
    """One table per help topic (:func:`grpo_fast.cli.help_topics`, the fields' own
    declarations): flag (and its TRL and short names), default, help."""
    from grpo_fast.cli import flag_names, help_topics
    from grpo_fast.spec import option_default
    from grpo_fast.trainer.config import GRPOConfig

    fields = {field.name: field for field in dataclasses.fields(GRPOConfig)}
    parts = []
    for topic, names in help_topics().items():
        parts += [f"## {topic[0].upper()}{topic[1:]}", "", "| flag | default | what it does |", "|---|---|---|"]
        for name in names:
            flags = " ".join(f"`{flag}`" for flag in flag_names(name))
            text = fields[name].metadata["help"].replace("|", "\\|")
            parts.append(f"| {flags} | `{option_default(fields[name])!r}` | {text} |")
        parts.append("")
    return "\n".join(parts)


def on_page_markdown(markdown, page, config, files):
    return markdown.replace(MARKER, flags_markdown()) if MARKER in markdown else markdown
