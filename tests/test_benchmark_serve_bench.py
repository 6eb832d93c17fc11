"""The serving benchmark's split of TTFT between the prompts that repeat an earlier prompt's
prefix and those that use theirs first."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("benchmarks_on_path")

A, B = "a" * 64, "b" * 64
"""Two prefixes' first characters: what tells prompts apart."""


def test_a_prompt_repeats_a_prefix_only_after_a_prompt_that_used_it() -> None:
    from serve_bench import repeat_ttfts

    split = repeat_ttfts([A + "1", B + "1", A + "2", A + "3"], [0.1, 0.2, 0.3, 0.5], [""] * 4)
    assert split["first_use"] == {"count": 2, "mean": pytest.approx(150.0), "median": 150.0}
    assert split["repeat"] == {"count": 2, "mean": pytest.approx(400.0), "median": 400.0}


def test_a_failed_request_counts_in_neither_but_its_prefix_is_used() -> None:
    from serve_bench import repeat_ttfts

    split = repeat_ttfts([A + "1", A + "2", B + "1"], [0.0, 0.3, 0.2], ["timed out", "", ""])
    assert split["first_use"]["count"] == 1 and split["first_use"]["mean"] == pytest.approx(200)
    assert split["repeat"]["count"] == 1 and split["repeat"]["mean"] == pytest.approx(300)


def test_a_run_without_repeats_has_no_repeat_figures() -> None:
    from serve_bench import ratios, repeat_ttfts

    split = repeat_ttfts([A, B], [0.1, 0.2], ["", ""])
    assert split["repeat"] == {"count": 0, "mean": None, "median": None}
    runs = {"kvtier": [{"repeat_mean_ttft_ms": None}], "vanilla": [{"repeat_mean_ttft_ms": 5.0}]}
    assert ratios(runs, "repeat_mean_ttft_ms", "kvtier", "vanilla")["pairs"] == []
