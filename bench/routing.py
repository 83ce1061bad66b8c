"""Cached tokens of a chat session's second turn behind ``smg``: ``cache_aware`` vs ``round_robin``.

``python -m bench.routing [--sessions 8] [--turn-tokens 1500] [--cap 4096]``

Two ``dualdecoder`` workers (device pools of ``--cap`` tokens each, so a
worker's device holds about one turn 2 and one turn 1 of ~1.5k tokens each) behind two gateways started
side by side in front of the same workers: ``cache_aware`` and
``round_robin``. For each policy, ``--sessions`` two-turn chat sessions
(turn 1: ~``--turn-tokens`` tokens with a pass key; turn 2: turn 1, its
answer, ~``--turn-tokens`` more tokens and a question about the pass key)
are sent one request at a time in a seeded random order in which each
session's turn 1 precedes its turn 2, so other sessions' turns run in
between and push turn 1 off the device. Between policies the workers'
caches (device radix tree and host tier) are flushed and new session texts
are used.

Per session: the worker of each turn (from the workers' own request
counters), turn 2's ``cached_tokens`` (SGLang's ``--enable-cache-report``),
the host-tier tokens reloaded for it (``dd_host_tier_rebuilt_tokens_total``
of its worker), whether the answer holds the pass key. Written to
``bench/results/routing_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from bench.cli import write_result
from harness.client import post_chat
from harness.gateway import served_by, start_gateway
from harness.prompts import FILLER, passkey_prompt
from harness.server import ROOT, scrape

ANSWER = "The pass key is "  # the trailing space: the model then answers with the digits (without it, " the pass key..." in float32)
RESULT = ROOT / "bench" / "results" / "routing_cpu.json"


def _chat(url: str, messages: list[dict], max_tokens: int) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = post_chat(url, messages, max_tokens)
    r.raise_for_status()
    return r.json(), time.perf_counter() - t0


def _rebuilt(gw, w: int) -> float:
    return scrape(gw.metrics_urls[w]).get("dd_host_tier_rebuilt_tokens_total", 0.0)


def run_policy(gw, url: str, tokenizer, sessions: int, turn_tokens: int, seed: int, tag: str) -> list[dict]:
    """Run ``sessions`` two-turn sessions through the gateway at ``url``; one record per session."""
    rng = random.Random(seed)
    per = len(tokenizer.encode(FILLER))
    keys = [rng.randrange(10000, 99999) for _ in range(sessions)]
    state: list[dict] = [{} for _ in range(sessions)]
    order = list(range(sessions)) * 2
    rng.shuffle(order)
    seen: set[int] = set()
    events = []  # a session's first appearance is its turn 1, the second its turn 2
    for s in order:
        events.append((s, 2 if s in seen else 1))
        seen.add(s)
    for s, turn in events:
        st = state[s]
        if turn == 1:
            text, _ = passkey_prompt(tokenizer, turn_tokens, rng.uniform(0.2, 0.8), keys[s],
                                     header=f"{tag} session {s}: notes of case {rng.randrange(10**6)}. ")  # fmt: skip
            st["user1"] = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            msgs = [{"role": "user", "content": st["user1"]}, {"role": "assistant", "content": ANSWER}]
            before = gw.requests_served()
            r, _ = _chat(url, msgs, 8)
            st.update(worker1=served_by(gw, before), n1=r["usage"]["prompt_tokens"],
                      reply1=r["choices"][0]["message"]["content"])  # fmt: skip
        else:
            user2 = (
                f"{tag} session {s}, more text. " + FILLER * (turn_tokens // per) + "\nWhat was the pass key?"
            )
            msgs = [
                {"role": "user", "content": st["user1"]},
                {"role": "assistant", "content": ANSWER + st["reply1"]},
                {"role": "user", "content": user2},
                {"role": "assistant", "content": ANSWER},
            ]
            before = gw.requests_served()
            rebuilt_before = [_rebuilt(gw, w) for w in range(len(gw.metrics_urls))]
            r, seconds = _chat(url, msgs, 8)
            w2 = served_by(gw, before)
            st.update(
                worker2=w2,
                n2=r["usage"]["prompt_tokens"],
                cached2=r["usage"]["prompt_tokens_details"]["cached_tokens"],
                rebuilt2=_rebuilt(gw, w2) - rebuilt_before[w2],
                seconds2=round(seconds, 2),
                passkey2=str(keys[s]) in r["choices"][0]["message"]["content"],
            )
    out = []
    for s, st in enumerate(state):
        out.append({k: v for k, v in st.items() if k not in ("user1", "reply1")} | {"session": s})
    return out


def summarize(records: list[dict]) -> dict:
    return {
        "sessions": len(records),
        "same_worker": sum(r["worker1"] == r["worker2"] for r in records),
        "turn2_cached_tokens_mean": round(statistics.mean(r["cached2"] for r in records), 1),
        "turn2_cached_tokens_min": min(r["cached2"] for r in records),
        "turn1_prompt_tokens_mean": round(statistics.mean(r["n1"] for r in records), 1),
        "turn2_cached_at_least_turn1": sum(r["cached2"] >= r["n1"] for r in records),
        "turn2_host_tier_reloaded_tokens_mean": round(statistics.mean(r["rebuilt2"] for r in records), 1),
        "turn2_seconds_mean": round(statistics.mean(r["seconds2"] for r in records), 2),
        "passkeys_found": sum(r["passkey2"] for r in records),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument(
        "--turn-tokens", type=int, default=1500, help="~tokens per user turn (>= min_sparse_len 1024)"
    )
    ap.add_argument("--cap", type=int, default=4096, help="device KV pool per worker (tokens)")
    ap.add_argument(
        "--host-tier-bytes", type=int, default=768 * 1024**2, help="per worker (17k float32 tokens)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    tmp = Path(tempfile.mkdtemp(prefix="dd_bench_routing_"))
    preset = yaml.safe_load((ROOT / "configs" / "cpu-smollm2.yaml").read_text())
    preset["sparse"]["host_tier_bytes"] = args.host_tier_bytes
    (tmp / "preset.yaml").write_text(yaml.safe_dump(preset))
    worker_args = ["--attention-backend", "dualdecoder", "--enable-cache-report", "--max-total-tokens",
                   str(args.cap), "--dd-config", str(tmp / "preset.yaml")]  # fmt: skip
    gw = start_gateway(tmp / "router_cache_aware.log", worker_args, workers=2, policy="cache_aware")
    print(f"workers and cache_aware gateway ready in {gw.start_seconds:.0f} s", flush=True)
    rr = start_gateway(tmp / "router_round_robin.log", [], policy="round_robin", worker_urls=gw.worker_urls)
    results = {}
    try:
        for i, (policy, url) in enumerate((("cache_aware", gw.url), ("round_robin", rr.url))):
            for w in gw.worker_urls:
                httpx.post(f"{w}/flush_cache", timeout=60).raise_for_status()
            t0 = time.monotonic()
            records = run_policy(gw, url, tokenizer, args.sessions, args.turn_tokens, args.seed + i, policy)
            results[policy] = {"summary": summarize(records), "sessions": records,
                               "wall_seconds": round(time.monotonic() - t0, 1)}  # fmt: skip
            print(policy, json.dumps(results[policy]["summary"]), flush=True)
    finally:
        rr.stop()
        gw.stop()
    report = {
        "what": "2 dualdecoder workers behind smg; per session: turn 2's cached tokens, by gateway policy",
        "machine": "2 CPU cores, shared with other jobs (seconds are noisy; compare within one run)",
        "workers": 2,
        "device_pool_tokens_per_worker": args.cap,
        "host_tier_bytes_per_worker": args.host_tier_bytes,
        "turn_tokens": args.turn_tokens,
        "smg_version": _smg_version(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(report, args.out)
    print(f"wrote {args.out}")
    return 0


def _smg_version() -> str:
    from importlib.metadata import version

    return version("smg")


if __name__ == "__main__":
    raise SystemExit(main())
