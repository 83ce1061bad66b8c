"""Every Prometheus metric a dd_sglang process exports, in one place.

Naming follows Prometheus rules: ``dd_`` prefix, base units (``_bytes``),
``_total`` on counters; labels are small bounded sets (DualPath state names,
a byte source), never request ids.

Multiprocess mode: SGLang's scheduler processes write these into
``$PROMETHEUS_MULTIPROC_DIR`` (set by the launcher before SGLang starts) and
the sidecar merges them with ``prometheus_client.multiprocess``. Byte gauges
use ``livesum``: with tensor parallelism each rank holds its own shard of
the KV pool, so the ranks' bytes add up. Request-count gauges are written by
attention-TP rank 0 only, so the sum counts each request once.

Import this module only in a process where ``PROMETHEUS_MULTIPROC_DIR`` is
already set (prometheus-client picks its storage at import time).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

#: DualPath request states (DESIGN.md). Without ``--attention-backend
#: dualdecoder`` every running request is ``DENSE``; every state is exported
#: (0 when empty) so dashboards and alerts can be written against the full set.
DUALPATH_STATES = ("DENSE", "PREFILL_FULL", "OFFLOADING", "DECODE_SPARSE", "REBUILD", "FINISHED")

DEVICE_KV_CAPACITY_BYTES = Gauge(
    "dd_device_kv_capacity_bytes",
    "Bytes of the device-tier KV pool (K and V buffers of all layers, padding slots included).",
    multiprocess_mode="livesum",
)
DEVICE_KV_USED_BYTES = Gauge(
    "dd_device_kv_used_bytes",
    "Bytes of device-tier KV slots allocated (running requests plus prefix-cache entries).",
    multiprocess_mode="livesum",
)
DEVICE_KV_EVICTABLE_BYTES = Gauge(
    "dd_device_kv_evictable_bytes",
    "Bytes of allocated device-tier KV slots held only by the prefix (radix) cache, free to evict.",
    multiprocess_mode="livesum",
)
HOST_TIER_CAPACITY_BYTES = Gauge(
    "dd_host_tier_capacity_bytes",
    "Bytes of the host-tier sparse KV pool's K and V buffers (0 without --attention-backend dualdecoder).",
    multiprocess_mode="livesum",
)
HOST_TIER_USED_BYTES = Gauge(
    "dd_host_tier_used_bytes",
    "Bytes of allocated host-tier KV pages: running sparse requests plus the host prefix cache.",
    multiprocess_mode="livesum",
)
HOST_TIER_PREFIX_CACHE_BYTES = Gauge(
    "dd_host_tier_prefix_cache_bytes",
    "Bytes of host-tier pages held by finished requests for prefix reuse (part of dd_host_tier_used_bytes).",
    multiprocess_mode="livesum",
)
SPARSE_RESIDENT_BYTES = Gauge(
    "dd_sparse_resident_bytes",
    "Device-tier KV bytes held by DECODE_SPARSE requests (their resident sets: sinks, kept tokens, window).",
    multiprocess_mode="livesum",
)
SPARSE_REQUEST_DEVICE_TOKENS_MAX = Gauge(
    "dd_sparse_request_device_tokens_max",
    "Most device KV slots held by one DECODE_SPARSE request now (tokens).",
    multiprocess_mode="livemax",
)
CRITICAL_SET_BUFFER_BYTES = Gauge(
    "dd_critical_set_buffer_bytes",
    "Device bytes holding critical-set K/V in the last sparse decode step: the critical-set and repair "
    "columns of the layer ring (part of dd_layer_ring_buffer_bytes).",
    multiprocess_mode="livesum",
)
HBM_USED_BYTES = Gauge(
    "dd_hbm_used_bytes",
    "Accelerator memory in use. source=cuda_allocator: torch.cuda.memory_allocated(); "
    "source=cpu_device_pool: no accelerator, the CPU-resident device-tier KV pool's bytes.",
    ["source"],
    multiprocess_mode="livesum",
)
DUALPATH_REQUESTS = Gauge(
    "dd_dualpath_requests",
    "Admitted requests by DualPath state (without dualdecoder: the running batch, all DENSE).",
    ["state"],
    multiprocess_mode="livesum",
)
DUALPATH_TRANSITIONS = Counter(
    "dd_dualpath_transitions",
    "DualPath state transitions of requests, by source and destination state. A request SGLang retracts "
    "(device pool full) counts as `to=FINISHED` and starts again, as a new request, when it is prefilled anew.",
    ["from", "to"],
)
#: Why a request changed path (``dd_sglang.kvcache.dualpath.PATH_CHANGE_REASONS``).
PATH_CHANGE_REASONS = ("length", "pressure", "request")
#: What made the pressure policy offload (``dd_sglang.kvcache.pressure.TRIGGERS``).
PRESSURE_TRIGGERS = ("admission", "retraction")
DUALPATH_PATH_CHANGES = Counter(
    "dd_dualpath_path_changes",
    "Requests that changed KV path, by reason: length (went sparse when its context reached "
    "sparse.min_sparse_len, policy always), pressure (offloaded because SGLang needed its device KV for other "
    "work, policy pressure), request (a new turn on a sparse request rebuilt its full KV).",
    ["reason"],
)
PRESSURE_OFFLOADS = Counter(
    "dd_pressure_offloads",
    "Requests the pressure policy offloaded to the host tier, by trigger: admission (a waiting request did not "
    "fit the device pool) or retraction (the next decode step did not fit; SGLang would have retracted).",
    ["trigger"],
)

CPU_HEAP_TRIMS = Counter(
    "dd_cpu_heap_trims",
    "Trims of the scheduler's glibc heap (malloc_trim(0): free pages back to the kernel) after prefill "
    "batches on the CPU platform, at most one every DD_SGLANG_CPU_HEAP_TRIM_S seconds (0: off).",
)
CPU_HEAP_TRIM_SECONDS = Counter(
    "dd_cpu_heap_trim_seconds",
    "Time the scheduler spent in those trims (the pages they returned fault back in later, not counted here).",
)


def publish_policy_series() -> None:
    """Create every ``reason`` of :data:`DUALPATH_PATH_CHANGES` and every ``trigger`` of
    :data:`PRESSURE_OFFLOADS` at 0, so both series exist (and dashboards show 0) before the first
    path change or pressure offload: a labelled counter has no sample until a label set is used."""
    for reason in PATH_CHANGE_REASONS:
        DUALPATH_PATH_CHANGES.labels(reason=reason)
    for trigger in PRESSURE_TRIGGERS:
        PRESSURE_OFFLOADS.labels(trigger=trigger)


SPARSE_DECODE_ROWS = Counter(
    "dd_sparse_decode_rows",
    "(request, layer) attention rows decoded on the sparse path by the dualdecoder backend.",
)
SPARSE_EXACT_ROWS = Counter(
    "dd_sparse_exact_rows",
    "(request, layer) sparse rows whose critical set was their whole context, attended with the dense "
    "path's own attention call (bit-identical to dense decode).",
)
EXTEND_QUERY_ROWS_SKIPPED = Counter(
    "dd_extend_query_rows_skipped",
    "(token, layer) query rows of cached prefixes that SGLang's torch_native extend recomputes and the "
    "dualdecoder backend skipped, with the same output bits (dd_sglang/kernels/extend.py).",
)
HOST_TIER_REBUILT_TOKENS = Counter(
    "dd_host_tier_rebuilt_tokens",
    "Tokens of finished requests' host-tier KV loaded back to the device as a new request's prefix (REBUILD).",
)
OFFLOAD_UNPINNED = Counter(
    "dd_offload_unpinned",
    "Offloads (prefill done, request going sparse) that found the device pool too full for the resident "
    "set's fresh slots: the request dropped its radix-tree lock on its own prompt, the tree evicted it "
    "and the resident set was loaded from the host tier. Often: --max-total-tokens is tight for the "
    "prefill batches.",
)
PREFETCH_HITS = Counter(
    "dd_prefetch_hits",
    "Lookahead selectors, sampled steps (prefetch.hit_rate_sample): tokens of the real query's exact top-k "
    "(per layer and KV head) that the set fixed one step earlier held. Hit rate = hits / lookups.",
    ["selector", "speculator"],
)
PREFETCH_LOOKUPS = Counter(
    "dd_prefetch_lookups",
    "Lookahead selectors, sampled steps: critical-set slots checked against the exact top-k "
    "(k x KV heads per request and layer).",
    ["selector", "speculator"],
)
PREFETCH_MASS_PREFETCHED = Counter(
    "dd_prefetch_mass_prefetched",
    "Lookahead selectors, sampled steps: the real query's softmax mass (max over each KV head's query heads) "
    "on the prefetched set, summed over KV heads. Coverage = this / dd_prefetch_mass_top_k_total.",
    ["selector", "speculator"],
)
PREFETCH_MASS_TOP_K = Counter(
    "dd_prefetch_mass_top_k",
    "Lookahead selectors, sampled steps: the same softmax mass on the exact top-k, summed over KV heads.",
    ["selector", "speculator"],
)
PREFETCH_COLD = Counter(
    "dd_prefetch_cold",
    "Lookahead selectors: (request, layer) steps with no set fixed in advance (a request's first sparse step), "
    "selected synchronously from the current query.",
    ["selector"],
)
PREFETCH_MISSES = Counter(
    "dd_prefetch_misses",
    "Lookahead (request, layer) steps whose prefetched set missed tokens of the real query's set, by miss "
    "policy: verify (the missed tokens were fetched before attention; the only policy).",
    ["policy"],
)
PREFETCH_REPAIRED_TOKENS = Counter(
    "dd_prefetch_repaired_tokens",
    "Tokens (summed over KV heads) of the real query's critical set that the prediction missed and "
    "verification fetched synchronously before attention.",
)
PREFETCH_VERIFIED_HITS = Counter(
    "dd_prefetch_verified_hits",
    "Every verified lookahead (request, layer): tokens of the real query's "
    "critical set (host_sync's top-k) that the set fixed one step earlier held. Hit rate = hits / lookups, "
    "over every decode step (no sampling).",
    ["selector", "speculator"],
)
PREFETCH_VERIFIED_LOOKUPS = Counter(
    "dd_prefetch_verified_lookups",
    "Every verified lookahead (request, layer): critical-set tokens checked (top_k x KV heads).",
    ["selector", "speculator"],
)
CRITICAL_SET_RECALL_HELD = Counter(
    "dd_critical_set_recall_held",
    "Lookahead selectors, sampled steps (prefetch.hit_rate_sample): tokens of host_sync's top-k for the real "
    "query (selected again, apart from the step) that the set the layer attended held. Recall = held / "
    "lookups: 1 (verification: guaranteed recall).",
    ["selector", "speculator"],
)
CRITICAL_SET_RECALL_LOOKUPS = Counter(
    "dd_critical_set_recall_lookups",
    "Lookahead selectors, sampled steps: tokens of host_sync's top-k checked (top_k x KV heads).",
    ["selector", "speculator"],
)
SPEC_PROPOSED = Counter(
    "dd_spec_proposed",
    "Decode steps of sparse requests whose previous step carried a speculated token (checked against the real one).",
    ["speculator"],
)
SPEC_ACCEPTED = Counter(
    "dd_spec_accepted",
    "Speculated tokens equal to the real next token. Acceptance rate = accepted / proposed.",
    ["speculator"],
)
TRANSFER_WAIT_SECONDS = Histogram(
    "dd_transfer_wait_seconds",
    "Per layer and decode step: time attention waited for the layer's prefetched critical-set copy (exposed wait).",
    buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5),
)
TRANSFER_COPY_SECONDS = Histogram(
    "dd_transfer_copy_seconds",
    "Per layer and decode step: duration of the copy of the layer's critical sets fixed ahead (lookahead and full "
    "rows) into the layer ring: on the copy worker (CUDA) or inline on the forward thread (CPU: experimental.transfer "
    "inline, or auto below 6 (row, KV head) pairs a step). Not recorded for a step that reads its sets in place; "
    "the copies of synchronous selections (host_sync, oracle, quest_device) and repairs are timed in "
    "dd_step_phase_seconds_total{phase=\"select\"}.",
    buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5),
)
TRANSFER_HIDDEN_SECONDS = Counter(
    "dd_transfer_hidden_seconds",
    "Copy time that ran before attention started waiting for it (overlapped with earlier layers' compute).",
)
LAYER_RING_BUFFER_BYTES = Gauge(
    "dd_layer_ring_buffer_bytes",
    "Device bytes of the layer ring: the sparse rows' attention K/V (resident, critical set, repair, "
    "speculated token) for the layers in flight (prefetch.depth + 1 layer slots).",
    multiprocess_mode="livesum",
)
SELECTOR_AUX_BYTES = Gauge(
    "dd_selector_aux_bytes",
    "Device bytes kept only to choose critical sets (auxiliary state), by selector: quest_device's key-block "
    "summaries; 0 for spec_host and host_sync (their index is in host memory), spec_host_exact, recency and oracle.",
    ["selector"],
    multiprocess_mode="livesum",
)
HOST_INDEX_BYTES = Gauge(
    "dd_host_index_bytes",
    "Host-memory bytes of the int8 key index spec_host, host_sync and repairs score candidates with (int8 "
    "keys and a float32 scale per token, layer and KV head): (head_dim + 4) / (2 x head_dim x KV itemsize) of "
    "the host tier's bytes once any request used one of them.",
    multiprocess_mode="livesum",
)
TRANSFER_BYTES = Counter(
    "dd_transfer_bytes",
    "Critical-set K/V bytes brought from the host tier to attention (copies ahead, synchronous selections and "
    "repairs): gathered into the layer ring, or on a CPU with experimental.transfer in_place read in place by the "
    "attention kernel. Per step = this / dd_decode_steps_total{kind=\"sparse\"}.",
)
STEP_PHASE_SECONDS = Counter(
    "dd_step_phase_seconds",
    "Decode forward time by phase, summed: plan (building the step plan), select (choosing critical sets on "
    "the forward thread: cold starts, synchronous selectors, repairs), assemble (resident gather and attention "
    "inputs), attention (dense and sparse attention calls), select_ahead (next-step selection: on the select "
    "worker, off the forward thread, or inline on it: experimental.select auto, the default, runs it inline on a "
    "CPU below 8 rows a step and on the worker from 8 rows, with the forward on one intra-op thread). Copy and exposed wait: dd_transfer_copy_seconds / dd_transfer_wait_seconds.",
    ["phase"],
)
DECODE_STEPS = Counter(
    "dd_decode_steps",
    "Decode forwards run by the dualdecoder backend, by kind: sparse (had sparse rows) or dense.",
    ["kind"],
)
DECODE_STEP_SECONDS = Counter(
    "dd_decode_step_seconds",
    "Wall time of decode forwards (from planning to the logits), summed, by kind. Mean step time = this / "
    "dd_decode_steps_total.",
    ["kind"],
)
PREFETCH_LAYER_HIT_RATE = Histogram(
    "dd_prefetch_layer_hit_rate",
    "Per-layer prefetch hit rate of one (request, step): hits / (k x KV heads).",
    ["layer"],
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0),
)

# ----------------------------------------------------------------------------------------------
# Reader's guide. docs/metrics.md is generated from the objects above and these two dicts
# (``python -m dd_sglang.metrics.catalog > docs/metrics.md``; tests/test_metrics_catalog.py
# fails when the committed file differs). A series whose name ends in a base unit
# (``_bytes``, ``_seconds``) needs no UNITS entry.

#: Unit of each series whose name does not end in a base unit, by metric name (without ``_total``).
UNITS = {
    "dd_sparse_request_device_tokens_max": "tokens",
    "dd_dualpath_requests": "requests",
    "dd_dualpath_transitions": "transitions",
    "dd_sparse_decode_rows": "(request, layer) rows",
    "dd_sparse_exact_rows": "(request, layer) rows",
    "dd_extend_query_rows_skipped": "(token, layer) query rows",
    "dd_host_tier_rebuilt_tokens": "tokens",
    "dd_offload_unpinned": "offloads",
    "dd_dualpath_path_changes": "requests",
    "dd_pressure_offloads": "requests",
    "dd_prefetch_hits": "critical-set slots (tokens per layer and KV head)",
    "dd_prefetch_lookups": "critical-set slots (tokens per layer and KV head)",
    "dd_prefetch_mass_prefetched": "softmax probability mass, summed over KV heads",
    "dd_prefetch_mass_top_k": "softmax probability mass, summed over KV heads",
    "dd_prefetch_cold": "(request, layer) steps",
    "dd_prefetch_misses": "(request, layer) steps",
    "dd_prefetch_repaired_tokens": "tokens, summed over KV heads",
    "dd_prefetch_verified_hits": "critical-set slots (tokens per layer and KV head)",
    "dd_prefetch_verified_lookups": "critical-set slots (tokens per layer and KV head)",
    "dd_critical_set_recall_held": "critical-set slots (tokens per layer and KV head)",
    "dd_critical_set_recall_lookups": "critical-set slots (tokens per layer and KV head)",
    "dd_spec_proposed": "decode steps",
    "dd_spec_accepted": "decode steps",
    "dd_prefetch_layer_hit_rate": "ratio in [0, 1]",
    "dd_decode_steps": "decode forwards",
    "dd_cpu_heap_trims": "trims",
}

#: Label names and the values they take (bounded sets; never request ids).
LABEL_VALUES = {
    "state": "DualPath state: " + ", ".join(DUALPATH_STATES),
    "from": "DualPath state the request left: " + ", ".join(DUALPATH_STATES),
    "to": "DualPath state the request entered: " + ", ".join(DUALPATH_STATES),
    "selector": "critical-set selector: oracle, spec_host, spec_host_exact, quest_device, recency, host_sync",
    "speculator": "speculator: dual_token (selectors other than spec_host and spec_host_exact read no "
    "speculated token and count under none)",
    "policy": "miss policy: verify",
    "source": "cuda_allocator (CUDA) or cpu_device_pool (no accelerator)",
    "layer": "transformer layer index, 0 .. layers - 1",
    "phase": "decode step phase: plan, select, assemble, attention, select_ahead",
    "kind": "decode forward kind: sparse (had sparse rows) or dense",
    "reason": "why a request changed path: " + ", ".join(PATH_CHANGE_REASONS),
    "trigger": "what needed the device slots: " + ", ".join(PRESSURE_TRIGGERS),
}

#: How to read a series, beyond its help text (queries are PromQL).
READING = {
    "dd_device_kv_used_bytes": "Held by running requests = used - evictable. Compare with "
    "dd_device_kv_capacity_bytes for pool pressure; the evictable part is free to reclaim.",
    "dd_host_tier_used_bytes": "Never exceeds dd_host_tier_capacity_bytes less one padding page. "
    "Running sparse requests hold used - dd_host_tier_prefix_cache_bytes; the prefix cache is evicted "
    "(least recently used first) when a request needs room.",
    "dd_dualpath_requests": "All states return to 0 once the server is idle (republished within "
    "metrics.update_interval_s of the last batch, and before the scheduler sleeps).",
    "dd_dualpath_transitions": "rate(...) by (from, to). PREFILL_FULL -> DENSE counts requests the host "
    "tier could not take (they run densely, nothing is lost); REBUILD -> PREFILL_FULL counts new turns "
    "that reloaded a finished request's host pages.",
    "dd_dualpath_path_changes": "rate(...) by (reason). Under sparse.policy pressure, reason length stays 0 and "
    "pressure counts only the offloads load forced; at low load nothing changes path and every answer is dense's.",
    "dd_pressure_offloads": "rate(...) by (trigger). trigger retraction means decode outgrew the pool: the "
    "admission reservations (SGLang's new-token ratio) were too optimistic for the running dense requests.",
    "dd_prefetch_hits": "Hit rate = rate(dd_prefetch_hits_total) / rate(dd_prefetch_lookups_total), per "
    "(selector, speculator). Counted on sampled steps only (prefetch.hit_rate_sample of the decode steps): "
    "on such a step the real query's exact top-k per layer and KV head is computed and compared with the "
    "set the selector fixed one step earlier.",
    "dd_prefetch_lookups": "A lookup is one critical-set slot checked on a sampled step: a sampled "
    "(request, step) adds k x KV heads x layers lookups (k = the request's top_k). A request's first "
    "sparse step has nothing fixed in advance: it is counted in dd_prefetch_cold_total, not here.",
    "dd_prefetch_mass_prefetched": "Coverage = rate(this) / rate(dd_prefetch_mass_top_k_total): the share "
    "of the attention mass the exact top-k would capture that the prefetched set captured.",
    "dd_prefetch_verified_hits": "Prefetch hit rate over every step = rate(dd_prefetch_verified_hits_total) / "
    "rate(dd_prefetch_verified_lookups_total) per (selector, speculator), against the set the step attends "
    "(host_sync's top-k of the real query, which holds 0.999 of the exact top-k at k 256, "
    "bench/results/index_recall_cpu.json). 1 - hit rate is the share fetched synchronously; on a GPU "
    "that share waits, the rest arrived during earlier layers.",
    "dd_critical_set_recall_held": "rate(this) / rate(dd_critical_set_recall_lookups_total) = 1 means every "
    "sampled layer attended all of host_sync's set (guaranteed recall); below 1 would be a bug.",
    "dd_spec_accepted": "Acceptance = rate(dd_spec_accepted_total) / rate(dd_spec_proposed_total) per "
    "speculator. A rejected speculation degrades the next step's set toward the previous step's.",
    "dd_transfer_wait_seconds": "histogram_quantile(0.99, rate(dd_transfer_wait_seconds_bucket[5m])): "
    "the exposed copy wait per layer; near 0 means the transfer schedule hides the copies.",
    "dd_transfer_hidden_seconds": "Hidden share = rate(this) / rate(dd_transfer_copy_seconds_sum).",
    "dd_decode_steps": "Mean step time = rate(dd_decode_step_seconds_total) / rate(dd_decode_steps_total), "
    "by kind; the phases' share = rate(dd_step_phase_seconds_total) by (phase) / rate(dd_decode_step_seconds_total).",
    "dd_cpu_heap_trims": "Mean trim = rate(dd_cpu_heap_trim_seconds_total) / rate(dd_cpu_heap_trims_total). "
    "0 on a GPU host and with DD_SGLANG_CPU_HEAP_TRIM_S=0 (docs/operations-memory.md).",
    "dd_prefetch_layer_hit_rate": "Per-layer distribution of the per-(request, step) hit rate on sampled "
    "steps: a layer whose mass sits in low buckets is predicted badly.",
}
