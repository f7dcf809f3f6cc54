"""One process of the multi-process test (run as a script, never collected by pytest).

    python mp_worker.py PROCESS_ID NUM_PROCESSES PORT TARGET_DIR OUT_DIR

Each process has 2 CPU devices (gloo collectives); together they form the mesh
``data=1, fsdp=2, tensor=2`` over 4 devices. Every process loads the same HF checkpoint sharded
(reading only its slices), runs the forward and the greedy generate loop under jit with
explicit shardings, and writes what it saw; process 0 also writes the (replicated) results.
"""

import json
import sys
from pathlib import Path

pid, nproc, port, target_dir, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import specjax.sharding as shd  # noqa: E402

assert shd.initialize(f"127.0.0.1:{port}", nproc, pid, timeout_s=60)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from specjax.decode.generate import generate_ids  # noqa: E402
from specjax.models.params import param_paths  # noqa: E402

mesh = shd.make_mesh("data=1,fsdp=2,tensor=2")
read: dict = {}
lt = shd.load_target(target_dir, mesh, progress=False,
                     on_slice=lambda path, index, n: read.__setitem__(path, read.get(path, 0) + n))

specs = {}
for path, var in param_paths(lt.model).items():
    a = var.get_value()
    specs[shd.path_str(path)] = [list(a.sharding.spec), len(a.addressable_shards), list(a.addressable_shards[0].data.shape)]

ids = np.asarray(json.loads(Path(out_dir, "ids.json").read_text()), np.int32)
graphdef, state = nnx.split(lt.model)
fwd = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x).logits,
              in_shardings=(shd.shardings_of(state), shd.batch_sharding(mesh, 2)), out_shardings=shd.replicated(mesh))
logits = np.asarray(fwd(state, shd.put(ids, shd.batch_sharding(mesh, 2))))
res = generate_ids(lt.model, ids[:3, :5].tolist(), max_new_tokens=4, eos_token_ids=[])

Path(out_dir, f"proc{pid}.json").write_text(json.dumps({
    "process_index": jax.process_index(), "process_count": jax.process_count(), "devices": jax.device_count(),
    "local_devices": jax.local_device_count(), "main": shd.is_main_process(), "specs": specs, "bytes_read": read,
    "tokens": res.tokens}))
if shd.is_main_process():
    np.save(Path(out_dir, "logits.npy"), logits)
shd.sync("done")
shd.shutdown()
