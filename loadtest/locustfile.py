"""Locust load scenarios against dd_sglang's OpenAI-compatible API.

Run (bounded; loopback only)::

    .venv/bin/locust -f loadtest/locustfile.py --headless -u 4 -r 2 -t 60s \
        --host http://127.0.0.1:30000

Users:

* ``ChatUser``: short chat turns (``/v1/chat/completions``), weight 3.
* ``LongContextUser``: passkey prompts of ``DD_LOAD_PROMPT_TOKENS`` tokens
  (default 2000) over ``/v1/completions``; a wrong passkey counts as a failure,
  so quality under load is measured, not only latency. Weight 1.
"""

from __future__ import annotations

import os
import random
import re

from locust import HttpUser, between, task

from bench.prompts import FILLER, FILLER_TOKENS, INSTRUCTION

PROMPT_TOKENS = int(os.environ.get("DD_LOAD_PROMPT_TOKENS", "2000"))


def _passkey_prompt(key: int) -> str:
    n_fill = max(1, (PROMPT_TOKENS - 120) // FILLER_TOKENS)
    before = random.randint(0, n_fill)
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    body = FILLER * before + needle + FILLER * (n_fill - before)
    return (
        f"<|im_start|>user\n{INSTRUCTION}\n{body}\nWhat is the pass key?<|im_end|>\n"
        "<|im_start|>assistant\nThe pass key is "
    )


class ChatUser(HttpUser):
    weight = 3
    wait_time = between(0.5, 2.0)

    @task
    def chat(self):
        q = random.choice(["What is the capital of France?", "Name a primary colour.", "What is 2 plus 2?"])
        self.client.post(
            "/v1/chat/completions",
            json={
                "model": "x",
                "messages": [{"role": "user", "content": q}],
                "max_tokens": 16,
                "temperature": 0,
            },
            name="chat",
        )


class LongContextUser(HttpUser):
    weight = 1
    wait_time = between(1.0, 3.0)

    @task
    def passkey(self):
        key = random.randint(10000, 99999)
        with self.client.post(
            "/v1/completions",
            json={"model": "x", "prompt": _passkey_prompt(key), "max_tokens": 8, "temperature": 0},
            name=f"passkey-{PROMPT_TOKENS}",
            catch_response=True,
        ) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")
            elif not re.match(rf"\s*{key}\b", r.json()["choices"][0]["text"]):
                r.failure(f"wrong passkey: {r.json()['choices'][0]['text']!r}")
            else:
                r.success()
