"""MkDocs hooks (mkdocs.yml's ``hooks:``): pages generated from the one source of what they say,
so that the two cannot differ.

- ``index.md`` (the site's home) is README.md, the project's front page, with its links made
  the site's: ``docs/x.md`` becomes ``x.md``, and a link to another file of the repository (the
  site holds ``docs/`` only) becomes the path in code.
- ``flags.md``'s table is generated from the config, topic by topic as ``grpo-fast train
  --help`` prints it.
"""

import dataclasses
import os
import re

MARKER = "<!-- flags -->"
README_MARKER = "<!-- README.md -->"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def front_page(readme: str) -> str:
    """README.md's text as the site's home page (see the module's docstring)."""

    def relink(match):
        image, label, target = match.groups()
        if re.match(r"[a-z][a-z0-9+.-]*:|#", target):  # a URL or an anchor: as it is
            return match.group(0)
        if target.startswith("docs/"):
            return f"{image}[{label}]({target.removeprefix('docs/')})"
        return f"`{target}`" if label in (target, f"`{target}`") else f"{label} (`{target}`)"

    return LINK.sub(relink, readme)


def flags_markdown() -> str:
    """One table per help topic (:func:`grpo_fast.cli.help_topics`, the fields' own
    declarations): flag (and its TRL and short names), default, help."""
    from grpo_fast.cli import flag_names, help_topics
    from grpo_fast.spec import option_default
    from grpo_fast.trainer.config import GRPOConfig

    fields = {field.name: field for field in dataclasses.fields(GRPOConfig)}
    parts = []
    for topic, names in help_topics().items():
        section = fields[names[0]].metadata["section"]
        heading = f"## {topic[0].upper()}{topic[1:]} (YAML section `{section}:`)"
        parts += [heading, "", "| flag | default | what it does |", "|---|---|---|"]
        for name in names:
            flags = " ".join(f"`{flag}`" for flag in flag_names(name))
            text = fields[name].metadata["help"].replace("|", "\\|")
            parts.append(f"| {flags} | `{option_default(fields[name])!r}` | {text} |")
        parts.append("")
    return "\n".join(parts)


def on_page_markdown(markdown, page, config, files):
    if README_MARKER in markdown:
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            markdown = markdown.replace(README_MARKER, front_page(f.read()))
    return markdown.replace(MARKER, flags_markdown()) if MARKER in markdown else markdown
