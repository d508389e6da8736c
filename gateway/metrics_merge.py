"""Merge the Prometheus expositions of a node's gateway processes into one (``serve --gateways N``).

The N gateways share one port, so a scrape of /metrics lands on any one of them; it fetches its
siblings' ``Metrics.render()`` and answers with this merge, which must read as the node's totals:

* counters and histograms (every bucket, ``_sum`` and ``_count``) are summed per label set;
* their ``_created`` takes the earliest: the summed series has been counting since then;
* gauges merge by the mode gateway/metrics.py declares for each in ``GAUGE_MERGE`` (sum, max, min);
  a gauge it does not declare is an error, not a guess, since a wrong guess double counts silently.

Pure: text in, text out, written by prometheus-client's own ``generate_latest``, so the merge of one
exposition is that exposition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tokenmill.gateway.metrics import GAUGE_MERGE

_COMBINE = {"sum": lambda a, b: a + b, "max": max, "min": min}
_SUMMED = ("counter", "histogram")  # the types whose samples add up
_Key = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)


def merge_expositions(texts: Sequence[bytes | str], gauge_modes: Mapping[str, str] = GAUGE_MERGE) -> bytes:
    """One exposition (text format 0.0.4) showing the sum of the processes behind ``texts``.

    Raises ValueError where a merge would be wrong rather than merely approximate: a family with
    different types in two texts, a histogram with different buckets, an undeclared gauge, or a type
    that cannot be merged (summary quantiles, info, untyped).
    """
    return merge_families(
        [text_string_to_metric_families(t.decode() if isinstance(t, bytes) else t) for t in texts], gauge_modes
    )


def merge_families(sources: Sequence[Iterable[Metric]], gauge_modes: Mapping[str, str] = GAUGE_MERGE) -> bytes:
    """``merge_expositions`` on metric families: parsed text, or a registry's own ``collect()``.

    The answering gateway can pass its own ``metrics.registry.collect()`` and skip rendering and
    parsing itself (parsing is most of the cost: ~8 ms per gateway's exposition).
    """
    parsed = [list(families) for families in sources]
    summed = {f.name for families in parsed for f in families if f.type in _SUMMED}
    merged: dict[str, _Family] = {}  # in first-seen order, as each gateway renders them
    for families in parsed:
        for family in families:
            base = family.name[: -len("_created")] if family.name.endswith("_created") else None
            if base in summed and family.type == "gauge":  # a counter's or histogram's _created, rendered apart
                if base not in merged:  # only if a text had it before its family
                    merged[base] = _Family(base, "", _type_of(base, parsed))
                merged[base].add(family.samples, min)
                continue
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = _Family(family.name, family.documentation, family.type)
            elif target.type != family.type:
                raise ValueError(f"{family.name} is a {target.type} in one exposition and a {family.type} in another")
            target.documentation = target.documentation or family.documentation
            target.add(family.samples, _combine_for(family, gauge_modes))
    return generate_latest(_Collected(f.metric() for f in merged.values()))


class _Family:
    """One metric family being merged: its samples by (name, labels), in first-seen order."""

    def __init__(self, name: str, documentation: str, typ: str):
        self.name, self.documentation, self.type = name, documentation, typ
        self.values: dict[_Key, float] = {}
        self.buckets: dict[tuple[tuple[str, str], ...], tuple[str, ...]] = {}  # histogram series -> its bounds

    def add(self, samples: Iterable[Sample], combine) -> None:
        """Fold one process's samples in (``combine`` joins a label set both have)."""
        samples = list(samples)
        if self.type == "histogram":
            self._check_buckets(samples)
        created = self.name + "_created"  # inside the family as collect() gives it; summed, it would be nonsense
        for s in samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            join = min if s.name == created else combine
            self.values[key] = join(self.values[key], s.value) if key in self.values else s.value

    def _check_buckets(self, samples: list[Sample]) -> None:
        """Buckets only add up bound by bound: two processes with other bounds would give a broken histogram."""
        bounds: dict[tuple[tuple[str, str], ...], list[str]] = {}
        for s in samples:
            if s.name.endswith("_bucket"):
                series = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                bounds.setdefault(series, []).append(s.labels["le"])
        for series, les in bounds.items():
            seen = self.buckets.setdefault(series, tuple(les))
            if seen != tuple(les):
                raise ValueError(f"{self.name}{dict(series)}: buckets {les} in one exposition, {list(seen)} in another")

    def metric(self) -> Metric:
        m = Metric(self.name, self.documentation, self.type)
        m.samples = [Sample(name, dict(labels), value) for (name, labels), value in self.values.items()]
        return m


class _Collected:
    """What generate_latest wants: something with collect()."""

    def __init__(self, metrics: Iterable[Metric]):
        self.metrics = list(metrics)

    def collect(self) -> Iterable[Metric]:
        return self.metrics


def _combine_for(family: Metric, gauge_modes: Mapping[str, str]):
    if family.type in _SUMMED:
        return _COMBINE["sum"]
    if family.type == "gauge":
        mode = gauge_modes.get(family.name)
        if mode not in _COMBINE:
            raise ValueError(f"gauge {family.name} has no merge mode (declare it in gateway/metrics.py GAUGE_MERGE)")
        return _COMBINE[mode]
    raise ValueError(f"{family.name}: cannot merge a {family.type} across gateway processes")


def _type_of(name: str, parsed: list[list[Metric]]) -> str:
    return next(f.type for families in parsed for f in families if f.name == name and f.type in _SUMMED)
