"""MkDocs hook: generates the config and command-line references where a page asks for them."""

from __future__ import annotations

import re
from typing import Any

from kvtier.cli import help_texts
from kvtier.config_reference import render_config_reference, render_storage_tier_reference
from kvtier.plugins import default_registry

MARKER = "<!-- kvtier:config-reference -->"
CLI_MARKER = "<!-- kvtier:cli-reference -->"
TIERS_MARKER = "<!-- kvtier:tier-reference -->"

# Docstrings cross-reference in Sphinx style (:class:`~kvtier.index.BlockIndex`), which the
# Google-style renderer leaves as text; show the name alone, shortened where ``~`` asks for it.
_ROLE = re.compile(r":(?:class|meth|func|data|attr|mod|exc|obj):<code>(~?)([^<]+)</code>")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Render the references wherever a page holds one of the markers."""
    if MARKER in markdown:
        reference = render_config_reference(default_registry(), distribution="kvtier")
        # Headings one level below the page's "## Reference".
        reference = reference.replace("\n### ", "\n#### ").replace("\n## ", "\n### ")
        if reference.startswith("## "):
            reference = "#" + reference
        markdown = markdown.replace(MARKER, reference)
    if TIERS_MARKER in markdown:
        tiers = render_storage_tier_reference(default_registry(), distribution="kvtier")
        markdown = markdown.replace(TIERS_MARKER, tiers)
    if CLI_MARKER in markdown:
        sections = [
            f"## `{command}`\n\n```text\n{text.rstrip()}\n```\n"
            for command, text in help_texts().items()
        ]
        markdown = markdown.replace(CLI_MARKER, "\n".join(sections))
    return markdown


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Turn Sphinx-style cross-reference roles left in rendered docstrings into code."""
    return _ROLE.sub(
        lambda match: f"<code>{match[2].rsplit('.', 1)[-1] if match[1] else match[2]}</code>", html
    )
