"""Per-rank ``dd_`` series: each scheduler process registers its data-parallel rank, the sidecar labels by it.

With ``--dp-size N`` SGLang runs N scheduler replicas (times ``--tp-size``
processes each), all writing into the one ``$PROMETHEUS_MULTIPROC_DIR``.
prometheus-client's multiprocess merge would add every replica's series
together. Instead:

1. Each scheduler process calls :func:`register_process` once (from the
   scheduler-metrics hook): it writes ``dd_rank_<pid>.json`` =
   ``{"dp_rank": d, "tp_rank": t}`` into the metrics folder (atomically, by
   rename). prometheus-client reads only ``*.db`` files there.
2. :class:`RankMergingCollector` (the sidecar's collector) merges the
   ``*.db`` files of the processes of each DP rank separately, with
   prometheus-client's own ``MultiProcessCollector.merge`` (so each metric's
   multiprocess mode applies inside a rank: byte gauges sum over the rank's TP
   shards), and adds the label ``dp_rank="<d>"`` to every ``dd_`` sample.
   Files of processes that registered no rank (SGLang's HTTP server and
   detokenizer, which write no ``dd_`` series) count as rank 0.
3. Series of other prefixes (SGLang's ``sglang:`` series) are merged over
   all processes exactly as before, without the label.

The label set stays bounded: ``dp_rank`` takes ``--dp-size`` values. The
server's total of a series is ``sum without (dp_rank) (...)`` (``max`` for
``dd_sparse_request_device_tokens_max``).
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict

from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.samples import Sample

#: The label the sidecar adds to every ``dd_`` sample.
RANK_LABEL = "dp_rank"
RANK_FILE_PREFIX = "dd_rank_"
#: Prefix of the series labelled by rank.
LABELLED_PREFIX = "dd_"

_registered: set[int] = set()


def register_process(
    multiproc_dir: str | None, dp_rank: int, tp_rank: int = 0, pid: int | None = None
) -> bool:
    """Record that process ``pid`` (default: this one) is DP rank ``dp_rank``, TP rank ``tp_rank``.

    Writes ``<multiproc_dir>/dd_rank_<pid>.json`` once per pid; a no-op without a folder.
    Returns True when the file was written now.

    Raises:
        ValueError: a negative rank.
    """
    if dp_rank < 0 or tp_rank < 0:
        raise ValueError(f"dp_rank and tp_rank must be >= 0, got {dp_rank}, {tp_rank}")
    pid = os.getpid() if pid is None else pid
    if not multiproc_dir or pid in _registered:
        return False
    path = os.path.join(multiproc_dir, f"{RANK_FILE_PREFIX}{pid}.json")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"dp_rank": int(dp_rank), "tp_rank": int(tp_rank)}, f)
    os.replace(tmp, path)
    _registered.add(pid)
    return True


def process_ranks(multiproc_dir: str) -> dict[str, int]:
    """``{pid: dp_rank}`` of every registered process in ``multiproc_dir`` (pids as strings)."""
    out = {}
    for path in glob.glob(os.path.join(multiproc_dir, f"{RANK_FILE_PREFIX}*.json")):
        pid = os.path.basename(path)[len(RANK_FILE_PREFIX) : -len(".json")]
        try:
            with open(path) as f:
                out[pid] = int(json.load(f)["dp_rank"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _pid_of(db_file: str) -> str:
    """``counter_123.db`` / ``gauge_livesum_123.db`` -> ``"123"`` (prometheus-client's file naming)."""
    return os.path.basename(db_file)[: -len(".db")].rsplit("_", 1)[-1]


class RankMergingCollector:
    """A prometheus-client collector over a multiprocess folder whose ``dd_`` samples carry ``dp_rank``.

    Args:
        multiproc_dir: the ``PROMETHEUS_MULTIPROC_DIR`` SGLang's processes write into.
        registry: a ``CollectorRegistry`` to register with (optional).
    """

    def __init__(self, multiproc_dir: str, registry=None):
        self.path = multiproc_dir
        if registry is not None:
            registry.register(self)

    def collect(self):
        files = glob.glob(os.path.join(self.path, "*.db"))
        ranks = process_ranks(self.path)
        by_rank: dict[int, list[str]] = defaultdict(list)
        for f in files:
            by_rank[ranks.get(_pid_of(f), 0)].append(f)
        out: dict[str, Metric] = {}
        for metric in MultiProcessCollector.merge(files, accumulate=True):
            if not metric.name.startswith(LABELLED_PREFIX):
                out[metric.name] = metric
        for rank in sorted(by_rank):
            for metric in MultiProcessCollector.merge(by_rank[rank], accumulate=True):
                if not metric.name.startswith(LABELLED_PREFIX):
                    continue
                merged = out.get(metric.name)
                if merged is None:
                    merged = out[metric.name] = Metric(metric.name, metric.documentation, metric.type)
                label = str(rank)
                merged.samples.extend(
                    Sample(s.name, {**s.labels, RANK_LABEL: label}, s.value, s.timestamp, s.exemplar)
                    for s in metric.samples
                )
        return list(out.values())
