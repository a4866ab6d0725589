# `make test` and `make demo` set themselves up: they create .venv on first use (torch's CPU wheel
# first, then everything pinned by constraints.txt), so a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export LITELLM_LOCAL_MODEL_COST_MAP := True
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: test test-fast test-vllm demo bench venv clean browser clis extension

venv: $(STAMP) extension

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "agl: installing into $(VENV) (first run takes about 2 minutes)"
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

# The sidecar's C token encoder is compiled in the tree (next to its source) by the editable install,
# so `git clean -x` removes it while .venv and its stamp survive: rebuild it (only the package, no
# dependencies, offline) when it is missing or older than its source and a C compiler is here. Without
# one the install skips it (an optional extension) and the sidecar runs its pure-Python path.
EXTENSION_SOURCE := sidecar/agl_sidecar/_token_elements.c
extension: $(STAMP)
	@built=$$(ls $(EXTENSION_SOURCE:.c=)*.so 2>/dev/null | head -n 1); \
	if { [ -z "$$built" ] || [ $(EXTENSION_SOURCE) -nt "$$built" ]; } && command -v cc >/dev/null 2>&1; then \
		echo "agl: building the sidecar's C token encoder ($(EXTENSION_SOURCE))"; \
		$(BIN)/pip install -q --no-deps --no-build-isolation -e . ; \
	fi

test: $(STAMP) extension browser clis
	$(BIN)/python -m pytest -q

# Debian's headless Chromium for the trace viewer's browser tests (tests/viewer/test_browser.py):
# installed only when missing, as root, with apt-get; never fails the build (the tests then skip).
browser:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "agl: installing Debian's chromium for the viewer's browser tests"; \
		export DEBIAN_FRONTEND=noninteractive; \
		(apt-get install -y -q chromium >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) || \
		echo "agl: could not install chromium; the viewer's browser tests will skip"; \
	fi

# The coding-agent CLIs the harness tests run through the sidecar (tests/harnesses/), at the versions
# testing/clis/package-lock.json pins, from the npm registry, into testing/clis/node_modules: installed
# when missing or older than the lock file; never fails the build (those tests then skip, saying why).
CLIS_STAMP := testing/clis/node_modules/.installed-stamp
clis: $(CLIS_STAMP)

$(CLIS_STAMP): testing/clis/package.json testing/clis/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		echo "agl: installing the coding-agent CLIs for the harness tests (npm ci in testing/clis)"; \
		(cd testing/clis && npm ci --no-audit --no-fund --loglevel=error >/dev/null) && touch $@ || \
		echo "agl: could not install the coding-agent CLIs; the harness tests will skip"; \
	else echo "agl: npm not found; the harness tests that run the coding-agent CLIs will skip"; fi

test-fast: $(STAMP) extension
	$(BIN)/python -m pytest -q -m 'not slow and not vllm and not gpu'

demo: $(STAMP) extension
	$(BIN)/agl demo

# Every benchmark in its quick form (each under a few minutes); run one without --quick for the
# numbers quoted in docs/results.md. bench/_*.py are shared helpers; bench/gpu_step.py needs a GPU
# (scripts/gpu_check.sh runs it).
bench: $(STAMP) extension
	@for script in bench/*.py; do \
		case $$script in bench/_*|bench/gpu_step.py) continue;; esac; \
		echo "== $$script --quick"; $(BIN)/python $$script --quick || exit 1; \
	done

clean:
	rm -rf $(VENV) .venv-vllm runs .pytest_cache testing/clis/node_modules

# Real vLLM (the CPU build, in its own venv: it conflicts with verl's pins) under the `vllm` marker.
test-vllm: $(STAMP) extension
	bash scripts/setup_vllm_venv.sh
	$(BIN)/python -m pytest -q -m vllm tests/vllm tests/export
