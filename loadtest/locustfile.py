"""Locust scenarios against dd_sglang's OpenAI-compatible API: the workloads users run.

Run a small bounded load with ``make loadtest`` (starts a ``dualdecoder`` server, runs
this file headless, stops the server, fails on any failed request or wrong answer), or
directly against any server::

    .venv/bin/locust -f loadtest/locustfile.py --headless -u 8 -r 2 -t 2m \\
        --host http://127.0.0.1:30000 --csv loadtest/results/load

Scenarios (Locust user classes; a wrong answer is a failed request):

* ``chat``: short chat turns (``/v1/chat/completions``); "capital of France" must say Paris.
* ``long_doc_qa``: a document of ``DD_LOAD_CONTEXT_TOKENS`` tokens (default 4000) with one
  fact (a 5-digit pass key) at a random depth, then the question; the answer must be the key.
* ``agent_multiturn``: a conversation that starts from a document of ``DD_LOAD_CONTEXT_TOKENS / 2``
  tokens and grows over ``DD_LOAD_TURNS`` turns (default 3): each turn resends the whole history
  plus the last answer and a new tool output, so every turn after the first reuses the previous
  turn's prefix (the device radix cache, or the host tier's prefix entry with ``dualdecoder``:
  REBUILD). Each turn asks for the key again and checks it. Requests are named ``agent-turn-N``.
* ``streaming``: streamed chat completions of up to 64 tokens; with probability
  ``DD_LOAD_CANCEL_P`` (default 0.5) the client hangs up after a random 1-16 chunks. A cancelled
  stream must have delivered well-formed chunks; a finished one must end with ``[DONE]`` and a
  finish reason.

Environment: ``DD_LOAD_MIX`` user weights, default ``chat=3,long_doc_qa=2,agent_multiturn=1,streaming=2``
(weight 0 drops a scenario); ``DD_LOAD_CONTEXT_TOKENS``; ``DD_LOAD_TURNS``; ``DD_LOAD_CANCEL_P``;
``DD_LOAD_API_KEY`` (sent as ``Authorization: Bearer``, for servers started with ``--api-key``);
``DD_LOAD_TIMEOUT_S`` per-request timeout (default 600).

Prompts are sized without a tokenizer from ``harness.prompts.FILLER_TOKENS`` (asserted against
SmolLM2's tokenizer in tests/test_server_e2e.py).
"""

from __future__ import annotations

import json
import os
import random
import re

from locust import HttpUser, between, task

from harness.prompts import FILLER, FILLER_TOKENS, INSTRUCTION


def _mix(spec: str) -> dict[str, int]:
    """``"chat=3,streaming=1"`` -> weights; unknown names or bad weights raise ValueError naming them."""
    out = {"chat": 3, "long_doc_qa": 2, "agent_multiturn": 1, "streaming": 2}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, weight = part.partition("=")
        if name not in out or not weight.isdigit():
            raise ValueError(f"DD_LOAD_MIX: expected name=weight with name in {sorted(out)}, got {part!r}")
        out[name] = int(weight)
    return out


MIX = _mix(os.environ.get("DD_LOAD_MIX", ""))
CONTEXT_TOKENS = int(os.environ.get("DD_LOAD_CONTEXT_TOKENS", "4000"))
TURNS = int(os.environ.get("DD_LOAD_TURNS", "3"))
CANCEL_P = float(os.environ.get("DD_LOAD_CANCEL_P", "0.5"))
TIMEOUT_S = float(os.environ.get("DD_LOAD_TIMEOUT_S", "600"))
HEADERS = (
    {"Authorization": f"Bearer {os.environ['DD_LOAD_API_KEY']}"} if os.environ.get("DD_LOAD_API_KEY") else {}
)
ANSWER = "<|im_start|>assistant\nThe pass key is "


