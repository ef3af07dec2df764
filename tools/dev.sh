#!/usr/bin/env bash
# One entry point for set-up, the main job and the test suite. Idempotent: it creates .venv on first use and
# reinstalls only when constraints.txt, tools/requirements-dev.txt or a package's pyproject.toml changed.
#   bash tools/dev.sh demo       # set up, then run the main job (hyspec generate) on the embedded default
#   bash tools/dev.sh test       # set up, then pytest (all packages) + mypy --strict + ruff
#   bash tools/dev.sh selfcheck  # set up, then run every kernel against its PyTorch reference
#   bash tools/dev.sh setup      # set up only
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${HYSPEC_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
PACKAGES=(kernels statepool attn-backends models spec-workers server testing)

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  local stamp="$VENV/.hyspec-stamp" want
  want=$(cat constraints.txt tools/requirements-dev.txt packages/*/pyproject.toml | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    local editables=()
    for p in "${PACKAGES[@]}"; do editables+=(-e "packages/$p"); done
    # one pip call, so siblings resolve from the working tree rather than the registry
    PIP_CONSTRAINT="$ROOT/constraints.txt" "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
      -r tools/requirements-dev.txt "${editables[@]}"
    echo "$want" > "$stamp"
  fi
  # Triton kernels run on CPU only under its interpreter, which must be on before any kernel is defined.
  if ! "$VENV/bin/python" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    export TRITON_INTERPRET=1
  fi
}

cmd=${1:-test}
shift || true
case "$cmd" in
  setup) setup ;;
  demo)
    setup
    # the embedded default: the trained Qwen3.5-architecture demo model with MTP speculation. Greedy
    # decoding of a model this small loops, so the demo samples (settings shown in the stats line).
    if [ "$#" -eq 0 ]; then
      set -- --prompt $'import os\n\n\ndef read_lines(path):\n    """Return the lines of a text file, without trailing newlines."""' \
        --max-tokens 96 --temperature 0.7 --top-p 0.95 --repetition-penalty 1.1
    fi
    "$VENV/bin/hyspec" generate "$@"
    ;;
  selfcheck)
    setup
    "$VENV/bin/python" -m hyspec_kernels.selfcheck "$@"
    ;;
  test)
    setup
    status=0
    "$VENV/bin/python" -m pytest packages -q "$@" || status=$?
    # exit 5 = no tests collected (for example a selection that only matches GPU tests)
    if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
    "$VENV/bin/python" -m mypy -p hyspec_kernels -p hyspec_statepool -p hyspec_attn_backends \
      -p hyspec_models -p hyspec_spec_workers -p hyspec_server -p hyspec_testing
    "$VENV/bin/python" -m ruff check packages tools
    "$VENV/bin/python" -m ruff format --check packages tools
    ;;
  *) echo "usage: bash tools/dev.sh {demo|test|selfcheck|setup} [args]" >&2; exit 2 ;;
esac
