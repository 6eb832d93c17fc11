"""The built-in and registered block indexes against the block-index contract suite."""

from __future__ import annotations

import pytest

from kvtier.config import PluginConfig
from kvtier.index.base import BlockIndex
from kvtier.kinds import BLOCK_INDEX
from kvtier.plugins import default_registry
from kvtier.testing.contracts_index import BlockIndexContract, IndexFactory

REGISTERED = sorted(default_registry().of_kind(BLOCK_INDEX))


class TestRegisteredIndexes(BlockIndexContract):
    """Every registered block index, built from its default config."""

    @pytest.fixture(params=REGISTERED)
    def make_index(self, request: pytest.FixtureRequest) -> IndexFactory:
        registration = default_registry().get(BLOCK_INDEX, request.param)
        config: PluginConfig = registration.config_model()

        def build(num_slots: int) -> BlockIndex:
            return registration.factory(config, num_slots)

        return build


def test_lru_is_registered() -> None:
    assert "lru" in REGISTERED
