"""The rank-faults copy backend: found through an installed entry point, driven by files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.config import load_config
from kvtier.copy.base import CopyBatch, CopyError, Direction
from kvtier.kinds import COPY_BACKEND
from kvtier.plugins import build_plugin_manager, collect
from tests.offload.conftest import BLOCK_BYTES, make_layout
from tests.support.faults import NOISE_BYTE, install_rank_faults, read_rank_counts


def test_loads_fail_on_the_rank_named_by_a_file_and_every_batch_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_rank_faults(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    registry = collect(build_plugin_manager({}))
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    config = load_config(
        {"copy": {"type": "rank-faults", "directory": str(ranks)}}, registry=registry
    )
    layout = make_layout()
    host = torch.zeros(3, layout.record_bytes, dtype=torch.uint8)
    backend = registry.build(COPY_BACKEND, config.copy, layout, host)
    assert read_rank_counts(ranks) == {
        0: {
            "host_slots": 3,
            "host_bytes": 3 * 2 * BLOCK_BYTES,
            "stored_blocks": 0,
            "loaded_blocks": 0,
            "failed_load_blocks": 0,
        }
    }
    backend.wait(backend.submit(CopyBatch(Direction.STORE, [1, 2], [0, 1])))
    backend.wait(backend.submit(CopyBatch(Direction.LOAD, [5], [0])))
    (ranks / "fail-loads-rank1").touch()
    backend.wait(backend.submit(CopyBatch(Direction.LOAD, [6], [0])))
    (ranks / "fail-loads-rank0").touch()
    with pytest.raises(CopyError):
        backend.wait(backend.submit(CopyBatch(Direction.LOAD, [7], [1])))
    assert bool((layout.regions[0].view[7] == NOISE_BYTE).all())
    counts = read_rank_counts(ranks)[0]
    assert (counts["stored_blocks"], counts["loaded_blocks"], counts["failed_load_blocks"]) == (
        2,
        2,
        1,
    )
