"""The part of PromQL kvtier's Grafana dashboard is written in: parsed, and evaluated over scrapes.

The dashboard (``kvtier.json``, next to this file) asks only for a small part
of PromQL: selectors with ``=`` and ``=~`` matchers, ``rate(...[$__rate_interval])``,
``sum`` and ``sum by (...)``, ``histogram_quantile``, numbers, ``+``, ``-``,
``/`` and parentheses. This module parses exactly that part, which lets a test
check every metric a panel reads against what the connector exports, and lets
``draw.py`` plot the panels from scrapes of a real run without a Prometheus
server. Grafana variables in matcher values (``"$model_name"``) match any value.

It imports nothing of kvtier: it is a tool of the repository, not of the package.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().with_name("kvtier.json")
"""The dashboard, found next to this file wherever the command runs."""

Labels = frozenset[tuple[str, str]]
Samples = Mapping[tuple[str, Labels], float]
"""One scrape: ``(sample name, labels) -> value``."""
Vector = dict[Labels, float]


@dataclass(frozen=True)
class Scrape:
    """Every sample of a registry at one moment."""

    seconds: float
    samples: Samples


class QueryError(ValueError):
    """A dashboard query uses PromQL this module does not evaluate."""


# ----------------------------------------------------------------------------- parsing

_TOKEN = re.compile(
    r"\s*(?:(?P<number>\d+(?:\.\d+)?)|(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r'|(?P<string>"(?:[^"\\]|\\.)*")|(?P<interval>\$__rate_interval)|(?P<op>=~|[(){}\[\],=/+-]))'
)


@dataclass(frozen=True)
class Number:
    value: float


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]
    """``(label, "=" or "=~", value)`` each."""


@dataclass(frozen=True)
class Rate:
    selector: Selector


@dataclass(frozen=True)
class Sum:
    by: tuple[str, ...] | None
    expr: Node


@dataclass(frozen=True)
class Quantile:
    quantile: float
    expr: Node


@dataclass(frozen=True)
class Binary:
    op: str
    left: Node
    right: Node


Node = Number | Selector | Rate | Sum | Quantile | Binary


def _tokens(query: str) -> list[tuple[str, str]]:
    tokens, position = [], 0
    query = query.rstrip()
    while position < len(query):
        match = _TOKEN.match(query, position)
        if match is None:
            raise QueryError(f"cannot read {query[position:]!r} in query {query!r}")
        kind = match.lastgroup
        assert kind is not None
        tokens.append((kind, match.group(kind)))
        position = match.end()
    return tokens


class _Parser:
    def __init__(self, query: str) -> None:
        self.query = query
        self.tokens = _tokens(query)
        self.position = 0

    def parse(self) -> Node:
        node = self.expression()
        if self.position != len(self.tokens):
            self.fail("unexpected text after the expression")
        return node

    def fail(self, what: str) -> None:
        rest = " ".join(value for _, value in self.tokens[self.position :])
        raise QueryError(f"{what} at {rest[:40]!r} in query {self.query!r}")

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.position] if self.position < len(self.tokens) else ("end", "")

    def take(self, value: str | None = None, kind: str | None = None) -> str:
        token_kind, token = self.peek()
        if (value is not None and token != value) or (kind is not None and token_kind != kind):
            self.fail(f"expected {value or kind}")
        self.position += 1
        return token

    def expression(self) -> Node:
        node = self.term()
        while self.peek()[1] in ("+", "-"):
            op = self.take()
            node = Binary(op, node, self.term())
        return node

    def term(self) -> Node:
        node = self.factor()
        while self.peek()[1] == "/":
            self.take("/")
            node = Binary("/", node, self.factor())
        return node

    def factor(self) -> Node:
        kind, token = self.peek()
        if kind == "number":
            return Number(float(self.take()))
        if token == "(":
            self.take("(")
            node = self.expression()
            self.take(")")
            return node
        if kind != "name":
            self.fail("expected a number, a metric or a function")
        if token == "rate":
            self.take("rate")
            self.take("(")
            selector = self.selector()
            self.take("[")
            self.take(kind="interval")
            self.take("]")
            self.take(")")
            return Rate(selector)
        if token == "sum":
            self.take("sum")
            by = None
            if self.peek()[1] == "by":
                self.take("by")
                self.take("(")
                labels = [self.take(kind="name")]
                while self.peek()[1] == ",":
                    self.take(",")
                    labels.append(self.take(kind="name"))
                self.take(")")
                by = tuple(labels)
            self.take("(")
            node = self.expression()
            self.take(")")
            return Sum(by, node)
        if token == "histogram_quantile":
            self.take("histogram_quantile")
            self.take("(")
            quantile = float(self.take(kind="number"))
            self.take(",")
            node = self.expression()
            self.take(")")
            return Quantile(quantile, node)
        return self.selector()

    def selector(self) -> Selector:
        name = self.take(kind="name")
        matchers = []
        if self.peek()[1] == "{":
            self.take("{")
            while self.peek()[1] != "}":
                label = self.take(kind="name")
                op = self.take()
                if op not in ("=", "=~"):
                    self.fail("expected = or =~")
                matchers.append((label, op, json.loads(self.take(kind="string"))))
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
        return Selector(name, tuple(matchers))


def parse(query: str) -> Node:
    """Parse one dashboard query.

    Raises:
        QueryError: The query uses PromQL outside the part this module evaluates.
    """
    return _Parser(query).parse()


def _walk(node: Node) -> Iterator[Node]:
    yield node
    if isinstance(node, Rate):
        yield node.selector
    elif isinstance(node, (Sum, Quantile)):
        yield from _walk(node.expr)
    elif isinstance(node, Binary):
        yield from _walk(node.left)
        yield from _walk(node.right)


def selectors(node: Node) -> list[Selector]:
    """Every metric selector of a parsed query."""
    return [each for each in _walk(node) if isinstance(each, Selector)]


def panel_queries(dashboard: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """``(panel title, query, legend format)`` of every target of every panel."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"], target.get("legendFormat", "")


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    """The dashboard's JSON model."""
    return json.loads(path.read_text())


