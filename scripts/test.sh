#!/usr/bin/env bash
# The test command of the README: install kivi-jax with its test extras, then run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test]"
python -m pytest "$@"
