# Two commands from a fresh machine: `make serve` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL ?= qwen2.5-coder-0.5b-instruct
PROMPT ?= Write a Python function that checks whether a string is a palindrome.

.PHONY: venv test serve bench bench-tpu-aot clean

venv: $(VENV)/.installed

# pip, not uv/poetry: the CPU torch wheel for the test extra is only visible to pip on this machine.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,demo,test]'
	touch $@

test: venv
	$(PY) -m pytest -q

# Until the HTTP server lands (issue 4), `make serve` runs a streamed chat generation with the default model.
serve: venv
	$(PY) -m rvjax.generate --model $(MODEL) --chat --prompt "$(PROMPT)" --max-tokens 128 --temperature 0

bench: venv
	$(PY) bench/offline.py

# TPU v6e AOT compiles on any machine: libtpu in its own venv, jax kept on the CPU backend.
TPU_VENV := .venv-tpu
$(TPU_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(TPU_VENV)/bin/python -m pip install -q -e '.[tpu]'
	touch $@

bench-tpu-aot: $(TPU_VENV)/.installed
	JAX_PLATFORMS=cpu $(TPU_VENV)/bin/python bench/gemma4_tpu_aot.py

clean:
	rm -rf $(VENV) $(TPU_VENV) .pytest_cache
