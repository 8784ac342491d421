"""Prometheus metrics of one daemon, in a registry of its own (never the process-global one).

==========================================  =========  ===========================================================
name                                        type       meaning
==========================================  =========  ===========================================================
``transformd_conversions_total``            counter    finished conversion jobs by ``outcome``: ``converted`` (this
                                                       daemon converted), ``fetched`` (downloaded from the remote
                                                       tier), ``waited`` (another process did),
                                                       ``invalid`` (422), ``failed``, ``cancelled``
``transformd_cache_hits_total``             counter    ``POST /v1/checkpoints`` answered from the cache (200)
``transformd_cache_misses_total``           counter    ``POST /v1/checkpoints`` that found no entry (202 or error)
``transformd_cache_bytes``                  gauge      bytes of the published entries
``transformd_cache_budget_bytes``           gauge      the cache's byte budget
``transformd_conversion_seconds``           histogram  wall time of conversions this daemon ran
``transformd_converted_bytes_total``        counter    bytes of converted checkpoints this daemon wrote
``transformd_conversions_in_progress``      gauge      conversions running in a worker
``transformd_conversions_queued``           gauge      conversions waiting for a worker
``transformd_http_requests_total``          counter    by ``method`` (or ``other``), ``route`` (template), ``status``
``transformd_remote_total``                 counter    the remote tier by ``event``: ``hits`` (entries downloaded),
                                                       ``misses``, ``bytes`` (downloaded), ``verification_failures``
                                                       (a file unlike its manifest), ``failures`` (downloads that
                                                       fell back to a local conversion), ``uploads``,
                                                       ``upload_failures``
==========================================  =========  ===========================================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..request import TIER_COUNTS

#: Buckets of the conversion time histogram (seconds): a sample checkpoint to a 600 GB model on a slow disk.
CONVERSION_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The daemon's metrics; ``render()`` gives the Prometheus text exposition."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.conversions = Counter(
            "transformd_conversions", "Finished conversion jobs by outcome", ["outcome"], registry=r
        )
        for outcome in ("converted", "fetched", "waited", "invalid", "failed", "cancelled"):
            self.conversions.labels(outcome)
        self.cache_hits = Counter("transformd_cache_hits", "Checkpoint requests answered from the cache", registry=r)
        self.cache_misses = Counter(
            "transformd_cache_misses", "Checkpoint requests that found no cache entry", registry=r
        )
        self.cache_bytes = Gauge("transformd_cache_bytes", "Bytes of the published cache entries", registry=r)
        self.cache_budget = Gauge("transformd_cache_budget_bytes", "Byte budget of the cache", registry=r)
        self.conversion_seconds = Histogram(
            "transformd_conversion_seconds",
            "Wall time of the conversions this daemon ran",
            buckets=CONVERSION_BUCKETS,
            registry=r,
        )
        self.converted_bytes = Counter(
            "transformd_converted_bytes", "Bytes of converted checkpoints this daemon wrote", registry=r
        )
        self.in_progress = Gauge("transformd_conversions_in_progress", "Conversions running in a worker", registry=r)
        self.queued = Gauge("transformd_conversions_queued", "Conversions waiting for a worker", registry=r)
        self.requests = Counter("transformd_http_requests", "HTTP requests", ["method", "route", "status"], registry=r)
        self.remote = Counter("transformd_remote", "What the remote tier did, by event", ["event"], registry=r)
        for event in TIER_COUNTS:
            self.remote.labels(event)

    def count_remote(self, event: str, amount: int) -> None:
        """A :class:`transformd.request.Tier`'s ``on_count``."""
        self.remote.labels(event).inc(amount)

    def render(self) -> bytes:
        return generate_latest(self.registry)
