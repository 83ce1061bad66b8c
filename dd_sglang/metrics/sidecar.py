"""The metrics sidecar: a small FastAPI app on its own port, beside SGLang.

Routes:

* ``GET /metrics``: Prometheus text format, merged across every SGLang process
  from ``$PROMETHEUS_MULTIPROC_DIR`` by ``prometheus_client.multiprocess``:
  the ``dd_`` series (:mod:`dd_sglang.metrics.definitions`), each labelled
  ``dp_rank`` (merged per data-parallel rank: :mod:`dd_sglang.metrics.ranks`),
  and SGLang's own ``sglang:`` series when ``--enable-metrics`` is on.
* ``GET /healthz``: 200 ``{"status": "ok"}`` only when SGLang's ``/health``
  answers 200 within ``health_timeout_s`` seconds; else 503 with the reason.
* ``GET /stats``: JSON snapshot: the ``dd_`` samples grouped by metric
  (``{"dd_device_kv_used_bytes": [{"labels": {}, "value": 0.0}], ...}``), the
  SGLang URL, the preset name, the sidecar's uptime in seconds, and the running
  prefetch hit rate per lookahead selector (``prefetch_hit_rate``) and per
  selector/speculator pair (``prefetch_hit_rate_by_speculator``, keys like
  ``"spec_host/dual_token"``), and the speculated-token acceptance rate per
  speculator (``spec_acceptance_rate``).
"""

from __future__ import annotations

import time

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response


def prefetch_hit_rates(samples: dict, by: tuple[str, ...] = ("selector",)) -> dict[str, float]:
    """Running prefetch hit rate (``dd_prefetch_hits_total / dd_prefetch_lookups_total``), grouped by
    the labels ``by`` (keys joined with ``/``: ``"spec_host/dual_token"`` for selector and speculator)."""

    def group(name: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for x in samples.get(name, []):
            key = "/".join(str(x["labels"].get(b)) for b in by)
            out[key] = out.get(key, 0.0) + x["value"]
        return out

    hits, lookups = group("dd_prefetch_hits_total"), group("dd_prefetch_lookups_total")
    return {key: round(hits.get(key, 0.0) / n, 4) for key, n in lookups.items() if n > 0}


def acceptance_rates(samples: dict) -> dict[str, float]:
    """Speculated-token acceptance per speculator: ``dd_spec_accepted_total / dd_spec_proposed_total``."""
    acc = {x["labels"].get("speculator"): x["value"] for x in samples.get("dd_spec_accepted_total", [])}
    return {
        x["labels"].get("speculator"): round(acc.get(x["labels"].get("speculator"), 0.0) / x["value"], 4)
        for x in samples.get("dd_spec_proposed_total", [])
        if x["value"] > 0
    }


def _registry(multiproc_dir: str):
    from prometheus_client import CollectorRegistry

    from dd_sglang.metrics.ranks import RankMergingCollector

    registry = CollectorRegistry()
    RankMergingCollector(multiproc_dir, registry)  # dd_ series per data-parallel rank (label dp_rank)
    return registry


def dd_samples(multiproc_dir: str) -> dict[str, list[dict]]:
    """``dd_`` samples currently in ``multiproc_dir``, grouped by sample name."""
    out: dict[str, list[dict]] = {}
    for family in _registry(multiproc_dir).collect():
        for s in family.samples:
            if s.name.startswith("dd_"):
                out.setdefault(s.name, []).append({"labels": dict(s.labels), "value": s.value})
    return out


def create_app(
    *, sglang_url: str, multiproc_dir: str, health_timeout_s: float = 5.0, preset: str = ""
) -> FastAPI:
    """Build the sidecar app.

    Args:
        sglang_url: base URL of the SGLang HTTP server, e.g. ``http://127.0.0.1:30000``.
        multiproc_dir: prometheus-client multiprocess folder shared with SGLang.
        health_timeout_s: seconds to wait for SGLang's ``/health``.
        preset: preset name shown in ``/stats``.
    """
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    app = FastAPI(title="dd_sglang metrics sidecar")
    started = time.monotonic()

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(_registry(multiproc_dir)), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        try:
            async with httpx.AsyncClient(timeout=health_timeout_s) as client:
                r = await client.get(f"{sglang_url}/health")
        except httpx.HTTPError as err:
            return JSONResponse({"status": "unavailable", "detail": f"{type(err).__name__}: {err}"}, 503)
        if r.status_code != 200:
            return JSONResponse(
                {"status": "unavailable", "detail": f"SGLang /health returned {r.status_code}"}, 503
            )
        return JSONResponse({"status": "ok"})

    @app.get("/stats")
    def stats() -> dict:
        samples = dd_samples(multiproc_dir)
        return {
            "preset": preset,
            "sglang_url": sglang_url,
            "uptime_seconds": round(time.monotonic() - started, 3),
            "prefetch_hit_rate": prefetch_hit_rates(samples),
            "prefetch_hit_rate_by_speculator": prefetch_hit_rates(samples, ("selector", "speculator")),
            "spec_acceptance_rate": acceptance_rates(samples),
            "metrics": samples,
        }

    return app
