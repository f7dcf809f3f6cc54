"""Native CPU kernels, built on first use with the machine's C++ compiler and registered with
XLA as FFI custom calls (``jax.ffi``). Nothing here is needed for correctness: every caller
has a pure-XLA path, taken when the kernels are unavailable (no compiler, a failed build, a
non-CPU backend) or disabled (``SPECJAX_CPU_KERNELS=0``).

The build targets the machine's own CPU (``-march=native``; ``SPECJAX_KERNEL_ARCH`` names
another, e.g. ``haswell`` for AVX2 only) and is cached under ``$SPECJAX_CACHE/kernels``
(default ``~/.cache/specjax/kernels``), keyed by the sources, the compiler, the flags, jaxlib's
version and the CPU, and written atomically (a temp
file renamed into place), so concurrent processes (pytest-xdist) share one build safely.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

from specjax.paths import cache_root

SOURCES = ("panel_matmul.cc", "panel_dot_bf16.cc", "decode_attention.cc", "rope.cc", "rmsnorm.cc", "compact_rows.cc",
           "row_argmax.cc")
HEADERS = ("common.h",)
TARGETS = ("specjax_panel_matmul", "specjax_panel_matmul_bf16", "specjax_panel_dot_bf16", "specjax_decode_attention",
           "specjax_tree_attention", "specjax_rope", "specjax_rmsnorm", "specjax_compact_rows",
           "specjax_row_argmax")

_lock = threading.Lock()
_state: dict = {}


def disabled_by_env() -> bool:
    return os.environ.get("SPECJAX_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off")


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        path = shutil.which(cand) if cand else None
        if path:
            return path
    return None


def _build(cxx: str) -> Path:
    import jax
    import jaxlib

    here = Path(__file__).parent
    srcs = [here / s for s in SOURCES]
    hdrs = [here / s for s in HEADERS]
    arch = os.environ.get("SPECJAX_KERNEL_ARCH", "native")
    flags = ["-O3", f"-march={arch}", "-std=c++17", "-shared", "-fPIC", "-w"]
    includes = [f"-I{jax.ffi.include_dir()}", f"-I{here}"]  # paths: not part of the key
    ver = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256()
    for part in [*(f.read_bytes() for f in srcs + hdrs), ver.encode(), jaxlib.__version__.encode(),
                 " ".join(flags).encode(), platform.machine().encode(), _cpu_id().encode()]:
        h.update(part)
        h.update(b"\0")
    out_dir = cache_dir()
    lib = out_dir / f"libspecjax_cpu-{h.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        res = subprocess.run([cxx, *flags, *includes, *map(str, srcs), "-o", tmp], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{cxx} failed building {', '.join(SOURCES)} (exit {res.returncode}):\n"
                               f"{res.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load() -> bool:
    """Build (once per machine), load and register the kernels; True when they are usable.
    A failure is reported once as a warning and remembered for the process (see :func:`status`)."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        ok, why = False, None
        try:
            cxx = _compiler()
            if cxx is None:
                raise RuntimeError("no C++ compiler found (tried $CXX, g++, c++, clang++)")
            lib = ctypes.cdll.LoadLibrary(str(_build(cxx)))
            import jax

            for name in TARGETS:
                jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
            _state["lib"] = lib
            ok = True
        except Exception as e:  # any failure leaves the XLA path in place
            why = f"{type(e).__name__}: {e}"
            warnings.warn(f"specjax CPU kernels unavailable, decoding uses XLA's dots instead ({why})", stacklevel=2)
        _state["ok"], _state["why"] = ok, why
        return ok


def available(platform: str | None = None) -> bool:
    """The kernels are enabled (``SPECJAX_CPU_KERNELS`` not 0), the program is built for the CPU
    (``platform``, default :func:`specjax.placement.platform`: the devices of the program being
    traced, not the process's default backend) and they built."""
    if disabled_by_env():
        return False
    from specjax import placement

    return (platform or placement.platform()) == "cpu" and load()


def _build_flag(symbol: str) -> bool:
    """An ``int symbol()`` of the built library, read once through ctypes; False when the kernels
    are unavailable (:func:`available`)."""
    if not available("cpu"):
        return False
    with _lock:
        if symbol not in _state:
            _state[symbol] = bool(getattr(_state["lib"], symbol)())
        return _state[symbol]


def amx_tiles() -> bool:
    """The bf16-compute kernel (``specjax_panel_dot_bf16``) multiplies on AMX tiles: the build
    targets a CPU with ``amx_bf16`` and the OS let this process use the tiles. False when the
    kernels are unavailable (:func:`available`)."""
    return _build_flag("specjax_amx_tiles")


def dpbf16() -> bool:
    """The bf16-compute kernel's vector path multiplies with AVX512-BF16's ``vdpbf16ps`` (the build
    targets a CPU with it; else two float32 FMAs a pair). False when the kernels are unavailable."""
    return _build_flag("specjax_dpbf16")


def status() -> dict:
    """``{"enabled", "loaded", "reason"}`` for reports."""
    return {"enabled": not disabled_by_env(), "loaded": bool(_state.get("ok")), "reason": _state.get("why")}
