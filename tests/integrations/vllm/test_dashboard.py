"""The Grafana dashboard: every panel query reads series the connector exports, and evaluates.

The dashboard's PromQL is evaluated by ``dashboards/promql.py``, a tool of the repository.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm033

from kvtier.integrations.vllm.stats import KVTierPromMetrics  # noqa: E402
from tests.conftest import REPO_ROOT, load_script  # noqa: E402
from tests.integrations.vllm.conftest import MIB, Registered, vllm_config  # noqa: E402

promql = load_script(REPO_ROOT / "dashboards" / "promql.py")
DASHBOARD = promql.DASHBOARD
QueryError = promql.QueryError
Scrape = promql.Scrape
evaluate = promql.evaluate
legend = promql.legend
load_dashboard = promql.load_dashboard
panel_queries = promql.panel_queries
parse = promql.parse
selectors = promql.selectors


def exported_series() -> dict[str, set[str]]:
    """Sample name -> label names, of everything the connector's exporter publishes."""
    bound = Registered()
    # a storage tier in the config, so that the per-tier series exist from start-up
    disk = {"type": "disk", "path": "/var/cache/kvtier", "capacity_bytes": 64 * MIB}
    config = vllm_config({"cpu_bytes": 4 * MIB, "tiers": [disk]})
    prom = KVTierPromMetrics(config, bound.types, ["model_name", "engine"], {0: ["m", "0"]})
    # the one series not published at start-up
    prom.observe({"capacity_blocks": 256}, engine_idx=0)
    series: dict[str, set[str]] = {}
    for family in bound.registry.collect():
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def test_every_panel_query_reads_series_the_connector_exports() -> None:
    exported = exported_series()
    queries = list(panel_queries(load_dashboard()))
    assert queries, "the dashboard has no query"
    for title, query, _ in queries:
        for selector in selectors(parse(query)):
            assert selector.name in exported, f"panel {title!r}: {selector.name} is not exported"
            for label, _, _ in selector.matchers:
                assert label in exported[selector.name], f"panel {title!r}: no label {label}"


def test_the_exported_names_come_from_the_code() -> None:
    exported = exported_series()
    assert "vllm:kvtier_load_seconds_bucket" in exported
    assert "cause" in exported["vllm:kvtier_failures_total"]
    assert "tier" in exported["vllm:kvtier_tier_hits_total"]
    assert "vllm:kvtier_load_seconds" not in exported, "histograms export _bucket, _sum, _count"


def test_queries_outside_the_evaluated_promql_are_refused() -> None:
    for query in ("avg(rate(x[5m]))", "rate(x[5m])", 'x{a!="b"}', "sum(x"):
        with pytest.raises(QueryError):
            parse(query)


def _scrapes() -> list[Scrape]:
    def samples(count: float, fast: float, slow: float, used: float) -> dict:
        engine = (("engine", "0"),)
        return {
            ("h_bucket", frozenset((*engine, ("le", "1.0")))): fast,
            ("h_bucket", frozenset((*engine, ("le", "2.0")))): fast + slow,
            ("h_bucket", frozenset((*engine, ("le", "+Inf")))): fast + slow,
            ("h_count", frozenset(engine)): count,
            ("used", frozenset((*engine, ("model_name", "m")))): used,
            ("capacity", frozenset((*engine, ("model_name", "m")))): 8.0,
        }

    return [Scrape(0.0, samples(0, 0, 0, 0)), Scrape(10.0, samples(4, 2, 2, 2))]


def test_rates_quantiles_and_ratios_are_prometheus_s() -> None:
    scrapes = _scrapes()

    def at_end(query: str) -> dict:
        value = evaluate(parse(query), scrapes, 1, window_s=30.0)
        assert isinstance(value, dict)
        return {tuple(sorted(labels)): number for labels, number in value.items()}

    assert at_end("sum by (engine) (rate(h_count[$__rate_interval]))") == {(("engine", "0"),): 0.4}
    # rank 3 of 4 lies halfway through the (1, 2] bucket
    quantile = "histogram_quantile(0.75, sum by (le) (rate(h_bucket[$__rate_interval])))"
    assert at_end(quantile) == {(): 1.5}
    share = (
        '1 - sum(rate(h_bucket{le="1.0"}[$__rate_interval])) / sum(rate(h_count[$__rate_interval]))'
    )
    assert at_end(share) == {(): 0.5}
    assert at_end('used{model_name=~"$model_name"} / capacity') == {
        (("engine", "0"), ("model_name", "m")): 0.25
    }
    assert at_end('used{model_name="other"}') == {}
    first = evaluate(parse("rate(h_count[$__rate_interval])"), scrapes, 0, window_s=30.0)
    assert first == {}, "a rate needs two scrapes"
    assert math.isnan(evaluate(parse("1 / 0"), scrapes, 1, window_s=30.0))  # type: ignore[arg-type]


def test_legends_name_their_series() -> None:
    assert legend("engine {{engine}}", frozenset({("engine", "1")})) == "engine 1"
    assert legend("{{ cause }}", frozenset({("cause", "copy_error")})) == "copy_error"


def test_the_docs_show_the_dashboard_drawn_from_a_real_run() -> None:
    page = (REPO_ROOT / "docs" / "metrics.md").read_text()
    assert "![" in page and "img/dashboard.png" in page
    assert (REPO_ROOT / "docs" / "img" / "dashboard.png").stat().st_size > 10_000
    assert str(DASHBOARD.relative_to(REPO_ROOT)) in page
