"""Admission benchmark: long requests with a large ``max_tokens`` in one device KV budget (``dualdecoder``).

Usage::

    python -m bench.admission [--out bench/results/admission_cpu.json] [--requests 8]
                              [--prompt-tokens 4200] [--max-tokens 2048] [--max-total-tokens 8400]
                              [--seconds 150] [--sample-interval 2] [--policies always,pressure]

SGLang admits a prefill only when its device pool would also hold what every running request may
still generate (``min(max_tokens - generated, 4096)`` tokens each with ``ignore_eos``,
``sglang/srt/managers/schedule_policy.py``). A ``DECODE_SPARSE`` request never holds more than its
resident bound, and dd_sglang's admission hook (``patches/managers_schedule_policy.py``) reserves
only what it can still add. This starts one ``dualdecoder`` server with a pool of
``--max-total-tokens``, sends ``--requests`` distinct ~``--prompt-tokens`` passkey prompts at once
(greedy, streamed, ``ignore_eos``, ``max_tokens`` = ``--max-tokens``), samples the sidecar every
``--sample-interval`` s for ``--seconds`` s (or until every request decodes), then closes the
streams (SGLang aborts the requests) and stops the server. Recorded: the timeline of requests in
``DECODE_SPARSE``, the peak, and the seconds until all were decoding at once (null if never),
whether the hook was registered in this checkout (``admission_hook``), and the machine.

``--policies always,pressure`` runs one round per DualPath policy on the same server, one after
the other (each request names it: ``custom_params.dd_policy``), each for the whole ``--seconds``:
per policy, the peak of requests admitted and decoding sparsely at once, the seconds until all
were admitted, output tokens/s over the round, path changes by reason and pressure offloads by
trigger (sidecar counter deltas), and ``pressure_over_always_tokens_per_s``.
Results are JSON; nothing here is a pass/fail test.
"""

from __future__ import annotations

import sys
import threading
import time

import httpx

from bench.capacity import launch_backend, stop_backend
from bench.cli import check_ranges, long_request_parser, write_result
from bench.machine import measured
from harness.prompts import passkey_prompt
from harness.server import scrape

SPARSE = 'dd_dualpath_requests{state="DECODE_SPARSE"}'
POLICIES = ("always", "pressure")


def admitted(samples: dict[str, float]) -> int:
    """Requests admitted now (every ``dd_dualpath_requests`` state but ``FINISHED``)."""
    return int(sum(v for k, v in samples.items() if k.startswith("dd_dualpath_requests{") and "FINISHED" not in k))


def run_round(srv, prompts, args, policy: str | None) -> dict:
    """Send every prompt at once (``custom_params.dd_policy`` = ``policy`` unless None), sample the
    sidecar every ``--sample-interval`` s for ``--seconds`` s, then close the streams (SGLang aborts
    the requests). With ``policy`` None the round ends early once every request decodes sparsely
    (this benchmark's first question); with a policy it runs the whole ``--seconds``, so the output
    tokens/s of two policies cover the same window. Tokens are counted as streamed chunks (SGLang
    streams one token per chunk by default)."""
    from harness.server import flush_when_idle, wait_idle

    stop = threading.Event()
    tokens = [0] * len(prompts)

    def stream(i: int, prompt: str) -> None:
        body = {"model": "x", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip
        if policy is not None:
            body["custom_params"] = {"dd_policy": policy}
        try:
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=3600) as r:
                for line in r.iter_lines():
                    if stop.is_set():
                        return
                    if line.startswith("data: {"):
                        tokens[i] += 1
        except httpx.HTTPError:
            return

    before = flush_when_idle(srv)
    timeline: list[tuple[float, int, int]] = []
    workers = [threading.Thread(target=stream, args=(i, p), daemon=True) for i, (p, _) in enumerate(prompts)]
    t0 = time.monotonic()
    for w in workers:
        w.start()
    while time.monotonic() - t0 < args.seconds:
        m = scrape(srv.metrics_url)
        timeline.append((round(time.monotonic() - t0, 1), int(m.get(SPARSE, 0)), admitted(m)))
        if policy is None and timeline[-1][1] == args.requests:
            break
        time.sleep(args.sample_interval)
    elapsed = time.monotonic() - t0
    n_tokens = sum(tokens)
    stop.set()
    for w in workers:
        w.join(60)
    after = wait_idle(srv)
    grew = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    return {"peak_decode_sparse": max(n for _, n, _ in timeline),
            "peak_admitted": max(n for _, _, n in timeline),
            "seconds_until_all_decode_sparse": next((t for t, n, _ in timeline if n == args.requests), None),
            "seconds_until_all_admitted": next((t for t, _, n in timeline if n == args.requests), None),
            "output_tokens": n_tokens, "seconds": round(elapsed, 1),
            "output_tokens_per_s": round(n_tokens / elapsed, 3),
            "path_changes": {r: grew(f'dd_dualpath_path_changes_total{{reason="{r}"}}')
                             for r in ("length", "pressure", "request")},
            "pressure_offloads": {t: grew(f'dd_pressure_offloads_total{{trigger="{t}"}}')
                                  for t in ("admission", "retraction")},
            "timeline_t_sparse_admitted": timeline}  # fmt: skip


