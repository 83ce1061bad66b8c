"""Attention traces: the key rows each sparse layer read, written out for a check made apart from the server.

A server started with ``DD_SGLANG_TRACE_DIR`` (:data:`~dd_sglang.kvcache.params.TRACE_DIR_ENV`) traces
the requests that ask for it with ``custom_params.dd_trace: true`` (refused with a 400 on a server
without the variable). For every decode step in which such a request's row is sparse (not attended
exactly), after each layer's attention inputs are in place, the trace takes for that row:

* ``q``: the real query of the layer, ``[Hq, D]`` float32;
* ``read``: per KV head, the key rows the sparse attention reads for the real query, ``[Hkv, m, D]``
  in the tier's dtype (``m`` = the columns of the row's mask at query position 0), taken where the
  attention takes them (:func:`~dd_sglang.kernels.native_attend.sparse_attend`'s rules): the resident
  columns from the device pool where the fused C attention reads them there, else from the ring
  slot; the critical columns from the host tier where they are read in place, else from the ring slot;
* ``keys``: the host tier's keys of the positions not written in an earlier file of the request,
  ``[host_len - keys_from, Hkv, D]`` in position order, the tier's dtype.

One file per request and step, ``<dir>/<rid>/step_<n>.pt`` (``torch.save`` of a dict: ``rid``, ``step``
(0-based, counting the request's traced steps), ``seq_len`` (SGLang's sequence length of the step, its
new token included),
``top_k``, ``host_len``, ``win_start``, ``keep_pos`` (``[n]`` int64, the resident positions below the
window, sinks first), ``scale``, ``keys_from`` and ``layers``, one dict per layer with the three
tensors above). A request's candidate positions are ``[0, min(win_start, host_len))`` minus
``keep_pos`` (:mod:`dd_sglang.prefetch.scoring`). Per step a 2k-token request of the embedded model
writes ~0.3 MB (queries and rows read) plus its new keys (the first file: every prompt key, ~23 MB):
a debugging and test aid, not for traffic. ``tests/dualdecoder/test_attention_trace_e2e.py`` computes
the exact top-k of each layer from these files with plain PyTorch and checks the rows read hold it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from dd_sglang.kvcache.params import TRACE_DIR_ENV

logger = logging.getLogger(__name__)


class AttentionTrace:
    """Collects and writes the traced rows of each step (module docstring).

    Args:
        host: the host tier (``k`` ``[layers, slots, Hkv, D]``, ``layer_num``).
        directory: where files go; default the ``DD_SGLANG_TRACE_DIR`` environment variable, and
            without either nothing is ever traced.
    """

    def __init__(self, host, directory: str | os.PathLike | None = None):
        self.host = host
        d = directory if directory is not None else os.environ.get(TRACE_DIR_ENV)
        self.dir = Path(d) if d else None
        self.rows: list[tuple[int, dict]] = []  # (plan row, the file's dict) of the current step
        self._steps: dict[str, int] = {}  # rid -> traced steps written
        self._keys_upto: dict[str, int] = {}  # rid -> host positions whose keys a file holds

    def begin(self, plan, rt, fb) -> None:
        """Pick the plan's traced rows: requests of the KV-cache runtime ``rt`` (its ``requests``, rid ->
        ``SparseRequest``) whose ``choice.trace`` is set, outside the exact rows; ``fb``: the step's
        ``ForwardBatch`` (its ``seq_lens``, tokens by batch row, this step's included)."""
        self.rows = []
        if self.dir is None or plan is None:
            return
        exact, seq_lens = set(plan.exact.batch_rows), None
        for j, rid in enumerate(plan.requests.rids):
            st, b = rt.requests.get(rid), int(plan.rows[j])
            if st is None or not st.choice.trace or b in exact:
                continue
            if seq_lens is None:  # one host copy, only on a step with a traced row
                seq_lens = fb.seq_lens.to("cpu")
            host_len = int(st.host_len)
            frm = self._keys_upto.get(rid, 0)
            self.rows.append((j, {"rid": rid, "step": self._steps.get(rid, 0), "top_k": int(st.choice.top_k),
                                  "seq_len": int(seq_lens[b]),
                                  "host_len": host_len, "win_start": int(st.win_start),
                                  "keep_pos": st.keep_pos.detach().to("cpu", torch.int64).clone(),
                                  "keys_from": min(frm, host_len), "slots": st.host_slots[:host_len].clone(),
                                  "layers": []}))  # fmt: skip

    def layer(self, plan, layer: int, q3: torch.Tensor, scale: float, slot_k: torch.Tensor, pool_k: torch.Tensor,
              fused: bool, in_place_sets: tuple | None) -> None:  # fmt: skip
        """Record layer ``layer`` of the traced rows (module docstring): ``q3`` ``[tokens, Hq, D]`` the
        layer's queries; ``slot_k`` the ring slot ``[rows, Hkv, columns, D]``; ``pool_k`` the device pool's
        ``[slots, Hkv, D]`` keys; ``fused``: the fused C attention takes the layer (it then reads the
        resident set from the pool); ``in_place_sets``: the layer's in-place critical sets or None."""
        if not self.rows:
            return
        host_k = self.host.k[layer]
        n_res = plan.layout.n_res
        for j, rec in self.rows:
            cols = plan.layout.mask[j, 0].to("cpu").nonzero().flatten()
            read = slot_k[j][:, cols.to(slot_k.device)].to("cpu", copy=True)  # [Hkv, m, D]: the ring slot's
            if fused:  # the fused attention reads the resident columns from the device pool
                res = cols < n_res
                slots = plan.layout.res_slots[j].to("cpu")[cols[res]]
                read[:, res] = pool_k[slots.to(pool_k.device)].transpose(0, 1).to("cpu")
            if in_place_sets is not None:  # critical columns read in place from the host tier
                table = in_place_sets[2][j]  # [Hkv, k]
                crit = (cols >= n_res) & (cols < n_res + table.shape[1])
                for h in range(read.shape[0]):
                    hs = table[h, cols[crit] - n_res]
                    where = crit.nonzero().flatten()[hs >= 0]
                    read[h, where] = host_k[hs[hs >= 0], h].to("cpu")
            q = q3[int(plan.layout.qidx[j, 0])].detach().to("cpu", torch.float32, copy=True)
            keys = host_k[rec["slots"][rec["keys_from"] :]].to("cpu", copy=True)
            rec["layers"].append({"q": q, "read": read, "keys": keys})
            rec["scale"] = float(scale)

    def end(self) -> None:
        """Write the step's files; then forget the step."""
        for _, rec in self.rows:
            if len(rec["layers"]) != self.host.layer_num:
                continue  # the step did not run every layer: nothing written
            rid = rec["rid"]
            out = self.dir / rid.replace("/", "_")
            out.mkdir(parents=True, exist_ok=True)
            del rec["slots"]
            torch.save(rec, out / f"step_{rec['step']}.pt")
            self._steps[rid] = rec["step"] + 1
            self._keys_upto[rid] = rec["host_len"]
        self.rows = []

    def release(self, rid: str) -> None:
        """Forget a finished request."""
        self._steps.pop(rid, None)
        self._keys_upto.pop(rid, None)
