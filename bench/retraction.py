"""Retraction check: SGLang retracting sparse requests mid-decode (``dualdecoder``, CPU).

Usage::

    python -m bench.retraction [--out bench/results/retraction_cpu.json] [--requests 3]
                               [--prompt-tokens 2000] [--new-tokens 48] [--interval 3]
                               [--policy always|pressure]

When its device pool cannot hold the next decode step, SGLang retracts running requests
(``ScheduleBatch.retract_decode``, ``sglang/srt/managers/scheduler.py``): their KV is released and
they are queued again, to be prefilled anew from their prompt and the tokens generated so far. A
sparse request's KV lives mostly in the host tier, and dd_sglang's release callback frees it there;
the request then prefills densely again and leaves the dense path again. A full pool is hard to
provoke on purpose, so this starts one ``dualdecoder`` server with SGLang's own test switch
``SGLANG_TEST_RETRACT=1`` (``SGLANG_TEST_RETRACT_INTERVAL`` = ``--interval``: retract every
``interval`` forward passes, ``sglang/srt/environ.py``), sends ``--requests`` distinct passkey
prompts at once (greedy, ``ignore_eos``), and records: the retractions SGLang logged, the DualPath
transitions, whether each answer opens with its passkey, and the idle accounting afterwards (device
KV used equal to the radix tree's evictable cache, host tier used equal to its prefix cache, no
resident bytes, no request in any DualPath state). ``ok`` is true when all of these hold. JSON;
nothing here is a timed test.

``--policy pressure`` sends every request with ``custom_params.dd_policy: pressure`` (issue 40):
with a pool that holds fewer of them densely than ``--requests``, admission offloads running dense
requests to the host tier while SGLang retracts others, so retractions land before, during and
after pressure offloads. Recorded besides: path changes by reason and pressure offloads by trigger
(sidecar counter deltas); ``ok`` then also needs at least one pressure offload.
"""

from __future__ import annotations

import re
import sys
import threading
import time

import httpx

from bench.capacity import launch_backend, stop_backend
from bench.cli import check_ranges, long_request_parser, write_result
from bench.machine import measured
from harness.prompts import passkey_prompt
from harness.server import scrape

STATES = ("DENSE", "PREFILL_FULL", "OFFLOADING", "DECODE_SPARSE", "REBUILD")


def _idle(m: dict) -> dict:
    """The idle accounting of a scrape (module docstring); every value must hold for ``ok``."""
    return {
        "device_kv_used_is_evictable_cache": m["dd_device_kv_used_bytes"] == m["dd_device_kv_evictable_bytes"],
        "host_tier_used_is_prefix_cache": m["dd_host_tier_used_bytes"] == m["dd_host_tier_prefix_cache_bytes"],
        "resident_bytes": m.get("dd_sparse_resident_bytes", 0.0),
        "requests_in_a_state": sum(m.get(f'dd_dualpath_requests{{state="{s}"}}', 0.0) for s in STATES),
    }


def run(args) -> dict:
    """Start the server, send the requests, wait for them, read the log and metrics, stop."""
    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    tok = AutoTokenizer.from_pretrained(str(prepare_model(progress=False)))
    keys = [10000 + 7919 * i for i in range(args.requests)]
    prompts = [passkey_prompt(tok, args.prompt_tokens, (i + 0.5) / args.requests, k, header=f"Case {i}. ")[0]
               for i, k in enumerate(keys)]  # fmt: skip
    env = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": str(args.interval)}
    srv, log = launch_backend("dualdecoder", args.max_total_tokens, env=env)
    answers: list[str] = [""] * args.requests

    def ask(i: int) -> None:
        body = {"model": "x", "prompt": prompts[i], "max_tokens": args.new_tokens, "temperature": 0,
                "ignore_eos": True, **({"custom_params": {"dd_policy": args.policy}} if args.policy else {})}  # fmt: skip
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=3600)
        answers[i] = r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}: {r.text}"

    try:
        srv.wait_ready(900)
        before = scrape(srv.metrics_url)
        t0 = time.monotonic()
        workers = [threading.Thread(target=ask, args=(i,)) for i in range(args.requests)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.monotonic() - t0
        time.sleep(2.0)  # the sidecar's gauges follow the scheduler's release
        after = scrape(srv.metrics_url)
        text = log.read_text()
    finally:
        shutdown = stop_backend("dualdecoder", srv, log)
    transitions = {k.split("{", 1)[1].rstrip("}"): int(v - before.get(k, 0.0)) for k, v in after.items()
                   if k.startswith("dd_dualpath_transitions_total{") and v - before.get(k, 0.0)}  # fmt: skip
    grew = {k: int(v - before.get(k, 0.0)) for k, v in after.items()
            if k.startswith(("dd_dualpath_path_changes_total{", "dd_pressure_offloads_total{"))}  # fmt: skip
    pressure_offloads = sum(v for k, v in grew.items() if k.startswith("dd_pressure_offloads_total{"))
    found = [bool(re.match(rf"\s*{k}\b", a)) for k, a in zip(keys, answers, strict=True)]
    idle = _idle(after)
    retractions = text.count("Testing retraction.")
    errors = [line for line in text.splitlines() if "Traceback" in line][:5]
    ok = (all(found) and retractions > 0 and not errors and idle["device_kv_used_is_evictable_cache"]
          and idle["host_tier_used_is_prefix_cache"] and idle["resident_bytes"] == 0
          and idle["requests_in_a_state"] == 0 and (args.policy != "pressure" or pressure_offloads > 0))  # fmt: skip
    return {"ok": ok, "retractions_logged": retractions, "tracebacks": errors, "transitions": transitions,
            "policy": args.policy, "path_changes_and_pressure_offloads": grew,
            "passkeys_found": sum(found), "answers": [a[:40] for a in answers], "idle_after": idle,
            "wall_seconds": round(wall, 1), "engine_start_seconds": round(srv.start_seconds, 1),
            "shutdown": shutdown}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = long_request_parser("python -m bench.retraction", __doc__, "bench/results/retraction_cpu.json", 3, 2000)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--interval", type=int, default=3, help="SGLANG_TEST_RETRACT_INTERVAL (forward passes)")
    ap.add_argument("--policy", choices=["always", "pressure"], default=None,
                    help="custom_params.dd_policy of every request (default: the preset's)")
    args = ap.parse_args(argv)
    check_ranges(ap, args, (("requests", 1, 64), ("prompt_tokens", 256, 10**6), ("new_tokens", 1, 65536),
                            ("interval", 1, 10**6), ("max_total_tokens", 256, 10**7)))  # fmt: skip
    fig = measured("SGLang's test retraction with sparse requests decoding (dualdecoder, CPU)",
                   "python -m bench.retraction " + " ".join(sys.argv[1:] if argv is None else argv),
                   lambda: {"requests": args.requests, "new_tokens": args.new_tokens, "interval": args.interval,
                            **run(args)})  # fmt: skip
    write_result(fig, args.out)
    print(f"ok {fig['ok']}: {fig['retractions_logged']} retractions, {fig['passkeys_found']}/{args.requests} "
          f"passkeys, idle {fig['idle_after']}")  # fmt: skip
    return 0 if fig["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
