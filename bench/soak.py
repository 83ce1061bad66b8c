"""Soak benchmark: resident memory per server process under steady mixed traffic (issue 44).

Usage::

    python -m bench.soak [--backend dense|dualdecoder] [--requests 2000] [--round 100]
                         [--clients 4] [--seconds 3600] [--max-total-tokens 6000]
                         [--chunked-prefill-size 256] [--host-tier-mb 300] [--new-tokens 16]
                         [--words 500 900 | --tokens 100 6000] [--warmup 500] [--seed 0]
                         [--env NAME=VALUE ...]
                         [--probe] [--out bench/results/soak_BACKEND_HOSTCLASS.json] [--plot PATH.png]

Starts one server (``python -m dd_sglang.launch_server`` on free loopback ports, a preset whose
host tier is ``--host-tier-mb`` MiB, ``--max-total-tokens``, ``--chunked-prefill-size``,
``--enable-cache-report``; ``dualdecoder`` adds ``--attention-backend dualdecoder``, ``dense``
is the same launcher without it), then sends ``--requests`` requests in rounds of ``--round``
from ``--clients`` concurrent clients (OpenAI ``/v1/completions``):

* a prompt of a uniform ``--words`` (inclusive range) whitespace-split words of Debian's licence
  texts (:func:`harness.texts.license_words`) from a random start; or, with ``--tokens MIN MAX``
  (issue 52's mix), a uniform number of tokens in that range, cut from those texts tokenised once
  with the embedded model's tokenizer and sent as token ids, so nearly every request is a prompt
  length the server has not seen;
* two in three answered whole with ``--new-tokens`` sampled tokens (temperature 0.8, top-p 0.95);
* one in three streamed (same sampling) and dropped after 1-5 chunks (the client closes the
  connection; SGLang aborts the request).

After the server is healthy and after each round (every client idle, then 1 s), it records the
resident set (RSS, and its anonymous part ``RssAnon``, bytes) of each process of the server's tree,
by role (:func:`roles`: ``launcher``, ``tokenizer_manager``, ``scheduler``, ``detokenizer``,
``sidecar``, ``other``), and the KV accounting of the sidecar's ``/metrics`` (every ``dd_`` sample
in bytes, and the requests per DualPath state). The growth rate per role and in total is the least
squares slope of RSS over requests sent, fitted over the samples from ``--warmup`` requests on, in
MiB per 1,000 requests (``growth_mib_per_1000``); issue 44's bound is 50 MiB per 1,000 requests
after the first 500. ``--env NAME=VALUE`` (repeatable) adds variables to the launcher's environment
(e.g. ``MALLOC_ARENA_MAX=2``), which every server process inherits. ``--probe`` also asks every
server process, at each sample, for its glibc heap figures (``mallinfo2``), its Python objects by
type (``gc``) and, under ``--env PYTHONTRACEMALLOC=1``, tracemalloc's largest lines
(``bench/soak_probe/sitecustomize.py``), and after the last sample for its RSS after
``malloc_trim(0)`` (``probe_trim``).

Bounded: at most ``--requests`` requests and ``--seconds`` seconds of traffic (the round in flight
finishes), loopback only, one server, stopped at the end; the samples so far are rewritten after each
round to ``samples.partial.json`` in the run's temporary folder (printed at the start), which a
killed run leaves behind. Output: JSON (with
:func:`bench.machine.measured`'s head: command, provenance, machine) and a PNG plot of RSS per role
and total against requests (``HOSTCLASS``: :func:`bench.machine.host_class`). Nothing here is a pass/fail test; the exit code is 1 only when a
request failed or the server did not stop cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from bench.cli import check_ranges, write_result
from bench.machine import measured
from harness.server import ROLES, ServerProcess, launch_server, role_of, scrape

MiB = 1024**2
#: Sampling of every request (answered and streamed alike).
SAMPLING = {"temperature": 0.8, "top_p": 0.95}


def _status_kib(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/PID/status`` in KiB (0 when absent)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def roles(srv: ServerProcess) -> dict[str, dict[str, int]]:
    """RSS and anonymous RSS (bytes) of the server's processes, summed per role (:data:`ROLES`);
    ``{"rss": {role: bytes}, "rss_anon": {role: bytes}, "pids": {role: [pid, ...]}}``."""
    rss = dict.fromkeys(ROLES, 0)
    anon = dict.fromkeys(ROLES, 0)
    pids: dict[str, list[int]] = {r: [] for r in ROLES}
    for p in srv.family():
        try:
            r, mem = role_of(p, srv.proc.pid), p.memory_info().rss
        except psutil.Error:
            continue
        rss[r] += mem
        anon[r] += _status_kib(p.pid, "RssAnon") * 1024
        pids[r].append(p.pid)
    return {"rss": rss, "rss_anon": anon, "pids": pids}


def kv_accounting(srv: ServerProcess) -> dict[str, float]:
    """The sidecar's ``dd_`` byte gauges and DualPath state counts (empty when it does not answer)."""
    try:
        m = scrape(srv.metrics_url)
    except httpx.HTTPError:
        return {}
    return {k: v for k, v in m.items() if "bytes" in k.split("{")[0] or k.startswith("dd_dualpath_requests{")}


