"""Hook on ``sglang.srt.managers.tp_worker.TpModelWorker`` (the scheduler process).

* ``TpModelWorker.get_worker_info`` (AFTER): SGLang bounds a request's prompt by its device KV pool
  (``max_req_len = min(context_len, pool) - 1``, ``max_req_input_len = max_req_len - 5``): a longer
  prompt is refused with HTTP 400 before anything else is asked. With ``--radix-cache-backend
  dualdecoder`` and chunked prefill on, a prompt longer than the pool is prefilled chunk by chunk
  through the host tier (:meth:`dd_sglang.kvcache.offload.Offloader.offload_chunk`) and decodes
  sparsely, so both bounds become the context's alone (``context_len - 1`` and ``- 6``). The
  scheduler and, through it, the tokenizer manager read them from here; the host tier's own
  capacity is checked per request by ``patches/managers_tokenizer_manager.py``.
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.managers.tp_worker"
#: Positions of ``max_req_len`` and ``max_req_input_len`` in ``get_worker_info``'s tuple (SGLang 0.5.23).
MAX_REQ_LEN_AT, MAX_REQ_INPUT_LEN_AT = 4, 5


def TpModelWorker_get_worker_info(result, self, *args, **kwargs):
    server_args = getattr(self, "server_args", None)
    if server_args is None or getattr(server_args, "radix_cache_backend", None) != "dualdecoder":
        return result
    if (server_args.chunked_prefill_size or -1) <= 0:
        return result  # no chunks: a prompt must fit the pool whole
    from dd_sglang.kvcache.params import sglang_input_limits

    max_req_len, max_req_input_len = sglang_input_limits(int(self.model_config.context_len))
    info = list(result)
    info[MAX_REQ_LEN_AT] = max(info[MAX_REQ_LEN_AT], max_req_len)
    info[MAX_REQ_INPUT_LEN_AT] = max(info[MAX_REQ_INPUT_LEN_AT], max_req_input_len)
    return tuple(info)


HOOKS = [Hook(f"{_MODULE}.TpModelWorker.get_worker_info", TpModelWorker_get_worker_info, "AFTER")]
