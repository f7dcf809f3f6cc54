"""One process of the multi-process GGUF-cache + speculative-loop test (run as a script, never
collected by pytest).

    python mp_spec_worker.py PROCESS_ID NUM_PROCESSES PORT GGUF DRAFT_DIR CACHE_DIR OUT_DIR

Each process has 2 CPU devices (gloo); together: ``data=2, fsdp=1, tensor=2`` over 4 devices,
so the batch is split across the processes. Every process loads the GGUF target with a cache
directory (process 0 alone writes the HF export, the others wait and read it), loads the EAGLE-3
draft sharded (verifier weights read back from the cached directory), runs the speculative loop
and writes what it saw.
"""

import json
import sys
from pathlib import Path

pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
gguf, draft_dir, cache_dir, out_dir = sys.argv[4:8]
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import specjax.sharding as shd  # noqa: E402

assert shd.initialize(f"127.0.0.1:{port}", nproc, pid, timeout_s=60)

from specjax.decode import speculative as spec  # noqa: E402
from specjax.models import loading  # noqa: E402

exports = []
_export = loading.export_hf_dir


def counting_export(*args, **kwargs):
    exports.append(str(args[3] if len(args) > 3 else kwargs["out"]))
    return _export(*args, **kwargs)


loading.export_hf_dir = counting_export
mesh = shd.make_mesh("data=2,fsdp=1,tensor=2")
lt = shd.load_target(gguf, mesh, cache_dir=cache_dir, progress=False)
again = shd.load_target(gguf, mesh, cache_dir=cache_dir, progress=False)
sd = spec.load_spec_draft(draft_dir, lt, mesh=mesh)
prompts = json.loads(Path(out_dir, "prompts.json").read_text())
res = spec.speculative_generate_ids(lt.model, sd, prompts, k=3, max_new_tokens=6, eos_token_ids=[], prompt_bucket=16,
                                    verifier_accept_k=40, accept_tolerance=1.0)
q = lt.model.model.layers[0].self_attn.q_proj.kernel.get_value()
Path(out_dir, f"proc{pid}.json").write_text(json.dumps({
    "exports": exports, "kind": lt.kind, "source": lt.source, "again": again.kind, "tokens": res.tokens,
    "hist": res.stats.hist.tolist(), "rounds": res.rounds, "q_local_shards": len(q.addressable_shards),
    "fc_spec": list(sd.module.fc.kernel.get_value().sharding.spec), "main": shd.is_main_process()}))
shd.sync("done")
shd.shutdown()
