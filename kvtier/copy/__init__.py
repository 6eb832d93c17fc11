"""Copy backends: move blocks between engine memory and host slots, asynchronously."""

from kvtier.copy.base import CopyBackend, CopyBatch, CopyError, CopyHandle, Direction

__all__ = ["CopyBackend", "CopyBatch", "CopyError", "CopyHandle", "Direction"]
