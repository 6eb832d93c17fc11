"""Built-in copy backends."""

from __future__ import annotations

import kvtier
from kvtier.copy import torch_backend
from kvtier.hookspecs import Register


@kvtier.hookimpl
def register_copy_backends(register: Register) -> None:
    register("torch", torch_backend.build, torch_backend.TorchCopyConfig)
