"""Admission benchmark: long requests with a large ``max_tokens`` in one device KV budget (``dualdecoder``).

Usage::

    python -m bench.admission [--out bench/results/admission_cpu.json] [--requests 8]
                              [--prompt-tokens 4200] [--max-tokens 2048] [--max-total-tokens 8400]
                              [--seconds 150] [--sample-interval 2]

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
Results are JSON; nothing here is a pass/fail test.
"""

from __future__ import annotations

import sys
import threading
import time

import httpx

from bench.capacity import launch_backend, stop_backend
from bench.client import check_ranges, long_request_parser, write_result
from bench.machine import measured
from bench.prompts import passkey_prompt
from bench.server import scrape

SPARSE = 'dd_dualpath_requests{state="DECODE_SPARSE"}'


def run(args) -> dict:
    """Start the server, send the requests, sample, abort, stop; the JSON's figures (module docstring)."""
    from transformers import AutoTokenizer

    import patches
    from dd_sglang.models.smollm2 import prepare_model

    tok = AutoTokenizer.from_pretrained(str(prepare_model(progress=False)))
    prompts = [passkey_prompt(tok, args.prompt_tokens, (i + 0.5) / args.requests, 10000 + 7919 * i,
                              header=f"Case {i}. ") for i in range(args.requests)]  # fmt: skip
    srv, log = launch_backend("dualdecoder", args.max_total_tokens)
    stop = threading.Event()

    def stream(prompt: str) -> None:
        body = {"model": "x", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=3600) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            return

    timeline: list[tuple[float, int]] = []
    try:
        srv.wait_ready(900)
        workers = [threading.Thread(target=stream, args=(p,), daemon=True) for p, _ in prompts]
        t0 = time.monotonic()
        for w in workers:
            w.start()
        while time.monotonic() - t0 < args.seconds:
            timeline.append((round(time.monotonic() - t0, 1), int(scrape(srv.metrics_url).get(SPARSE, 0))))
            if timeline[-1][1] == args.requests:
                break
            time.sleep(args.sample_interval)
        stop.set()
        for w in workers:
            w.join(60)
    finally:
        shutdown = stop_backend("dualdecoder", srv, log)
    all_at = next((t for t, n in timeline if n == args.requests), None)
    return {"admission_hook": "patches.managers_schedule_policy" in patches.MODULES,
            "prompt_tokens": [n for _, n in prompts], "peak_decode_sparse": max(n for _, n in timeline),
            "seconds_until_all_decode_sparse": all_at, "timeline": timeline,
            "engine_start_seconds": round(srv.start_seconds, 1), "shutdown": shutdown}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = long_request_parser("python -m bench.admission", __doc__, "bench/results/admission_cpu.json", 8, 4200)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=150.0)
    ap.add_argument("--sample-interval", type=float, default=2.0)
    args = ap.parse_args(argv)
    check_ranges(ap, args, (("requests", 1, 64), ("prompt_tokens", 256, 10**6), ("max_tokens", 1, 65536),
                            ("max_total_tokens", 256, 10**7), ("seconds", 1, 3600),
                            ("sample_interval", 0.1, 60)))  # fmt: skip
    result = measured("long requests with a large max_tokens in one device KV budget (dualdecoder, CPU)",
                      "python -m bench.admission " + " ".join(sys.argv[1:] if argv is None else argv),
                      lambda: {"device_kv_budget_tokens": args.max_total_tokens, "requests": args.requests,
                               "max_tokens": args.max_tokens, **run(args)})  # fmt: skip
    write_result(result, args.out)
    print(f"admission hook {result['admission_hook']}: peak {result['peak_decode_sparse']} of {args.requests} "
          f"decoding sparsely at once, all at {result['seconds_until_all_decode_sparse']} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
