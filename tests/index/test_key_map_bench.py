"""The key-map benchmark's numpy table finds what a dict finds, and its report has both arms."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO_ROOT, load_script

key_map = load_script(REPO_ROOT / "benchmarks" / "key_map.py")


def test_the_numpy_table_finds_each_key_and_misses_the_others() -> None:
    # Keys whose first 8 bytes share their low bits all start probing at one place.
    held = [bytes([0, 0, 0, 0, 0, 0, 0, n]) + bytes(24) for n in range(1, 40)]
    table = key_map.NumpyKeyMap(held)
    absent = [bytes([0, 0, 0, 0, 0, 0, 0, n]) + bytes(24) for n in range(40, 60)]
    assert table.lookup(held).tolist() == list(range(len(held)))
    assert table.lookup(absent).tolist() == [-1] * len(absent)
    assert table.lookup([held[5], absent[0], held[0]]).tolist() == [5, -1, 0]


def test_the_report_gives_both_arms_per_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert key_map.main(["--slots", "2048", "--keys", "4,64", "--steps", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [batch["keys"] for batch in report["batches"]] == [4, 64]
    for batch in report["batches"]:
        for arm in ("dict", "numpy"):
            assert batch[arm]["us_per_step"] > 0
            assert batch[arm]["us_per_key"] == pytest.approx(
                batch[arm]["us_per_step"] / batch["keys"]
            )
        assert batch["numpy_over_dict"] > 0
