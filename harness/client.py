"""HTTP client helpers shared by the tests and the benchmarks: servers by URL, the presets they run,
requests, per-request counters.

Everything here goes through the public interface only: SGLang's ``/generate``
and the sidecar's ``/metrics`` (:func:`harness.server.scrape`). A benchmark either
starts its own servers (:func:`harness.server.start_server`) or is handed the URLs
of running ones (``--dense-url``, ``--dd-url`` and ``--dd-metrics-url``), e.g.
the test session's.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from harness.server import ROOT, scrape, start_server
from harness.teacher_force import CARRIER_IDS, ForceTokensScored, decode_scores

#: The served model name of the embedded model (what ``/v1/*`` requests name).
MODEL = "smollm2-135m-instruct"
#: Flags every benchmark server gets: teacher forcing needs custom logit processors.
COMMON_FLAGS = ["--enable-custom-logit-processor"]
#: Extra flags of a dense (torch_native) benchmark server. Teacher forcing reads the step's index from
#: ``len(req.output_ids)``; under SGLang's overlap scheduler that lags one step behind (the previous
#: step's token is appended after the next step's logits are processed), so the forced sequence would
#: repeat its first token. The dualdecoder launcher turns overlap scheduling off already.
DENSE_FLAGS = ["--disable-overlap-schedule"]


@dataclass
class Endpoint:
    """A server to send requests to: SGLang's base URL and, for ``dualdecoder``, the sidecar's."""

    url: str
    metrics_url: str | None = None
    start_seconds: float | None = None  # None: handed in, not started here


def apply_sets(preset: dict, sets: dict | None) -> dict:
    """``preset`` with each dotted key of ``sets`` (``{"prefetch.rerank": 4}``) set, sections made as
    needed; changed in place and returned."""
    for dotted, value in (sets or {}).items():
        *sections, key = dotted.split(".")
        node = preset
        for s in sections:
            node = node.setdefault(s, {})
        node[key] = value
    return preset


def preset_dict(hit_rate_sample: float | None = 1.0, host_tier_bytes: int | None = None,
                sets: dict | None = None, base: str = "cpu-smollm2") -> dict:  # fmt: skip
    """The default CPU preset (``configs/cpu-smollm2.yaml``, or ``configs/<base>.yaml``, unvalidated) as the
    benchmarks' servers run it:
    ``prefetch.hit_rate_sample`` set (1.0: every step measured; None: the preset's), optionally ``sparse.host_tier_bytes`` (the launcher refuses a host tier larger than free
    memory), then ``sets``: dotted keys (``--set``, :func:`parse_sets`)."""
    preset = yaml.safe_load((ROOT / "configs" / f"{base}.yaml").read_text())
    if hit_rate_sample is not None:
        preset["prefetch"]["hit_rate_sample"] = hit_rate_sample
    if host_tier_bytes is not None:
        preset["sparse"]["host_tier_bytes"] = host_tier_bytes
    return apply_sets(preset, sets)


def bench_preset(tmp: Path, hit_rate_sample: float | None = 1.0, host_tier_bytes: int | None = None,
                 sets: dict | None = None, base: str = "cpu-smollm2") -> Path:  # fmt: skip
    """:func:`preset_dict` written to a YAML file under ``tmp``; its path (for ``--dd-config``)."""
    preset = preset_dict(hit_rate_sample, host_tier_bytes, sets, base)
    tag = "_".join(f"{k}-{v}" for k, v in sorted((sets or {}).items()))
    path = tmp / f"preset_{base}_hit_rate_{hit_rate_sample}_{host_tier_bytes}_{tag}.yaml"
    path.write_text(yaml.safe_dump(preset))
    return path


def parse_sets(items: list[str], flag: str = "--set") -> dict:
    """``--set SECTION.KEY=VALUE`` items (repeatable; the value in YAML spelling: ``4``, ``torch``,
    ``true``) as ``{"SECTION.KEY": value}``, checked against the preset schema
    (:func:`dd_sglang.config.parse_config` of :func:`preset_dict` with them), so that a bad key or
    value is refused, naming the key, before any server starts.

    Raises:
        ValueError: an item that is not ``SECTION.KEY=VALUE``, a key given twice, or the schema's
            refusal (the message names ``flag`` and the dotted key).
    """
    from dd_sglang.config import ConfigError, parse_config

    sets: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key or not all(key.split(".")) or key in sets:
            raise ValueError(f"{flag} takes SECTION.KEY=VALUE, each key once (e.g. prefetch.rerank=4), got {item!r}")
        sets[key] = yaml.safe_load(value)
    try:
        parse_config(preset_dict(sets=sets), flag)
    except ConfigError as err:
        raise ValueError(str(err)) from None
    return sets


#: Servers started with ``served(..., keep=True)``; :func:`stop_left_running` stops them.
LEFT_RUNNING: list = []


def stop_left_running() -> None:
    """Stop the servers :func:`served` left running."""
    while LEFT_RUNNING:
        LEFT_RUNNING.pop().stop()


@contextlib.contextmanager
def served(backend: str, url: str | None, metrics_url: str | None, tmp: Path, max_total_tokens: int,
           hit_rate_sample: float = 1.0, keep: bool = False, sets: dict | None = None):  # fmt: skip
    """Yield an :class:`Endpoint`: the given URLs, or a server started here and stopped on exit.

    ``backend``: ``torch_native`` (dense) or ``dualdecoder`` (the latter with
    :func:`bench_preset`, ``sets`` applied: :func:`parse_sets`). ``keep``: a server started here is left running (the
    caller stops it: :data:`LEFT_RUNNING`) so a later phase can reuse it. Raises ``RuntimeError`` when a started server fails
    (the message carries its log tail).
    """
    if url:
        yield Endpoint(url, metrics_url)
        return
    extra = ["--attention-backend", backend, *COMMON_FLAGS]
    if backend == "torch_native":
        extra += DENSE_FLAGS
    if backend == "dualdecoder":
        extra += ["--dd-config", str(bench_preset(tmp, hit_rate_sample, sets=sets))]
    srv = start_server(tmp / f"{backend}.log", max_total_tokens, extra, timeout=900)
    if keep:
        LEFT_RUNNING.append(srv)
        yield Endpoint(srv.url, srv.metrics_url, round(srv.start_seconds, 1))
        return
    try:
        yield Endpoint(srv.url, srv.metrics_url, round(srv.start_seconds, 1))
    finally:
        rc, alive = srv.stop()
        if rc != 0 or alive:
            print(f"warning: {backend} server stopped with exit code {rc}, processes left {alive}")


def generate(ep: Endpoint, ids: list[int], n_new: int, sampling: dict | None = None, custom: dict | None = None,
             force: list[int] | None = None, stop: list[str] | None = None) -> dict:  # fmt: skip
    """One ``/generate`` request; returns the response JSON plus ``seconds`` (wall time).

    ``force``: teacher-force the output to these ids with
    :class:`harness.teacher_force.ForceTokensScored` (greedy; the response then
    carries the carrier log-probabilities, see :func:`forced_scores`).
    """
    sp = {"temperature": 0, **(sampling or {}), "max_new_tokens": n_new, "custom_params": dict(custom or {})}
    body: dict = {"input_ids": ids, "sampling_params": sp}
    if stop:
        sp["stop"] = stop
    else:
        sp["ignore_eos"] = True
    if force is not None:
        sp["custom_params"]["force_ids"] = list(force)
        sp["temperature"] = 0
        body.update(custom_logit_processor=ForceTokensScored.to_str(), return_logprob=True,
                    token_ids_logprob=list(CARRIER_IDS))  # fmt: skip
    t0 = time.monotonic()
    r = httpx.post(f"{ep.url}/generate", json=body, timeout=7200)
    if r.status_code != 200:
        raise RuntimeError(f"/generate answered {r.status_code}: {r.text[:500]}")
    out = r.json()
    out["seconds"] = time.monotonic() - t0
    return out


def forced_scores(resp: dict, force: list[int]) -> list[tuple[float, bool]]:
    """``(log-probability, was argmax)`` per forced token of a :func:`generate` ``force`` response."""
    return decode_scores(resp["meta_info"], force)


def prefill_logprobs(ep: Endpoint, ids: list[int], start: int) -> list[float]:
    """Log-probabilities of ``ids[start:]`` scored by one dense prefill of ``ids`` (SGLang's input logprobs).

    The reference the decode-path scoring is checked against: position ``p``'s
    value is ``log p(ids[p] | ids[:p])``. (SGLang returns None for the token at
    ``logprob_start_len`` itself, hence ``start - 1``.)
    """
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1},
            "return_logprob": True, "logprob_start_len": start - 1}  # fmt: skip
    r = httpx.post(f"{ep.url}/generate", json=body, timeout=7200)
    r.raise_for_status()
    rows = r.json()["meta_info"]["input_token_logprobs"]
    vals = [float(v) for v, *_ in rows if v is not None]
    return vals[-(len(ids) - start) :]


class Counters:
    """The sidecar's ``dd_`` samples around one request: ``with Counters(ep) as c: ...; c.delta(name)``."""

    def __init__(self, ep: Endpoint):
        self.ep = ep
        self.before: dict[str, float] = {}
        self.after: dict[str, float] = {}

    def __enter__(self):
        if self.ep.metrics_url:
            self.before = scrape(self.ep.metrics_url)
        return self

    def __exit__(self, *exc):
        if self.ep.metrics_url:
            self.after = scrape(self.ep.metrics_url)
        return False

    def delta(self, name: str) -> float:
        return self.after.get(name, 0.0) - self.before.get(name, 0.0)

    def prefetch(self, custom: dict, n_layers: int) -> dict:
        """This request's prefetch figures from the counters (lookahead selectors; None where not measured).

        ``recall`` = hits / lookups (|set fixed one step earlier ∩ exact top-k| / k over
        sampled (step, layer, KV head)s), ``mass_coverage`` = softmax mass on the prefetched
        set / mass on the exact top-k, ``acceptance`` = accepted / proposed speculations,
        ``per_layer_recall`` = mean per-(step) recall of each layer (the per-layer histogram's
        sum / count), ``sparse_rows`` = (step, layer) rows decoded sparsely, ``repaired``/``misses``.
        """
        from dd_sglang.prefetch.selectors import SELECTORS
        from dd_sglang.prefetch.speculators import DualTokenSpeculator

        sel, spec = custom.get("dd_selector", "spec_host"), DualTokenSpeculator.name
        spec_lab = spec if SELECTORS[sel].uses_speculator else "none"  # the plan's label (prefetch/plan.py)
        lab = f'{{selector="{sel}",speculator="{spec_lab}"}}'
        lookups = self.delta(f"dd_prefetch_lookups_total{lab}")
        top = self.delta(f"dd_prefetch_mass_top_k_total{lab}")
        proposed = self.delta(f'dd_spec_proposed_total{{speculator="{spec}"}}')
        per_layer = {}
        for layer in range(n_layers):
            c = self.delta(f'dd_prefetch_layer_hit_rate_count{{layer="{layer}"}}')
            if c:
                per_layer[layer] = round(self.delta(f'dd_prefetch_layer_hit_rate_sum{{layer="{layer}"}}') / c, 5)
        misses = self.delta('dd_prefetch_misses_total{policy="verify"}')
        return {
            "lookups": int(lookups),
            "hits": int(self.delta(f"dd_prefetch_hits_total{lab}")),
            "recall": round(self.delta(f"dd_prefetch_hits_total{lab}") / lookups, 5) if lookups else None,
            "mass_coverage": round(self.delta(f"dd_prefetch_mass_prefetched_total{lab}") / top, 5) if top else None,
            "proposed": int(proposed),
            "accepted": int(self.delta(f'dd_spec_accepted_total{{speculator="{spec}"}}')),
            "acceptance": round(self.delta(f'dd_spec_accepted_total{{speculator="{spec}"}}') / proposed, 5)
            if proposed else None,
            "per_layer_recall": per_layer,
            "sparse_rows": int(self.delta("dd_sparse_decode_rows_total")),
            "lookahead_misses": int(misses),
            "repaired_tokens": int(self.delta("dd_prefetch_repaired_tokens_total")),
        }  # fmt: skip


def n_layers_of_model() -> int:
    """Decoder layers of the embedded model (its converted ``config.json``)."""
    import json

    from dd_sglang.models.smollm2 import prepare_model

    return int(json.loads((prepare_model(progress=False) / "config.json").read_text())["num_hidden_layers"])


def post_chat(url: str, messages: list[dict], max_tokens: int, timeout: float = 900.0) -> httpx.Response:
    """A greedy ``/v1/chat/completions`` request that continues the final (assistant) message;
    the raw response (its status unchecked). ``timeout`` in seconds."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "continue_final_message": True}  # fmt: skip
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
