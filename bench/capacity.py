"""Capacity benchmark: concurrent long requests in one device KV budget, dense vs ``dualdecoder``.

Usage::

    python -m bench.capacity [--out bench/results/capacity_cpu.json] [--requests 8]
                             [--max-total-tokens 8400] [--prompt-tokens 4200] [--new-tokens 32]
                             [--rounds 1]

For each backend (``torch_native``, ``dualdecoder``, then ``torch_native:room``),
in one run: start a dd_sglang server whose device KV pool holds ``--max-total-tokens``
tokens (8,400: two ~4k dense requests; ``:room``: every request at once, the dense
path given the memory the sparse path saves), send ``--requests`` distinct ~4k-token passkey prompts
at once (greedy, ``--new-tokens`` each, ``ignore_eos``), and sample the sidecar
every ``--sample-interval`` s (1 s; a scrape parses SGLang's and dd_sglang's whole
``/metrics`` text, and the server's sidecar builds it: at 0.2 s the bench process alone used
0.24 of a core on average over a run's first 12 minutes, on a machine whose two cores serve).

``--rounds R`` > 1 starts every backend's server first (all up at once, one busy at a time;
``dualdecoder`` and ``dualdecoder+SELECTOR`` share one server) and then runs R rounds; each
round sends every backend the same fresh prompts (new passkeys and headers), the backends'
order rotated by one each round, and every server's cache is flushed (``/flush_cache``) before
each run, so no run is served from another's radix cache or host tier. A ratio is then taken
within each round, between runs minutes apart, and the JSON gives its median over the rounds
with the per-round values (``rounds``): the machine's speed drifts by up to ~1.5x from hour to
hour here, which a single pass (backends one after another, each server started in turn)
folds into the ratio. ``dualdecoder+SELECTOR`` in ``--backends`` runs the ``dualdecoder``
server again with every request choosing that selector (``custom_params.dd_selector``).
Recorded per backend:

* ``peak_concurrent_decoding``: most requests decoding at once (dense: the
  ``DENSE`` running batch; dualdecoder: ``DECODE_SPARSE``);
* ``wall_seconds`` from the first send to the last answer, and
  ``output_tokens_per_second`` = all generated tokens / wall (``output_tokens``: each
  request's ``usage.completion_tokens``, streamed with ``include_usage``; text chunks,
  ``streamed_chunks``, can be fewer: a token whose text is held back arrives with the next);
* ``decode_tokens_per_second``: generated tokens after each request's first
  one, divided by the time from the first first-token to the last answer;
* ``steady_decode_tokens_per_second``: what the server delivers while its
  fullest batch decodes, prefills left out: ``c / g``, ``c`` the most requests
  decoding at once (from the streamed tokens: a request decodes from its first
  token to its last) and ``g`` the median gap between consecutive tokens of a
  request while ``c`` requests decode (a gap that holds another request's
  prefill is rare there and the median ignores it). With ``c`` = 2 for dense at
  the 8,400-token budget and 8 for ``dualdecoder``, the ratio of the two is the
  decode-step throughput ratio the same-budget goal asks about, without the 8
  prefills that are the same work on every backend;
* passkeys found, per-request latency, the peak of the per-request device
  slots (``dd_sparse_request_device_tokens_max``) and of the host tier's bytes;
* ``went_sparse``: requests that reached ``DECODE_SPARSE`` in the run (``OFFLOADING ->
  DECODE_SPARSE`` transitions; 0 for dense), and ``offloads_unpinned``: how many of those
  offloads found the pool too full for their resident set and gave up their own prompt in the
  radix tree (``dd_offload_unpinned_total``).

Results are JSON; nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.cli import write_result
from bench.machine import describe, machine_state, summary
from harness.prompts import passkey_prompt
from harness.server import delta, flush_when_idle, launch_server, scrape, transitions


def steady_decode(times: list[list[float]]) -> dict:
    """Decode throughput at the fullest batch, from each request's token arrival times (seconds,
    monotonic; a request decodes from its first token to its last).

    Returns ``steady_concurrency`` (``c``, the most requests decoding at once),
    ``steady_gap_seconds`` (median gap between a request's consecutive tokens, over the gaps
    that end while ``c`` requests decode) and ``steady_decode_tokens_per_second`` = ``c / gap``.
    Raises ValueError when no request streamed two tokens.
    """
    spans = [(t[0], t[-1]) for t in times if len(t) >= 2]
    if not spans:
        raise ValueError("steady_decode: no request streamed two tokens")

    def decoding(x: float) -> int:
        return sum(a <= x <= b for a, b in spans)

    c = max(decoding(a) for a, _ in spans)
    gaps = sorted(t[i] - t[i - 1] for t in times for i in range(1, len(t)) if decoding(t[i]) == c)
    g = gaps[len(gaps) // 2]
    return {"steady_concurrency": c, "steady_gap_seconds": round(g, 4),
            "steady_decode_tokens_per_second": round(c / g, 3)}  # fmt: skip


def backend_spec(spec: str) -> tuple[str, str, bool]:
    """``(attention backend, selector or "", room)`` of a ``--backends`` entry (module docstring).

    Raises ValueError naming ``--backends`` for an entry without a backend name.
    """
    backend, _, room = spec.partition(":")
    backend, _, selector = backend.partition("+")
    if not backend or room not in ("", "room"):
        raise ValueError(f"--backends: {spec!r} is not NAME, NAME+SELECTOR or NAME:room")
    return backend, selector, bool(room)


def launch_backend(backend: str, budget: int, env: dict[str, str] | None = None, dtype: str | None = None):
    """Launch a server with ``--attention-backend backend`` and a device KV pool of ``budget``
    tokens, its log in a fresh temporary folder, not waiting for it; returns ``(server, log path)``.
    ``env``: variables added to the launcher's environment (:func:`harness.server.launch_server`);
    ``dtype``: SGLang's ``--dtype`` (None: the launcher's choice for this host)."""
    log = Path(tempfile.mkdtemp(prefix="dd_capacity_")) / "server.log"
    extra = ["--attention-backend", backend, *(["--dtype", dtype] if dtype else [])]
    return launch_server(log, budget, extra, env=env), log


def stop_backend(spec: str, srv, log: Path) -> dict:
    """Stop ``srv``; a clean stop removes its log folder (else it stays for diagnosis)."""
    rc, alive = srv.stop()
    if rc == 0 and not alive:
        shutil.rmtree(log.parent, ignore_errors=True)
    else:
        print(f"{spec}: server log kept in {log}", file=sys.stderr)
    return {"exit_code": rc, "processes_left": alive}


def stop_backends(servers: dict, logs: dict[str, Path]) -> dict[str, dict]:
    """Stop every server of ``servers`` (name -> server; ``logs``: name -> its log path) with
    :func:`stop_backend`, each even if another's stop raised; name -> its shutdown record (or
    ``{"error": ...}``)."""
    out = {}
    for name, srv in servers.items():
        try:
            out[name] = stop_backend(name, srv, logs[name])
        except Exception as err:  # noqa: BLE001 - recorded; the next server is still stopped
            out[name] = {"error": repr(err)}
    return out


def room_budget(prompts: list[tuple[str, int, int]], new_tokens: int) -> int:
    """Device pool (tokens) with room for every request densely: prompts + new tokens + 512."""
    return sum(n for _, n, _ in prompts) + len(prompts) * new_tokens + 512


def run_backend(spec: str, prompts: list[tuple[str, int, int]], args) -> dict:
    """One server, all prompts at once, started and stopped here; see the module docstring."""
    budget = room_budget(prompts, args.new_tokens) if backend_spec(spec)[2] else args.max_total_tokens
    srv, log = launch_backend(backend_spec(spec)[0], budget)
    srv.wait_ready(900)
    try:
        out = run_round(spec, srv, prompts, args)
    finally:
        shutdown = stop_backend(spec, srv, log)
    return {"device_kv_budget_tokens": budget, "engine_start_seconds": round(srv.start_seconds, 1),
            "peak_rss_bytes": srv.peak_rss_bytes, "shutdown": shutdown, **out}  # fmt: skip


def run_round(spec: str, srv, prompts: list[tuple[str, int, int]], args) -> dict:
    """Send every prompt to the running server ``srv`` at once and measure (module docstring).

    ``spec``: a backend name, or ``name:room`` for a device pool with room for every request densely;
    ``dualdecoder+SELECTOR`` sends every request with ``custom_params.dd_selector`` = SELECTOR.
    """
    backend, selector, _ = backend_spec(spec)
    samples: list[tuple[float, dict]] = []
    done = threading.Event()
    results: list[dict] = [{} for _ in prompts]

    def sample():
        while not done.is_set():
            samples.append((time.monotonic(), scrape(srv.metrics_url)))
            time.sleep(args.sample_interval)

    def run(i: int, prompt: str, key: int):
        t0 = time.monotonic()
        text = ""
        payload = {"model": "x", "prompt": prompt, "max_tokens": args.new_tokens, "temperature": 0,
                   "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
        if selector:
            payload["custom_params"] = {"dd_selector": selector}
        times = []  # arrival of each non-empty text chunk (monotonic seconds)
        usage = None
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=payload, timeout=3600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    usage = data.get("usage") or usage
                    chunk = data["choices"][0]["text"] if data.get("choices") else ""
                    if chunk:
                        text += chunk
                        times.append(time.monotonic())
        results[i] = {"passkey": key, "answer": text[:40], "found": bool(re.match(rf"\s*{key}\b", text)),
                      "chunks": len(times), "tokens": usage["completion_tokens"] if usage else len(times), "start": t0,
                      "prompt_tokens": usage["prompt_tokens"] if usage else None,
                      "first_token": times[0] if times else None, "end": time.monotonic(), "times": times}  # fmt: skip

    before = scrape(srv.metrics_url)
    poller = threading.Thread(target=sample, daemon=True)
    poller.start()
    t0 = time.monotonic()
    workers = [threading.Thread(target=run, args=(i, p, k)) for i, (p, _, k) in enumerate(prompts)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.monotonic() - t0
    finally:
        done.set()
        poller.join()
    after = scrape(srv.metrics_url)
    state = "DECODE_SPARSE" if backend == "dualdecoder" else "DENSE"
    key = f'dd_dualpath_requests{{state="{state}"}}'
    tokens = sum(r["tokens"] for r in results)
    first = min(r["first_token"] for r in results)
    end = max(r["end"] for r in results)
    return {
        "found": sum(r["found"] for r in results),
        "total": len(results),
        "peak_concurrent_decoding": int(max(s.get(key, 0) for _, s in samples)),
        "peak_request_device_tokens": int(
            max(s.get("dd_sparse_request_device_tokens_max", 0) for _, s in samples)
        ),
        "peak_host_tier_used_bytes": int(max(s.get("dd_host_tier_used_bytes", 0) for _, s in samples)),
        "went_sparse": int(
            transitions(after, "OFFLOADING", "DECODE_SPARSE") - transitions(before, "OFFLOADING", "DECODE_SPARSE")
        ),
        "offloads_unpinned": int(delta(after, before, "dd_offload_unpinned_total")),
        "wall_seconds": round(wall, 2),
        "output_tokens": tokens,
        "streamed_chunks": sum(r["chunks"] for r in results),
        "output_tokens_per_second": round(tokens / wall, 3),
        "decode_tokens_per_second": round((tokens - len(results)) / (end - first), 3),
        **steady_decode([r["times"] for r in results]),
        "latency_seconds": [round(r["end"] - r["start"], 2) for r in results],
        "answers": [{"passkey": r["passkey"], "answer": r["answer"], "found": r["found"]} for r in results],
        "prompt_tokens_reported": [r["prompt_tokens"] for r in results],  # by the server (usage), per request
    }


def round_prompts(tok, r: int, args) -> list[tuple[str, int, int]]:
    """Round ``r``'s prompts ``(text, tokens, passkey)``: ``--requests`` ~``--prompt-tokens`` passkey
    prompts, depths spread evenly; round 0's are the single-pass run's, later rounds change each
    passkey and the header in the first line, so no round's prefix is cached from another's."""
    prompts = []
    for i in range(args.requests):
        key = 10000 + (7919 * (r * args.requests + i + 1)) % 90000
        header = f"Case {i}. " if r == 0 else f"Case {r}.{i}. "
        p, n = passkey_prompt(tok, args.prompt_tokens, (i + 0.5) / args.requests, key, header=header)
        prompts.append((p, n, key))
    return prompts


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def run_rounds(specs: list[str], rounds: list[list[tuple[str, int, int]]], args) -> dict[str, dict]:
    """Every backend's server up at once, then each round's prompts to each backend in turn, the
    order rotated by one a round (module docstring). Returns spec -> its server's figures, ``rounds``
    (one :func:`run_round` result a round) and the median of each rate over the rounds."""
    room = max(room_budget(p, args.new_tokens) for p in rounds)
    # one server per (backend, room): ``dualdecoder`` and ``dualdecoder+SELECTOR`` share one (the
    # selector is a per-request override), so both run on the same process and its warm caches
    kinds = {s: (backend_spec(s)[0], backend_spec(s)[2]) for s in specs}
    budgets = {k: room if k[1] else args.max_total_tokens for k in kinds.values()}
    servers = {}
    try:
        # launched together: start-ups are mostly single-threaded imports
        for kind, budget in budgets.items():
            servers[kind] = launch_backend(kind[0], budget)
        for srv, _ in servers.values():
            srv.wait_ready(900)
        per_round: dict[str, list[dict]] = {s: [] for s in specs}
        for r, prompts in enumerate(rounds):
            for spec in specs[r % len(specs) :] + specs[: r % len(specs)]:
                srv = servers[kinds[spec]][0]
                # nothing cached from the last run (dualdecoder+SELECTOR shares its prompts)
                flush_when_idle(srv)
                per_round[spec].append(run_round(spec, srv, prompts, args))
                print(
                    f"round {r} {spec}: steady {per_round[spec][-1]['steady_decode_tokens_per_second']} tok/s",
                    file=sys.stderr,
                )
    finally:
        shutdowns = {
            kind: stop_backend("+".join(map(str, kind)), srv, log) for kind, (srv, log) in servers.items()
        }
    runs = {}
    for spec in specs:
        srv, rr = servers[kinds[spec]][0], per_round[spec]
        runs[spec] = {
            "device_kv_budget_tokens": budgets[kinds[spec]], "engine_start_seconds": round(srv.start_seconds, 1),
            "peak_rss_bytes": srv.peak_rss_bytes, "shutdown": shutdowns[kinds[spec]],
            "found": sum(x["found"] for x in rr), "total": sum(x["total"] for x in rr),
            "peak_concurrent_decoding": max(x["peak_concurrent_decoding"] for x in rr),
            "went_sparse": sum(x["went_sparse"] for x in rr),
            "offloads_unpinned": sum(x["offloads_unpinned"] for x in rr),
            "output_tokens": sum(x["output_tokens"] for x in rr),
            "steady_concurrency": min(x["steady_concurrency"] for x in rr),
            **{k: round(_median([x[k] for x in rr]), 3) for k in RATES},
            "rounds": rr,
        }  # fmt: skip
    return runs


#: Rates a ratio is reported for: ``(JSON key prefix, figure)``.
RATIOS = (("", "output_tokens_per_second"), ("steady_decode_", "steady_decode_tokens_per_second"))
#: Per-round figures whose median over the rounds a multi-round run reports.
RATES = (
    "output_tokens_per_second",
    "decode_tokens_per_second",
    "steady_decode_tokens_per_second",
    "wall_seconds",
)


def ratios(runs: dict[str, dict]) -> dict:
    """Each sparse run over each dense baseline, whole run and steady decode
    (``dualdecoder_over_dense_same_budget``; ``dualdecoder_host_sync_over_...`` for
    ``dualdecoder+host_sync``). With rounds: the median of the per-round ratios, and under
    ``KEY_rounds`` each round's."""
    out = {}
    for spec, dd in runs.items():
        if not spec.startswith("dualdecoder") or ":" in spec:
            continue
        for prefix, metric in RATIOS:
            for base, name in (("torch_native", "same_budget"), ("torch_native:room", "with_room")):
                if base not in runs:
                    continue
                key = f"{prefix}{spec.replace('+', '_')}_over_dense_{name}"
                if "rounds" in dd:
                    per = [
                        a[metric] / b[metric] for a, b in zip(dd["rounds"], runs[base]["rounds"], strict=True)
                    ]
                    out[key] = round(_median(per), 3)
                    out[f"{key}_rounds"] = [round(x, 3) for x in per]
                else:
                    out[key] = round(dd[metric] / runs[base][metric], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__)
    ap.add_argument("--out", default="bench/results/capacity_cpu.json")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-total-tokens", type=int, default=8400)
    ap.add_argument("--prompt-tokens", type=int, default=4200, help="passkey_prompt size target (~4k tokens)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--sample-interval", type=float, default=1.0, help="seconds between sidecar scrapes")
    ap.add_argument("--rounds", type=int, default=1,
                    help="1: each backend's server started in turn; R > 1: all servers up at once, R rounds "
                         "of fresh prompts, backends rotated, ratios per round (module docstring)")  # fmt: skip
    ap.add_argument("--backends", default="torch_native,dualdecoder,torch_native:room",
                    help="backend names; name:room = a device pool with room for every request densely; "
                         "dualdecoder+SELECTOR = every request with custom_params.dd_selector SELECTOR")  # fmt: skip
    args = ap.parse_args(argv)
    specs = args.backends.split(",")
    if not 1 <= args.rounds <= 20:
        ap.error(f"--rounds must be in [1, 20], got {args.rounds}")
    if not 0.05 <= args.sample_interval <= 10:
        ap.error(f"--sample-interval must be in [0.05, 10] s, got {args.sample_interval}")
    if len(set(specs)) != len(specs):
        ap.error(f"--backends: an entry repeats in {args.backends!r}")
    for spec in specs:
        try:
            backend_spec(spec)
        except ValueError as err:
            ap.error(str(err))

    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    before = machine_state()
    print(summary(before), flush=True)

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    rounds = [round_prompts(tok, r, args) for r in range(args.rounds)]
    if args.rounds == 1:
        runs = {b: run_backend(b, rounds[0], args) for b in specs}
    else:
        runs = run_rounds(specs, rounds, args)
    result = {
        "benchmark": "concurrent ~4k-token requests in one device KV budget, dense vs dualdecoder (CPU)",
        "command": "python -m bench.capacity " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": describe(before, machine_state()),
        "device_kv_budget_tokens": args.max_total_tokens,
        "rounds": args.rounds,
        "prompt_tokens": [[n for _, n, _ in p] for p in rounds]
        if args.rounds > 1
        else [n for _, n, _ in rounds[0]],
        "new_tokens_per_request": args.new_tokens,
        "backends": runs,
        **ratios(runs),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, out)
    for b, r in runs.items():
        print(f"{b}: {r['found']}/{r['total']} passkeys, peak {r['peak_concurrent_decoding']} decoding at once, "
              f"{r['output_tokens_per_second']} out tok/s, {r['decode_tokens_per_second']} decode tok/s, "
              f"steady {r['steady_decode_tokens_per_second']} tok/s at {r['steady_concurrency']} decoding, "
              f"wall {r['wall_seconds']} s, {r['went_sparse']} went sparse ({r['offloads_unpinned']} unpinned)")  # fmt: skip
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
