"""MkDocs hook: replaces the config reference marker with tables generated from the models."""

from __future__ import annotations

from typing import Any

from kvtier.cli import config_reference
from kvtier.plugins import default_registry

MARKER = "<!-- kvtier:config-reference -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Render the configuration reference wherever a page holds :data:`MARKER`."""
    if MARKER not in markdown:
        return markdown
    reference = config_reference(default_registry(), distribution="kvtier")
    # Headings one level below the page's "## Reference".
    reference = reference.replace("\n### ", "\n#### ").replace("\n## ", "\n### ")
    if reference.startswith("## "):
        reference = "#" + reference
    return markdown.replace(MARKER, reference)
