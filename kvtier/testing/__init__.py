"""Contract test suites for plugin authors, one module per kind of plugin.

They are pytest test classes (hypothesis drives the index ones), which kvtier's
``testing`` extra installs: ``pip install 'kvtier[testing]'``.
"""

try:
    import hypothesis  # noqa: F401
    import pytest  # noqa: F401
except ImportError as missing:
    raise ImportError(
        f"kvtier.testing's contract suites need {missing.name}, which kvtier's testing extra "
        "installs: pip install 'kvtier[testing]'",
        name=missing.name,
    ) from missing
