"""Built-in copy plugins (filled in by the copy layer)."""
