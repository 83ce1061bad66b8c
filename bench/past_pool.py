"""A prompt longer than the device pool, served beside other requests, against dense with room (issue 54).

Usage::

    python -m bench.past_pool [--long-tokens 30000] [--side-tokens 4000] [--side 2] [--pool 8192]
                              [--new-tokens 24] [--out bench/results/past_pool_HOSTCLASS.json]

Two servers on the long-context preset ``cpu-smollm2-32k`` (dynamic NTK RoPE x4: 32,768 positions),
up together:

* ``sparse``: ``--attention-backend dualdecoder`` with a device pool of ``--pool`` tokens (8,192), far
  below the long prompt: SGLang alone refuses it with HTTP 400; here it is prefilled chunk by chunk
  through the host tier and decodes sparsely. ``--side`` requests of ~``--side-tokens`` tokens are sent
  at the same moment;
* ``dense``: SGLang's ``torch_native`` with the preset's pool (36,864 tokens: room for the whole prompt),
  the long prompt alone.

Each answers the long passkey prompt greedily (``--new-tokens``); recorded: the text and token ids of
both, whether each found the pass key, how many leading tokens agree, the sparse server's peak device
KV held (``peak_device_kv_in_use_bytes``: the sidecar's gauge, refreshed after each batch and sampled
every 0.25 s, so what is held between batches, not inside one) against its pool, the side requests'
pass keys, latencies.
Issue 54's check: the pass key found by both, or the first 16 tokens equal. JSON with provenance.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.capacity import stop_backends
from bench.cli import check_ranges, write_result
from bench.machine import command_line, host
from harness.prompts import passkey_prompt
from harness.server import launch_server, scrape

PRESET = "cpu-smollm2-32k"


def ask(url: str, prompt: str, n: int, out: dict, key: int) -> None:
    """Greedy ``/v1/completions`` of ``n`` tokens; fills ``out`` (status, text, prompt tokens, seconds, found)."""
    t0 = time.monotonic()
    body = {"model": "x", "prompt": prompt, "max_tokens": n, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=7200)
    out["status"] = r.status_code
    if r.status_code != 200:
        out["error"] = r.text[:400]
        return
    data = r.json()
    out.update(text=data["choices"][0]["text"], prompt_tokens=data["usage"]["prompt_tokens"],
               seconds=round(time.monotonic() - t0, 1),
               found=bool(re.match(rf"\s*{key}\b", data["choices"][0]["text"])))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.past_pool", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--long-tokens", type=int, default=30000)
    ap.add_argument("--side-tokens", type=int, default=4000)
    ap.add_argument("--side", type=int, default=2)
    ap.add_argument("--pool", type=int, default=8192, help="the sparse server's device pool (tokens)")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    check_ranges(ap, args, (("long_tokens", 1000, 32000), ("side_tokens", 200, 8000), ("side", 0, 8),
                            ("pool", 1024, 1_000_000), ("new_tokens", 16, 512)))  # fmt: skip
    from transformers import AutoTokenizer

    from dd_sglang.config import load_config
    from dd_sglang.models.smollm2 import prepare_model

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    long_prompt, long_n = passkey_prompt(tok, args.long_tokens, 0.35, 73519, header="Past the pool. ")
    sides = [passkey_prompt(tok, args.side_tokens, (i + 0.5) / max(args.side, 1), 20011 + 977 * i,
                            header=f"Beside it {i}. ") for i in range(args.side)]  # fmt: skip
    command = "python -m bench.past_pool " + " ".join(argv) if argv is not None else command_line()
    dense_pool = load_config(PRESET).server.max_total_tokens
    servers, logs = {}, {}
    for name, backend, pool in (("sparse", "dualdecoder", args.pool), ("dense", "torch_native", dense_pool)):
        log = Path(tempfile.mkdtemp(prefix="dd_past_pool_")) / "server.log"
        servers[name] = launch_server(log, pool, ["--dd-config", PRESET, "--attention-backend", backend])
        logs[name] = log
    result: dict = {}
    try:
        for srv in servers.values():
            srv.wait_ready(900)
        sp = servers["sparse"]
        peak, done = {"bytes": 0.0, "pool_bytes": 0.0}, threading.Event()

        def sample():
            while not done.is_set():
                m = scrape(sp.metrics_url)
                used = m.get("dd_device_kv_used_bytes", 0.0) - m.get("dd_device_kv_evictable_bytes", 0.0)
                peak["bytes"] = max(peak["bytes"], used)
                peak["pool_bytes"] = m.get("dd_device_kv_capacity_bytes", peak["pool_bytes"])
                time.sleep(0.25)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        runs = {"long": {}, **{f"side{i}": {} for i in range(args.side)}}
        work = [threading.Thread(target=ask, args=(sp.url, long_prompt, args.new_tokens, runs["long"], 73519))]
        work += [threading.Thread(target=ask, args=(sp.url, p, args.new_tokens, runs[f"side{i}"], 20011 + 977 * i))
                 for i, (p, _) in enumerate(sides)]  # fmt: skip
        for w in work:
            w.start()
        for w in work:
            w.join()
        done.set()
        sampler.join()
        dense: dict = {}
        ask(servers["dense"].url, long_prompt, args.new_tokens, dense, 73519)
        a, b = tok.encode(runs["long"].get("text", "")), tok.encode(dense.get("text", ""))
        agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        result = {
            "benchmark": "a prompt longer than the device pool, beside other requests, against dense with room (CPU)",
            "command": command, "preset": PRESET, "long_prompt_tokens": long_n,
            "sparse_pool_tokens": args.pool, "dense_pool_tokens": dense_pool,
            "sparse": runs, "dense": dense, "leading_tokens_equal": agree,
            "peak_device_kv_in_use_bytes": int(peak["bytes"]), "device_kv_capacity_bytes": int(peak["pool_bytes"]),
            "check": {"pass_key_found_by_both": bool(runs["long"].get("found") and dense.get("found")),
                      "first_16_tokens_equal": agree >= 16},
        }  # fmt: skip
    finally:
        result["shutdown"] = stop_backends(servers, logs)
    out = Path(args.out or f"bench/results/past_pool_{host()['host_class']}.json")
    write_result(result, out)
    print(result.get("check"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
