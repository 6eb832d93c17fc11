"""The Markdown config reference that the docs and ``kvtier config reference`` show."""

from __future__ import annotations

from kvtier.config_reference import render_config_reference
from tests.config.conftest import Sections, make_registry


def test_sections_show_their_default_and_every_implementation() -> None:
    reference = render_config_reference(make_registry(Sections()))
    assert "| `copy` | section (below) | `torch` |" in reference
    assert "### `copy.type: twin`\n\nA second copy backend, to switch to." in reference
    assert "| `copy.depth` | `int` | `2` | Queue depth. |" in reference
    assert "### `layout.type: auto`\n\nStand-in for the default" in reference
    assert "No settings besides `type`." in reference


def test_distribution_leaves_out_other_implementations() -> None:
    reference = render_config_reference(make_registry(Sections()), distribution="kvtier")
    assert "| `cpu_bytes` |" in reference and "## `copy`: copy backend" in reference
    assert "copy.type: twin" not in reference and "copy.type: torch" not in reference