def document(n_tokens: int, key: int) -> str:
    """About ``n_tokens`` tokens of text with the pass key stated once at a random depth."""
    n_fill = max(1, (n_tokens - 60) // FILLER_TOKENS)
    before = random.randint(0, n_fill)
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    return FILLER * before + needle + FILLER * (n_fill - before)


def key_ok(text: str, key: int) -> bool:
    return re.match(rf"\s*{key}\b", text) is not None


class _ApiUser(HttpUser):
    abstract = True

    def complete(self, prompt: str, name: str, max_tokens: int = 8):
        """POST a greedy completion; returns (Locust response context, text or None)."""
        return self.client.post(
            "/v1/completions",
            json={"model": "x", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
            headers=HEADERS,
            name=name,
            catch_response=True,
            timeout=TIMEOUT_S,
        )


class ChatUser(_ApiUser):
    weight = MIX["chat"]
    abstract = weight == 0
    wait_time = between(0.5, 2.0)

    @task
    def chat(self):
        q = random.choice(["What is the capital of France?", "Name a primary colour.", "What is 2 plus 2?"])
        with self.client.post(
            "/v1/chat/completions",
            json={
                "model": "x",
                "messages": [{"role": "user", "content": q}],
                "max_tokens": 16,
                "temperature": 0,
            },
            headers=HEADERS,
            name="chat",
            catch_response=True,
            timeout=TIMEOUT_S,
        ) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            content = r.json()["choices"][0]["message"]["content"]
            if not content.strip() or ("France" in q and "Paris" not in content):
                r.failure(f"wrong answer to {q!r}: {content!r}")


class LongDocQAUser(_ApiUser):
    weight = MIX["long_doc_qa"]
    abstract = weight == 0
    wait_time = between(1.0, 3.0)

    @task
    def long_doc_qa(self):
        key = random.randint(10000, 99999)
        prompt = (
            f"<|im_start|>user\n{INSTRUCTION}\n{document(CONTEXT_TOKENS, key)}\nWhat is the pass key?<|im_end|>\n"
            + ANSWER
        )
        with self.complete(prompt, f"long_doc_qa-{CONTEXT_TOKENS}") as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
            elif not key_ok(r.json()["choices"][0]["text"], key):
                r.failure(f"wrong answer: {r.json()['choices'][0]['text']!r} (key {key})")


class AgentMultiturnUser(_ApiUser):
    weight = MIX["agent_multiturn"]
    abstract = weight == 0
    wait_time = between(1.0, 3.0)

    @task
    def agent_multiturn(self):
        key = random.randint(10000, 99999)
        history = f"<|im_start|>user\n{INSTRUCTION}\n{document(CONTEXT_TOKENS // 2, key)}\nWhat is the pass key?<|im_end|>\n"
        for turn in range(1, TURNS + 1):
            prompt = history + ANSWER
            with self.complete(prompt, f"agent-turn-{turn}") as r:
                if r.status_code != 200:
                    r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                    return
                answer = r.json()["choices"][0]["text"]
                if not key_ok(answer, key):
                    r.failure(f"turn {turn}: wrong answer {answer!r} (key {key})")
                    return
            tool = FILLER * random.randint(2, 6)
            history = (
                prompt + answer + "<|im_end|>\n"
                f"<|im_start|>user\nTool output: {tool}\nRepeat the pass key.<|im_end|>\n"
            )


class StreamingUser(_ApiUser):
    weight = MIX["streaming"]
    abstract = weight == 0
    wait_time = between(0.5, 2.0)

    @task
    def streaming(self):
        cancel_after = random.randint(1, 16) if random.random() < CANCEL_P else None
        q = random.choice(["Tell me a short story about a lighthouse.", "Describe the water cycle.",
                           "Explain how a bicycle works."])  # fmt: skip
        name = "streaming-cancelled" if cancel_after else "streaming"
        with self.client.post(
            "/v1/chat/completions",
            json={"model": "x", "messages": [{"role": "user", "content": q}], "max_tokens": 64, "temperature": 0.7,
                  "stream": True},
            headers=HEADERS,
            name=name,
            catch_response=True,
            stream=True,
            timeout=TIMEOUT_S,
        ) as r:  # fmt: skip
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")
                return
            chunks, done, finish = 0, False, None
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                choice = json.loads(data)["choices"]
                if choice:
                    chunks += 1
                    finish = choice[0].get("finish_reason") or finish
                if cancel_after and chunks >= cancel_after:
                    break
            r.close()  # a cancelled stream: the client hangs up here
            if cancel_after:
                if chunks < 1:
                    r.failure("cancelled stream delivered no chunk")
            elif not done or finish not in ("stop", "length"):
                r.failure(f"stream ended without [DONE] or finish reason (done={done}, finish={finish})")
