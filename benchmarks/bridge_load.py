"""Bridge load benchmark: a Qwen3-8B EAGLE-3-shaped draft (bf16, ~2 GB), built once.

Times in the same run (a) a raw read of every tensor with the safetensors library (framework "flax":
numpy cannot hold bf16)
and (b) a bridge load to device arrays (`load_checkpoint(...).to_device()`), each in a
fresh subprocess so peak RSS is its own. Prints one JSON line.

Goal (issue 2): time ratio b/a <= 1.1 and bridge peak RSS <= 1.2 x file size.
Threads are pinned to one (XLA, OpenMP) for steadier numbers on a shared 2-core machine.

    .venv/bin/python benchmarks/bridge_load.py [--dir DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

THREADS = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
           "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}


def build(d: Path) -> Path:
    """Write the checkpoint once (random bf16 values, real shapes)."""
    import numpy as np

    import bridge
    from tests.bridge.headers import qwen3_8b_eagle3

    ck_dir = d / "qwen3-8b-eagle3"
    if (ck_dir / ".complete").exists():
        return ck_dir
    tmp = Path(tempfile.mkdtemp(dir=d))
    hdr = qwen3_8b_eagle3(tmp)  # config + header-only file with the real shapes
    cfg = bridge.read_config(hdr)
    store = bridge.open_tensors(hdr)
    rng = np.random.default_rng(0)
    flat = {}
    for n in store.names:
        info = store.info(n)
        if info.dtype == "BOOL":
            a = np.zeros(info.shape, bool)
            a[np.sort(rng.choice(info.shape[0], 32000, replace=False))] = True
        elif info.dtype == "I64":
            a = np.arange(info.shape[0], dtype=np.int64)
        else:
            a = (rng.standard_normal(info.shape, dtype=np.float32) * 0.02).astype(info.np_dtype)
        flat[n] = a
    if ck_dir.exists():
        import shutil

        shutil.rmtree(ck_dir)
    bridge.save_checkpoint(ck_dir, cfg, flat=flat, progress=True)
    (ck_dir / ".complete").write_text("ok")
    return ck_dir


RAW = """
import resource, sys, time
import jax
from safetensors import safe_open
jax.numpy.zeros(1).block_until_ready()
t = time.perf_counter()
total = 0
with safe_open(sys.argv[1] + "/model.safetensors", "flax") as f:  # numpy has no bf16; flax = jax arrays
    keep = [f.get_tensor(k) for k in f.keys()]
    total = sum(a.nbytes for a in keep)
dt = time.perf_counter() - t
print(dt, total, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""

BRIDGE = """
import resource, sys, time
import jax
import bridge
jax.numpy.zeros(1).block_until_ready()  # backend start-up is not load time
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter()
tree = bridge.load_checkpoint(sys.argv[1]).to_device(progress=False)
total = sum(x.nbytes for x in jax.tree.leaves(tree))
dt = time.perf_counter() - t
print(dt, total, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, base)
"""


def run(code: str, ck: Path) -> list[float]:
    env = {**os.environ, **THREADS, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code, str(ck)], env=env, capture_output=True, text=True, check=True)
    return [float(x) for x in out.stdout.split()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=str(ROOT / ".cache" / "bench"))
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    ck = build(d)
    size = (ck / "model.safetensors").stat().st_size
    subprocess.run(["cat", str(ck / "model.safetensors")], stdout=subprocess.DEVNULL, check=True)  # warm page cache
    raw_t, br_t, raw_rss, br_rss, br_base = [], [], [], [], []
    for _ in range(a.repeats):  # interleaved, so both see the same machine state
        t, _, rss = run(RAW, ck)
        raw_t.append(t)
        raw_rss.append(rss)
        t, _, rss, base = run(BRIDGE, ck)
        br_t.append(t)
        br_rss.append(rss)
        br_base.append(base)
    res = {
        "benchmark": "bridge_load", "checkpoint": "qwen3-8b-eagle3 shapes, bf16", "file_bytes": size,
        "threads": 1, "repeats": a.repeats,
        "raw_safetensors_s": min(raw_t), "bridge_to_device_s": min(br_t),
        "time_ratio": min(br_t) / min(raw_t),
        "raw_peak_rss_bytes": min(raw_rss), "bridge_peak_rss_bytes": min(br_rss),
        "bridge_runtime_baseline_rss_bytes": min(br_base),
        "bridge_rss_over_file": min(br_rss) / size,
        "bridge_rss_over_file_excl_runtime": (min(br_rss) - min(br_base)) / size,
        "goal": {"time_ratio": 1.1, "rss_over_file": 1.2},
    }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