def run(args) -> dict:
    """Start the server, run one round per policy (or the original round), stop; the JSON's figures."""
    from transformers import AutoTokenizer

    import patches
    from dd_sglang.models.smollm2 import prepare_model

    tok = AutoTokenizer.from_pretrained(str(prepare_model(progress=False)))
    prompts = [passkey_prompt(tok, args.prompt_tokens, (i + 0.5) / args.requests, 10000 + 7919 * i,
                              header=f"Case {i}. ") for i in range(args.requests)]  # fmt: skip
    srv, log = launch_backend("dualdecoder", args.max_total_tokens)
    rounds: dict = {}
    try:
        srv.wait_ready(900)
        for policy in args.policies or [None]:
            rounds[policy or "preset"] = run_round(srv, prompts, args, policy)
    finally:
        shutdown = stop_backend("dualdecoder", srv, log)
    out = {"admission_hook": "patches.managers_schedule_policy" in patches.MODULES,
           "prompt_tokens": [n for _, n in prompts], "engine_start_seconds": round(srv.start_seconds, 1),
           "shutdown": shutdown}  # fmt: skip
    if not args.policies:  # the original figures, at the top level
        first = rounds["preset"]
        out.update({k: first[k] for k in ("peak_decode_sparse", "seconds_until_all_decode_sparse")})
        out["timeline"] = [(t, n) for t, n, _ in first["timeline_t_sparse_admitted"]]
        return out
    out["policies"] = rounds
    if {"always", "pressure"} <= rounds.keys() and rounds["always"]["output_tokens_per_s"]:
        out["pressure_over_always_tokens_per_s"] = round(
            rounds["pressure"]["output_tokens_per_s"] / rounds["always"]["output_tokens_per_s"], 3
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = long_request_parser("python -m bench.admission", __doc__, "bench/results/admission_cpu.json", 8, 4200)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=150.0)
    ap.add_argument("--sample-interval", type=float, default=2.0)
    ap.add_argument("--policies", default="",
                    help="comma-separated DualPath policies to run side by side on one server, each request "
                    "naming it (custom_params.dd_policy), the whole --seconds each: e.g. always,pressure. "
                    "Empty (default): one round under the preset's policy, ended once all decode sparsely.")
    args = ap.parse_args(argv)
    args.policies = [p for p in args.policies.split(",") if p]
    if bad := [p for p in args.policies if p not in POLICIES]:
        ap.error(f"--policies must name only {list(POLICIES)}, got {bad}")
    check_ranges(ap, args, (("requests", 1, 64), ("prompt_tokens", 256, 10**6), ("max_tokens", 1, 65536),
                            ("max_total_tokens", 256, 10**7), ("seconds", 1, 3600),
                            ("sample_interval", 0.1, 60)))  # fmt: skip
    result = measured("long requests with a large max_tokens in one device KV budget (dualdecoder, CPU)",
                      "python -m bench.admission " + " ".join(sys.argv[1:] if argv is None else argv),
                      lambda: {"device_kv_budget_tokens": args.max_total_tokens, "requests": args.requests,
                               "max_tokens": args.max_tokens, **run(args)})  # fmt: skip
    write_result(result, args.out)
    if not args.policies:
        print(f"admission hook {result['admission_hook']}: peak {result['peak_decode_sparse']} of {args.requests} "
              f"decoding sparsely at once, all at {result['seconds_until_all_decode_sparse']} s")  # fmt: skip
    for policy, r in result.get("policies", {}).items():
        print(f"{policy}: peak {r['peak_admitted']} of {args.requests} admitted at once (all at "
              f"{r['seconds_until_all_admitted']} s), {r['output_tokens_per_s']} output tokens/s, "
              f"path changes {r['path_changes']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
