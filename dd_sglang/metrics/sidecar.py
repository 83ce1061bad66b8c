"""The metrics sidecar: a small FastAPI app on its own port, beside SGLang.

Routes:

* ``GET /metrics``: Prometheus text format, merged across every SGLang process
  from ``$PROMETHEUS_MULTIPROC_DIR`` by ``prometheus_client.multiprocess``:
  the ``dd_`` series (:mod:`dd_sglang.metrics.definitions`) and SGLang's own
  ``sglang:`` series when ``--enable-metrics`` is on.
* ``GET /healthz``: 200 ``{"status": "ok"}`` only when SGLang's ``/health``
  answers 200 within ``health_timeout_s`` seconds; else 503 with the reason.
* ``GET /stats``: JSON snapshot: the ``dd_`` samples grouped by metric
  (``{"dd_device_kv_used_bytes": [{"labels": {}, "value": 0.0}], ...}``), the
  SGLang URL, the preset name, the sidecar's uptime in seconds, and the running
  prefetch hit rate per lookahead selector (``prefetch_hit_rate``).
"""

from __future__ import annotations

import time

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response


def prefetch_hit_rates(samples: dict) -> dict[str, float]:
    """Running prefetch hit rate per selector: ``dd_prefetch_hits_total / dd_prefetch_lookups_total``."""
    hits = {x["labels"].get("selector"): x["value"] for x in samples.get("dd_prefetch_hits_total", [])}
    out = {}
    for x in samples.get("dd_prefetch_lookups_total", []):
        sel = x["labels"].get("selector")
        if x["value"] > 0:
            out[sel] = round(hits.get(sel, 0.0) / x["value"], 4)
    return out


def _registry(multiproc_dir: str):
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=multiproc_dir)
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
            "metrics": samples,
        }

    return app