# -------------------------------------------------------------------------- evaluating


def _matches(labels: Labels, matchers: Sequence[tuple[str, str, str]]) -> bool:
    values = dict(labels)
    for label, op, wanted in matchers:
        if wanted.startswith("$"):
            continue  # a Grafana variable: every value is selected
        value = values.get(label, "")
        if (op == "=" and value != wanted) or (op == "=~" and not re.fullmatch(wanted, value)):
            return False
    return True


def _select(selector: Selector, samples: Samples) -> Vector:
    return {
        labels: value
        for (name, labels), value in samples.items()
        if name == selector.name and _matches(labels, selector.matchers)
    }


def evaluate(node: Node, scrapes: Sequence[Scrape], index: int, window_s: float) -> Vector | float:
    """The value of a parsed query at ``scrapes[index]``, with ``$__rate_interval = window_s``.

    A rate compares the scrape with the earliest one inside the window; at the first
    scrape it has no value. Division by zero gives no value, as in Prometheus.
    """
    now = scrapes[index]
    if isinstance(node, Number):
        return node.value
    if isinstance(node, Selector):
        return _select(node, now.samples)
    if isinstance(node, Rate):
        first = next(
            i for i in range(index + 1) if scrapes[i].seconds >= now.seconds - window_s - 1e-9
        )
        if first == index:
            first = index - 1
        if first < 0:
            return {}
        before = _select(node.selector, scrapes[first].samples)
        elapsed = now.seconds - scrapes[first].seconds
        after = _select(node.selector, now.samples)
        return {
            labels: (value - before[labels]) / elapsed
            for labels, value in after.items()
            if labels in before
        }
    if isinstance(node, Sum):
        inner = _vector(evaluate(node.expr, scrapes, index, window_s), node)
        summed: Vector = {}
        for labels, value in inner.items():
            key = frozenset((k, v) for k, v in labels if node.by is not None and k in node.by)
            summed[key] = summed.get(key, 0.0) + value
        return summed
    if isinstance(node, Quantile):
        return _quantile(
            node.quantile, _vector(evaluate(node.expr, scrapes, index, window_s), node)
        )
    left = evaluate(node.left, scrapes, index, window_s)
    right = evaluate(node.right, scrapes, index, window_s)
    return _binary(node.op, left, right)


def _vector(value: Vector | float, node: Node) -> Vector:
    if isinstance(value, float):
        raise QueryError(f"{type(node).__name__.lower()} needs a vector, not a number")
    return value


def _apply(op: str, left: float, right: float) -> float | None:
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    return left / right if right else None


def _binary(op: str, left: Vector | float, right: Vector | float) -> Vector | float:
    if isinstance(left, float) and isinstance(right, float):
        value = _apply(op, left, right)
        return math.nan if value is None else value
    if isinstance(left, float):
        assert isinstance(right, dict)
        pairs = {labels: (left, value) for labels, value in right.items()}
    elif isinstance(right, float):
        pairs = {labels: (value, right) for labels, value in left.items()}
    else:
        pairs = {
            labels: (value, right[labels]) for labels, value in left.items() if labels in right
        }
    result = {labels: _apply(op, a, b) for labels, (a, b) in pairs.items()}
    return {labels: value for labels, value in result.items() if value is not None}


def _quantile(quantile: float, buckets: Vector) -> Vector:
    """Prometheus's ``histogram_quantile``: linear within the bucket holding the rank."""
    series: dict[Labels, list[tuple[float, float]]] = {}
    for labels, count in buckets.items():
        values = dict(labels)
        bound = float(values.pop("le"))
        series.setdefault(frozenset(values.items()), []).append((bound, count))
    result: Vector = {}
    for labels, points in series.items():
        points.sort()
        total = points[-1][1]
        if total <= 0:
            continue
        rank = quantile * total
        lower, below = 0.0, 0.0
        for bound, count in points:
            if count >= rank:
                if math.isinf(bound):
                    result[labels] = lower
                elif count == below:
                    result[labels] = bound
                else:
                    result[labels] = lower + (bound - lower) * (rank - below) / (count - below)
                break
            lower, below = bound, count
    return result


def legend(format_: str, labels: Labels) -> str:
    """A target's legend for one series: ``{{label}}`` replaced by the series' value."""
    values = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: values.get(m.group(1), ""), format_) or "value"
