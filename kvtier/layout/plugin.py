"""Built-in layout plugins (filled in by the layout layer)."""