def prompt_words(rng: random.Random, words: list[str], lo: int, hi: int) -> str:
    """``rng.randint(lo, hi)`` consecutive words of ``words`` from a random start, space-joined."""
    n = rng.randint(lo, hi)
    start = rng.randrange(0, len(words) - n)
    return " ".join(words[start : start + n])


def prompt_tokens(rng: random.Random, ids: list[int], lo: int, hi: int) -> list[int]:
    """``rng.randint(lo, hi)`` consecutive token ids of ``ids`` from a random start."""
    n = rng.randint(lo, hi)
    start = rng.randrange(0, len(ids) - n)
    return ids[start : start + n]


def license_token_ids() -> list[int]:
    """Debian's licence texts (:func:`harness.texts.license_words`, space-joined) as the embedded
    model's token ids."""
    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model
    from harness.texts import license_words

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    return tok.encode(" ".join(license_words()))


def one_request(url: str, prompt: str | list[int], streamed_chunks: int, new_tokens: int) -> str | None:
    """Send one request of the mix; None when it went as planned, else what went wrong.

    ``prompt``: text, or token ids (OpenAI's completions take either). ``streamed_chunks``: 0
    answers the request whole; 1-5 streams it and closes the connection after that many data
    chunks (or at the stream's end, whichever comes first).
    """
    body = {"model": "x", "prompt": prompt, "max_tokens": new_tokens, **SAMPLING}
    try:
        if not streamed_chunks:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {r.text[:200]}"
            return None if r.json()["choices"][0]["text"] is not None else "no text"
        seen = 0
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=600) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code} (streamed)"
            for line in r.iter_lines():
                if line.startswith("data:"):
                    seen += 1
                    if seen >= streamed_chunks:
                        break  # leaving the block closes the connection: SGLang aborts the request
        return None if seen else "stream closed before its first chunk"
    except httpx.HTTPError as err:
        return f"{type(err).__name__}: {err}"


