"""Sharded load benchmark: the ~2 GB Qwen3-8B EAGLE-3-shaped draft of ``bridge_load.py`` (bf16),
loaded straight into NamedShardings on 1 vs 8 fake CPU devices.

Each run is a fresh subprocess (its own peak RSS; the device count is fixed before jax starts)
that places every tensor of ``bridge.load_checkpoint(p).tree`` (memory-map views) straight into
its ``DRAFT_RULES`` sharding, each device's slice cut from the map:

* ``slices`` - ``specjax.sharding.slice_loader`` (what ``specjax.sharding.load_target`` /
  ``load_draft`` use): page-aligned slice copies in chunks, file pages released as they are used;
* ``bridge`` - ``Checkpoint.to_device(sharding=specjax.sharding.sharding_fn(...))`` (bridge's own
  callback, pages released per tensor).

(The module path, ``specjax.sharding.load_draft``, cannot run on this file: its random t2d/d2t
disagree, which ``load_draft`` rightly refuses.)

Meshes: ``1x1x1`` (1 device), ``1x1x8`` (tensor) and ``1x8x1`` (fsdp; kernels split on their input
dim, so each slice is a strided read). Peak RSS is per process (``ru_maxrss``); the runtime's own
RSS after start-up is reported as ``baseline``. On CPU every device buffer lives in host memory,
so a split checkpoint costs about one copy in total whatever the device count; replicated axes
(``data``) would multiply it. Threads pinned to one (as bridge_load.py). Prints one JSON line.

    .venv/bin/python benchmarks/sharded_load.py [--dir DIR] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bridge_load import build  # noqa: E402  (writes the checkpoint once)

THREADS = "--xla_cpu_multi_thread_eigen=false"

RUN = """
import resource, sys, time
import jax
mode, sizes, path = sys.argv[1], tuple(int(s) for s in sys.argv[2].split(",")), sys.argv[3]
import bridge
import specjax.sharding as shd
from bridge.layout import iter_leaves, set_path
mesh = shd.make_mesh(sizes)
jax.numpy.zeros(1).block_until_ready()  # backend start-up is not load time
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter()
ck = bridge.load_checkpoint(path)
if mode == "bridge":
    tree = ck.to_device(sharding=shd.sharding_fn(ck.tree, shd.DRAFT_RULES, mesh), progress=False)
else:
    shd.partition_specs(ck.tree, shd.DRAFT_RULES, mesh)
    place = shd.slice_loader(mesh, shd.DRAFT_RULES)
    tree = {}
    for p, view in iter_leaves(ck.tree):
        set_path(tree, p, place(p, view))
leaves = jax.tree.leaves(tree)
jax.block_until_ready(leaves)
dt = time.perf_counter() - t
total = sum(x.nbytes for x in leaves)
local = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
print(dt, total, local, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, base)
"""


def run(mode: str, sizes: str, ck: Path) -> list[float]:
    n = 1
    for s in sizes.split(","):
        n *= int(s)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "TF_CPP_MIN_LOG_LEVEL": "3", "XLA_FLAGS": f"--xla_force_host_platform_device_count={n} {THREADS}"}
    out = subprocess.run([sys.executable, "-c", RUN, mode, sizes, str(ck)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{mode} mesh {sizes} failed:\n{out.stderr[-3000:]}")
    return [float(x) for x in out.stdout.split()[-5:]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=str(ROOT / ".cache" / "bench"))
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    ck = build(d)
    size = (ck / "model.safetensors").stat().st_size
    subprocess.run(["cat", str(ck / "model.safetensors")], stdout=subprocess.DEVNULL, check=True)  # warm page cache
    cases = [(m, s) for m in ("slices", "bridge") for s in ("1,1,1", "1,1,8", "1,8,1")]
    best: dict = {}
    for _ in range(a.repeats):  # interleaved, so every case sees the same machine state
        for mode, sizes in cases:
            t, total, local, rss, base = run(mode, sizes, ck)
            key = f"{mode}_{sizes.replace(',', 'x')}"
            prev = best.get(key)
            best[key] = {"load_s": round(min(t, prev["load_s"]) if prev else t, 3),
                         "peak_rss_bytes": int(min(rss, prev["peak_rss_bytes"]) if prev else rss),
                         "baseline_rss_bytes": int(min(base, prev["baseline_rss_bytes"]) if prev else base),
                         "array_bytes": int(total), "device_bytes": int(local)}
    for v in best.values():
        v["rss_over_file_excl_runtime"] = round((v["peak_rss_bytes"] - v["baseline_rss_bytes"]) / size, 3)
    res = {"benchmark": "sharded_load", "checkpoint": "qwen3-8b-eagle3 shapes, bf16", "file_bytes": size,
           "threads": 1, "repeats": a.repeats, "runs": best}
    for mode in ("slices", "bridge"):
        one = best[f"{mode}_1x1x1"]
        for name, sizes in (("tensor8", "1x1x8"), ("fsdp8", "1x8x1")):
            r = best[f"{mode}_{sizes}"]
            res[f"{mode}_time_ratio_{name}_over_1"] = round(r["load_s"] / one["load_s"], 3)
            res[f"{mode}_rss_ratio_{name}_over_1"] = round(r["peak_rss_bytes"] / one["peak_rss_bytes"], 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
