#!/usr/bin/env bash
# One entry point for set-up, the main job and the test suite. Idempotent: it creates .venv on first use and
# reinstalls only when constraints.txt, tools/requirements-dev.txt or a package's pyproject.toml changed.
#   bash tools/dev.sh demo       # set up, then run the main job (hyspec generate) on the embedded default
#   bash tools/dev.sh test       # set up, then pytest (all packages) + mypy --strict + ruff
#   bash tools/dev.sh selfcheck  # set up, then run every kernel against its PyTorch reference
#   bash tools/dev.sh setup      # set up only
#   bash tools/dev.sh device-wheels  # here: download into .whl the wheels the lent GPU machine's image lacks
#   bash tools/dev.sh gpu [cmd..]    # there (carry .whl): install them into /tmp/site, then run cmd with the
#                                    # packages on PYTHONPATH (default: selfcheck + every GPU test in one process)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${HYSPEC_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
PACKAGES=(kernels statepool attn-backends models spec-workers runner server testing)

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
    # on a CPU machine one worker per core (pytest-xdist; the root conftest keeps each at one torch thread),
    # modules kept whole; with CUDA one process (GPU tests size their memory for a GPU of their own)
    workers=()
    if [ "${TRITON_INTERPRET:-}" = "1" ]; then workers=(-n auto --dist loadscope); fi
    "$VENV/bin/python" -m pytest packages -q "${workers[@]}" "$@" || status=$?
    # exit 5 = no tests collected (for example a selection that only matches GPU tests)
    if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
    "$VENV/bin/python" -m mypy -p hyspec_kernels -p hyspec_statepool -p hyspec_attn_backends \
      -p hyspec_models -p hyspec_spec_workers -p hyspec_runner -p hyspec_server -p hyspec_testing
    "$VENV/bin/python" -m ruff check packages tools
    "$VENV/bin/python" -m ruff format --check packages tools
    ;;
  device-wheels)
    # the server's and the tests' pure-Python (and a few binary) dependencies missing from the GPU image,
    # pinned to this venv's versions (see .library/device/README.md on carrying wheels)
    setup
    mkdir -p .whl
    plat=()
    for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do plat+=(--platform "manylinux_${n}_x86_64"); done
    plat+=(--platform manylinux2014_x86_64)
    for name in fastapi starlette pydantic pydantic_core annotated-types annotated-doc typing-inspection \
      uvicorn xgrammar apache-tvm-ffi openai jiter distro sniffio httpx2 httpcore2 truststore \
      opentelemetry-api importlib_metadata jsonschema jsonschema-specifications referencing rpds-py \
      flash-linear-attention fla-core; do
      # (not matplotlib and its dependencies: the GPU image has them, a benchmark's PNG was drawn there with
      # none carried on 2026-11-29, and with them the carried tree passes the 64 MiB a call may take)
      # this venv's version where it has the package (else the newest)
      version=$("$VENV/bin/python" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
      "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plat[@]}" -d .whl "$name${version:+==$version}" 2>&1 | grep -v '^WARNING' || true
    done
    ls .whl
    ;;
  gpu)
    # on the lent GPU machine: its python3 has torch, triton and transformers; the rest comes from .whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl >/dev/null
    PYTHONPATH=/tmp/site:$(printf '%s:' "$ROOT"/packages/*/src)
    export PYTHONPATH PYTHONUNBUFFERED=1
    if [ "$#" -eq 0 ]; then
      python3 -m hyspec_kernels.selfcheck
      exec python3 -m pytest packages -m gpu -q -rf -p no:cacheprovider
    fi
    exec "$@"
    ;;
  *) echo "usage: bash tools/dev.sh {demo|test|selfcheck|setup|device-wheels|gpu} [args]" >&2; exit 2 ;;
esac
