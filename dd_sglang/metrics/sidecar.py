"""The metrics sidecar: a small FastAPI app on its own port, beside SGLang.

It runs as its own process (``python -m dd_sglang.metrics.sidecar``, started
by the launcher on a listening socket the launcher owns, and restarted by it
if it dies), so it only ever reads: every figure lives in the
prometheus-client multiprocess folder that SGLang's processes write. Killing
and restarting it neither resets nor doubles a counter.

Routes:

* ``GET /metrics``: Prometheus text format, merged across every SGLang process
  from ``$PROMETHEUS_MULTIPROC_DIR`` by ``prometheus_client.multiprocess``:
  the ``dd_`` series (:mod:`dd_sglang.metrics.definitions`), each labelled
  ``dp_rank`` (merged per data-parallel rank: :mod:`dd_sglang.metrics.ranks`),
  and SGLang's own ``sglang:`` series when ``--enable-metrics`` is on.
* ``GET /healthz``: 200 ``{"status": "ok"}`` only when SGLang's ``/health``
  answers 200 within :func:`~dd_sglang.metrics.health.health_wait_s` seconds (SGLang's own bound on
  ``/health``, ``SGLANG_HEALTH_CHECK_TIMEOUT``, plus a second); else 503 with
  the reason.
* ``GET /stats``: JSON snapshot: the ``dd_`` samples grouped by metric
  (``{"dd_device_kv_used_bytes": [{"labels": {}, "value": 0.0}], ...}``), the
  SGLang URL, the preset name, the sidecar's uptime in seconds, and the running
  prefetch hit rate per lookahead selector (``prefetch_hit_rate``) and per
  selector/speculator pair (``prefetch_hit_rate_by_speculator``, keys like
  ``"spec_host/dual_token"``), and the speculated-token acceptance rate per
  speculator (``spec_acceptance_rate``).

Access: with SGLang's ``--api-key`` (or, without it, ``--admin-api-key``) set,
``/stats`` answers 401 unless the request carries ``Authorization: Bearer
<key>``, as SGLang's own routes do. ``/metrics`` and ``/healthz`` stay open,
as SGLang keeps its ``/metrics`` and ``/health*`` open, so Prometheus and
health probes need no secret; both bind to loopback unless told otherwise.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from dd_sglang.metrics.health import health_wait_s

#: Environment variable through which the launcher hands the sidecar SGLang's API key
#: (kept out of the sidecar's command line).
API_KEY_ENV = "DD_SGLANG_SIDECAR_API_KEY"
#: Routes that answer without a key even when one is set (scrapers and health probes).
OPEN_ROUTES = ("/metrics", "/healthz")


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


def bearer_ok(authorization: str | None, key: str) -> bool:
    """True when ``authorization`` is ``Bearer <key>`` (scheme case-insensitive, constant-time compare)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def create_app(
    *,
    sglang_url: str,
    multiproc_dir: str,
    health_timeout_s: float | None = None,
    preset: str = "",
    api_key: str | None = None,
) -> FastAPI:
    """Build the sidecar app.

    Args:
        sglang_url: base URL of the SGLang HTTP server, e.g. ``http://127.0.0.1:30000``.
        multiproc_dir: prometheus-client multiprocess folder shared with SGLang.
        health_timeout_s: seconds to wait for SGLang's ``/health``; ``None``: :func:`health_wait_s`.
        preset: preset name shown in ``/stats``.
        api_key: when set, every route but :data:`OPEN_ROUTES` answers 401 without
            ``Authorization: Bearer <api_key>``.
    """
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    app = FastAPI(title="dd_sglang metrics sidecar")
    wait_s = health_wait_s() if health_timeout_s is None else health_timeout_s
    started = time.monotonic()
    if api_key:
        _require_key(app, api_key)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(_registry(multiproc_dir)), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return await sglang_health(sglang_url, wait_s)

    @app.get("/stats")
    def stats() -> dict:
        return stats_snapshot(multiproc_dir, sglang_url, preset, time.monotonic() - started)

    return app


def _require_key(app: FastAPI, api_key: str) -> None:
    """Make every route of ``app`` but :data:`OPEN_ROUTES` answer 401 (``WWW-Authenticate: Bearer``)
    without ``Authorization: Bearer <api_key>``."""

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if request.url.path in OPEN_ROUTES or bearer_ok(request.headers.get("authorization"), api_key):
            return await call_next(request)
        return JSONResponse(
            {"error": "Unauthorized: send the server's --api-key as 'Authorization: Bearer <key>'"},
            401,
            headers={"WWW-Authenticate": "Bearer"},
        )


async def sglang_health(sglang_url: str, timeout_s: float) -> JSONResponse:
    """``/healthz``'s answer: 200 ``{"status": "ok"}`` when SGLang's ``/health`` answers 200 within
    ``timeout_s`` seconds, else 503 ``{"status": "unavailable", "detail": <reason>}``."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            r = await client.get(f"{sglang_url}/health")
    except httpx.HTTPError as err:
        return JSONResponse({"status": "unavailable", "detail": f"{type(err).__name__}: {err}"}, 503)
    if r.status_code != 200:
        return JSONResponse({"status": "unavailable", "detail": f"SGLang /health returned {r.status_code}"}, 503)
    return JSONResponse({"status": "ok"})


def stats_snapshot(multiproc_dir: str, sglang_url: str, preset: str, uptime_s: float) -> dict:
    """``/stats``'s JSON (module docstring): the ``dd_`` samples in ``multiproc_dir`` and the rates
    derived from them, with the SGLang URL, the preset name and the uptime (seconds, 3 decimals)."""
    samples = dd_samples(multiproc_dir)
    return {
        "preset": preset,
        "sglang_url": sglang_url,
        "uptime_seconds": round(uptime_s, 3),
        "prefetch_hit_rate": prefetch_hit_rates(samples),
        "prefetch_hit_rate_by_speculator": prefetch_hit_rates(samples, ("selector", "speculator")),
        "spec_acceptance_rate": acceptance_rates(samples),
        "metrics": samples,
    }


def main(argv: list[str] | None = None) -> int:
    """Serve the sidecar on an inherited listening socket until SIGINT/SIGTERM.

    ``python -m dd_sglang.metrics.sidecar --fd N --sglang-url URL --multiproc-dir DIR
    [--preset NAME]``; the API key, if any, comes from
    :data:`API_KEY_ENV`. The launcher (:mod:`dd_sglang.launch_server`) starts it.
    """
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m dd_sglang.metrics.sidecar")
    ap.add_argument("--fd", type=int, required=True, help="listening TCP socket inherited from the launcher")
    ap.add_argument("--sglang-url", required=True)
    ap.add_argument("--multiproc-dir", required=True)
    ap.add_argument("--preset", default="")
    args = ap.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    app = create_app(
        sglang_url=args.sglang_url,
        multiproc_dir=args.multiproc_dir,
        preset=args.preset,
        api_key=os.environ.get(API_KEY_ENV) or None,
    )
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