def fit_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` over ``xs`` (None with fewer than two distinct ``xs``)."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def growth(samples: list[dict], warmup: int) -> dict:
    """RSS growth in MiB per 1,000 requests, per role and ``total`` (``rss``) and of the anonymous
    part (``rss_anon``), fitted over the samples taken at ``warmup`` requests or later (None with
    fewer than two such samples)."""
    later = [s for s in samples if s["requests"] >= warmup]
    xs = [s["requests"] for s in later]
    out: dict[str, dict] = {}
    for kind in ("rss", "rss_anon"):
        per = {}
        for role in (*ROLES, "total"):
            ys = [s[kind][role] if role != "total" else sum(s[kind].values()) for s in later]
            slope = fit_slope(xs, ys)
            per[role] = None if slope is None else round(slope * 1000 / MiB, 2)
        out[kind] = per
    return out


def send_round(url: str, plan: list[tuple[str, int]], clients: int, new_tokens: int) -> list[str]:
    """Send ``plan`` (``(prompt, streamed chunks)`` pairs, :func:`one_request`) from ``clients``
    concurrent threads; returns once all are done, with what went wrong (one string per failure)."""
    todo = list(plan)
    errors: list[str] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                prompt, chunks = todo.pop()
            err = one_request(url, prompt, chunks, new_tokens)
            if err:
                with lock:
                    errors.append(err)

    workers = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return errors


def probe(folder: Path, tag: str, pids: dict[str, list[int]], trim: bool = False, timeout: float = 60.0) -> dict:
    """Ask every process of the server for a ``bench/soak_probe`` report tagged ``tag`` (with
    ``malloc_trim(0)`` when ``trim``) and wait up to ``timeout`` seconds for them; returns
    ``{role: [report, ...]}`` (``gc_top`` and the tracemalloc lines cut to 15 each)."""
    with open(folder / "trigger", "a") as f:
        f.write(f"{tag}{' trim' if trim else ''}\n")
    out: dict[str, list] = {}
    deadline = time.monotonic() + timeout
    for role, role_pids in pids.items():
        for pid in role_pids:
            path = folder / f"{pid}.{tag}.json"
            while not path.exists() and time.monotonic() < deadline and psutil.pid_exists(pid):
                time.sleep(0.2)
            if path.exists():
                rep = json.loads(path.read_text())
                rep["gc_top"] = rep.get("gc_top", [])[:15]
                if "tracemalloc" in rep:
                    rep["tracemalloc"]["top"] = rep["tracemalloc"]["top"][:15]
                out.setdefault(role, []).append(rep)
    return out


def sample(srv: ServerProcess, sent: int, t0: float, errors: int, probe_dir: Path | None = None) -> dict:
    """One row of the timeline: requests sent, seconds since traffic began, failed requests so far,
    RSS per role (:func:`roles`) and the KV accounting (:func:`kv_accounting`); with ``probe_dir``,
    also every process's :func:`probe` report (``probe``)."""
    r = roles(srv)
    row = {"requests": sent, "seconds": round(time.monotonic() - t0, 1), "errors": errors,
           "rss": r["rss"], "rss_anon": r["rss_anon"], "kv": kv_accounting(srv)}  # fmt: skip
    if probe_dir is not None:
        row["probe"] = probe(probe_dir, f"r{sent}", r["pids"])
    print(f"[soak] {sent:5d} requests {row['seconds']:7.1f} s: total RSS {sum(r['rss'].values()) / MiB:8.1f} MiB "
          + " ".join(f"{k} {v / MiB:.0f}" for k, v in r["rss"].items() if v), file=sys.stderr, flush=True)  # fmt: skip
    return row


def server_args(backend: str, tmp: Path, args) -> list[str]:
    """SGLang/dd flags of the soak's server (module docstring); the preset is written under ``tmp``."""
    import yaml

    from harness.server import ROOT

    preset = yaml.safe_load((ROOT / "configs" / "cpu-smollm2.yaml").read_text())
    preset["name"] = "soak"
    preset["sparse"]["host_tier_bytes"] = args.host_tier_mb * MiB
    (tmp / "preset.yaml").write_text(yaml.safe_dump(preset))
    out = ["--dd-config", str(tmp / "preset.yaml"), "--chunked-prefill-size", str(args.chunked_prefill_size),
           "--enable-cache-report"]  # fmt: skip
    return out + (["--attention-backend", "dualdecoder"] if backend == "dualdecoder" else [])


def run(args) -> dict:
    """Start the server, send the rounds, sample after each, stop; the JSON's figures (module docstring)."""
    from harness.texts import license_words

    words = license_words()
    ids = license_token_ids() if args.tokens else None
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="dd_soak_"))
    env = dict(kv.split("=", 1) for kv in args.env)
    probe_dir = None
    if args.probe:
        probe_dir = tmp / "probe"
        probe_dir.mkdir()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent / "soak_probe"),
                                                          os.environ.get("PYTHONPATH")]))  # fmt: skip
        env["DD_SOAK_PROBE_DIR"] = str(probe_dir)
    srv = launch_server(tmp / "server.log", args.max_total_tokens, server_args(args.backend, tmp, args), env=env)
    samples: list[dict] = []
    errors: list[str] = []
    kinds = {"answered": 0, "streamed": 0}
    sent = 0
    stopped_by = "requests"
    # The samples so far, rewritten after each round: what a run that is killed leaves behind.
    partial = tmp / "samples.partial.json"
    print(f"[soak] server log {srv.log_path}, samples so far in {partial}", file=sys.stderr, flush=True)
    try:
        srv.wait_ready(900)
        t0 = time.monotonic()
        samples.append(sample(srv, 0, t0, 0, probe_dir))
        while sent < args.requests:
            if time.monotonic() - t0 > args.seconds:
                stopped_by = "seconds"
                break
            n = min(args.round, args.requests - sent)
            plan = []
            for _ in range(n):
                chunks = rng.randint(1, 5) if rng.random() < 1 / 3 else 0
                kinds["streamed" if chunks else "answered"] += 1
                prompt = prompt_tokens(rng, ids, *args.tokens) if ids else prompt_words(rng, words, *args.words)
                plan.append((prompt, chunks))
            errors += send_round(srv.url, plan, args.clients, args.new_tokens)
            sent += n
            if srv.proc.poll() is not None:
                raise RuntimeError(f"server exited with {srv.proc.returncode}:\n{srv.log_tail()}")
            time.sleep(1.0)  # the aborted streams' releases and the sidecar's gauges settle
            samples.append(sample(srv, sent, t0, len(errors), probe_dir))
            partial.write_text(json.dumps({"command": " ".join(sys.argv), "samples": samples}) + "\n")
        wall = time.monotonic() - t0
        if probe_dir is not None:  # how much of each heap glibc held free: malloc_trim(0), last
            trimmed = probe(probe_dir, f"r{sent}-trim", roles(srv)["pids"], trim=True)
    finally:
        rc, alive = srv.stop()
    grown = growth(samples, args.warmup)
    return {"backend": args.backend, "requests_sent": sent, "stopped_by": stopped_by, "mix": kinds,
            "failed_requests": len(errors), "first_errors": errors[:5], "wall_seconds": round(wall, 1),
            "engine_start_seconds": round(srv.start_seconds, 1), "env": env,
            "settings": {"max_total_tokens": args.max_total_tokens, "chunked_prefill_size": args.chunked_prefill_size,
                         "host_tier_mib": args.host_tier_mb, "clients": args.clients, "round": args.round,
                         "new_tokens": args.new_tokens, "words": None if args.tokens else list(args.words),
                         "tokens": list(args.tokens) if args.tokens else None, "warmup": args.warmup,
                         "seed": args.seed, "sampling": SAMPLING},
            "growth_mib_per_1000": grown,
            "rss_total_mib": {"first": round(sum(samples[0]["rss"].values()) / MiB, 1),
                              "last": round(sum(samples[-1]["rss"].values()) / MiB, 1)},
            "probe_trim": trimmed if probe_dir is not None else None,
            "shutdown": {"exit_code": rc, "processes_left": alive}, "log": str(srv.log_path),
            "samples": samples}  # fmt: skip


def plot(result: dict, path: Path) -> None:
    """RSS per role and in total (MiB) against requests sent, one PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    xs = [r["requests"] for r in s]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    ax[0].plot(xs, [sum(r["rss"].values()) / MiB for r in s], "k-o", ms=3, label="total")
    ax[0].set_title(f"{result['backend']}: total RSS (slope after {result['settings']['warmup']}: "
                    f"{result['growth_mib_per_1000']['rss']['total']} MiB / 1000 req)", fontsize=9)  # fmt: skip
    for role in ROLES:
        ys = [r["rss"][role] / MiB for r in s]
        if any(ys):
            ax[1].plot(xs, ys, "-o", ms=3, label=role)
    ax[1].set_title("RSS per process", fontsize=9)
    for a in ax:
        a.set_xlabel("requests sent")
        a.set_ylabel("MiB")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(f"bench.soak {result['provenance']['date']} {(result['provenance']['commit'] or '')[:10]}",
                 fontsize=8)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"-> {path}")


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--backend", choices=("dense", "dualdecoder"), default="dualdecoder")
    ap.add_argument("--requests", type=int, default=2000, help="requests in all")
    ap.add_argument("--round", type=int, default=100, help="requests between two samples")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients")
    ap.add_argument("--seconds", type=float, default=3600.0, help="no new round after this much traffic (s)")
    ap.add_argument("--max-total-tokens", type=int, default=6000, help="device KV pool (tokens)")
    ap.add_argument("--chunked-prefill-size", type=int, default=256)
    ap.add_argument("--host-tier-mb", type=int, default=300, help="sparse.host_tier_bytes in MiB")
    ap.add_argument("--new-tokens", type=int, default=16, help="max_tokens of every request")
    ap.add_argument("--words", type=int, nargs=2, default=(500, 900), metavar=("MIN", "MAX"),
                    help="prompt length range in words (inclusive)")  # fmt: skip
    ap.add_argument("--tokens", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                    help="prompt length in tokens, uniform in [MIN, MAX] (instead of --words)")
    ap.add_argument("--warmup", type=int, default=500, help="requests before the growth fit starts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="add to the launcher's environment (repeatable)")  # fmt: skip
    ap.add_argument("--probe", action="store_true",
                    help="every process reports RSS, mallinfo2, gc counts (and tracemalloc) at each sample")  # fmt: skip
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/soak_BACKEND_HOSTCLASS.json)")
    ap.add_argument("--plot", default=None, help="PNG path (default: the JSON's path with .png)")
    args = ap.parse_args(argv)
    check_ranges(ap, args, (("requests", 1, 10**6), ("round", 1, 10**5), ("clients", 1, 64),
                            ("seconds", 1, 7 * 86400), ("max_total_tokens", 256, 10**7),
                            ("chunked_prefill_size", 16, 10**6), ("host_tier_mb", 16, 10**6),
                            ("new_tokens", 1, 4096), ("warmup", 0, 10**6), ("seed", 0, 2**32)))  # fmt: skip
    lo, hi = args.words
    if not 1 <= lo <= hi <= 5000:
        ap.error(f"--words must be MIN MAX with 1 <= MIN <= MAX <= 5000, got {lo} {hi}")
    if args.tokens is not None:
        lo, hi = args.tokens
        if not 1 <= lo <= hi <= min(32768, args.max_total_tokens - args.new_tokens):
            ap.error(f"--tokens must be MIN MAX with 1 <= MIN <= MAX <= min(32768, --max-total-tokens - "
                     f"--new-tokens = {args.max_total_tokens - args.new_tokens}), got {lo} {hi}")
    for kv in args.env:
        name = kv.split("=", 1)[0]
        if "=" not in kv or not name or not name.replace("_", "").isalnum():
            ap.error(f"--env must be NAME=VALUE with NAME of letters, digits and _, got {kv!r}")
    if args.out is None:
        from bench.machine import gpu_name, host_class
        from dd_sglang.platform.dtype import cpu_model

        args.out = f"bench/results/soak_{args.backend}_{host_class(cpu_model() or None, gpu_name())}.json"
    args.out = Path(args.out)
    args.plot = Path(args.plot) if args.plot else args.out.with_suffix(".png")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = measured(f"soak: RSS per server process under mixed traffic ({args.backend}, CPU)",
                      "python -m bench.soak " + " ".join(sys.argv[1:] if argv is None else argv),
                      lambda: run(args))  # fmt: skip
    write_result(result, args.out)
    plot(result, args.plot)
    g = result["growth_mib_per_1000"]["rss"]
    print(f"{args.backend}: {result['requests_sent']} requests, {result['failed_requests']} failed; RSS growth after "
          f"{args.warmup} requests (MiB / 1000 requests): " + ", ".join(f"{k} {v}" for k, v in g.items()))  # fmt: skip
    ok = not result["failed_requests"] and result["shutdown"]["exit_code"] == 0 and not result["shutdown"]["processes_left"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
