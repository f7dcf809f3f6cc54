"""`specjax bench`: target-only vs speculative decoding over a prompt file, on one device or a
device mesh (``--mesh``; several processes with ``--coordinator/--num-processes/--process-id``:
every process runs the bench, process 0 prints and writes the JSON and the plot).

``--prompts`` given several times benches each prompt set in turn in one process: the target and
the draft load once, and a set whose prompts pad to the buckets of an earlier one reuses its
compiled loops (the main job's code and prose benches: one start-up, load and compile instead of
two). ``--json`` then prints one line per set; ``--plot`` and ``--out`` take ``{name}`` (the set's
name: a file's stem, a builtin set's name), replaced per set.

The decode loop and the target loader (jax, flax) are imported inside the command, so that
`specjax --help` stays fast."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from bridge.errors import BridgeError
from specjax.commands.common import console, download_option, draft_dir, fail, fetch_target
from specjax.sharding import cli as shcli
from specjax.sharding import describe, is_main_process, sync
from specjax.train.prompts import PromptIds, read_prompts


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_cmd)


def bench_prompts(spec: str, *, max_samples: int | None = None, shuffle_seed: int | None = None) -> list:
    """Prompts through the one prompt reader (:func:`specjax.train.prompts.read_prompts`), in the
    forms ``specjax.decode.bench.encode`` takes: a single user turn as its text (``--no-chat``
    applies), a conversation up to its last user turn as messages, token ids as a list of ints."""
    out = []
    for r in read_prompts(spec, max_samples=max_samples, shuffle_seed=shuffle_seed,
                          accept=("conversation", "prompt_ids")):
        if isinstance(r, PromptIds):
            out.append(r.ids)
            continue
        last_user = max(i for i, t in enumerate(r) if t["role"] == "user")
        turns = r[: last_user + 1]
        out.append(turns[0]["content"] if len(turns) == 1 else turns)
    return out


def set_name(spec: str) -> str:
    """A prompt set's short name for ``{name}`` in ``--plot`` / ``--out``: a file's or directory's
    stem (``runs/eval/code.jsonl`` -> ``code``), a builtin set's name (``builtin:eval-code:16`` ->
    ``eval-code``), an hf set's id with ``/`` as ``-``."""
    s = spec.strip()
    if s.startswith("builtin:"):
        return s.split(":")[1]
    if s.startswith("hf:"):
        return s[3:].split(":")[0].replace("/", "-")
    return Path(s.rstrip("/")).stem or s


def set_paths(pattern: Optional[str], names: List[str], option: str) -> List[Optional[str]]:
    """``pattern`` with ``{name}`` replaced by each set's name; one set may leave it out. Several
    sets need ``{name}`` in it and distinct names (else ValueError naming ``option``)."""
    if pattern is None:
        return [None] * len(names)
    if len(names) > 1:
        if "{name}" not in pattern:
            raise ValueError(f"{option} {pattern!r}: with {len(names)} --prompts sets it must contain '{{name}}' "
                             f"(replaced by each set's name: {', '.join(names)})")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"{option}: two --prompts sets share the name {dup[0]!r}; give them distinct file names")
    return [pattern.replace("{name}", n) for n in names]


def bench_cmd(
    prompts: List[str] = typer.Option(..., "--prompts", help="a .jsonl/.json/.parquet/.arrow file, a directory of them, "
                                      "a save_to_disk directory, hf:<id>[:<config>][:<split>] or builtin:<set>[:<n>]; "
                                      "records: {prompt|text}, {conversations|messages} (up to the last user turn), "
                                      "{prompt_ids}; give it several times to bench each set in turn in one process"),
    target: str = typer.Option("default", "--target", "-t", help="'default' (embedded SmolLM2), a .gguf file, an HF "
                               "model dir, or an HF repo id (local HF cache; --download fetches it)"),
    draft: str = typer.Option("self", "--draft", "-d",
                              help="a speculators draft directory or HF repo id, or 'self' / 'self:M' (a draft "
                                   "from the target's first M layers; 'self' = all layers, an oracle)"),
    k: Optional[int] = typer.Option(None, "--k", min=1, help="draft tokens per round (default: the checkpoint's)"),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
    top_k: int = typer.Option(0, "--top-k", min=0),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", min=1),
    batch_size: int = typer.Option(4, "--batch-size", "-b", min=1),
    max_samples: Optional[int] = typer.Option(None, "--max-samples", "--limit", min=1,
                                              help="use only the first N prompts (after --shuffle-seed)"),
    shuffle_seed: Optional[int] = typer.Option(None, "--shuffle-seed", help="shuffle the prompts first"),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="render string prompts with the chat template"),
    draft_sampling: str = typer.Option("greedy", "--draft-sampling",
                                       help="greedy (speculators default, point-mass q) | sample"),
    lossless: bool = typer.Option(False, "--lossless",
                                  help="ignore the checkpoint's verifier_accept_k/accept_tolerance"),
    seed: int = typer.Option(0, "--seed"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (keep) | float32 | bfloat16 | float16"),
    compute: str = typer.Option("float32", "--compute", help="float32 | bfloat16: the matmuls' arithmetic on one CPU "
                                "device, every side alike (bfloat16: bf16 products with float32 sums on the CPU "
                                "kernels, AMX tiles where the CPU has them)"),
    cache_dir: Optional[str] = typer.Option(None, "--cache-dir", help="cache a dequantised GGUF as an HF dir here"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON line"),
    plot_path: Optional[str] = typer.Option(None, "--plot", help="write a PNG: per-position acceptance and the "
                                            "tokens-per-step histogram ('{name}': the set's name)"),
    out_path: Optional[str] = typer.Option(None, "--out", help="write the JSON report to this file too, atomically "
                                           "('{name}': the set's name; needed with several --prompts)"),
    repeats: int = typer.Option(1, "--repeats", min=1, help="interleaved passes; each side's fastest is kept"),
    prompt_bucket: int = typer.Option(32, "--prompt-bucket", min=8,
                                      help="prompts pad to a multiple of this; one compile of each loop per "
                                      "multiple in use (larger: fewer compiles, more padded prefill)"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="progress bar over prompts (stderr)"),
    tree: Optional[str] = typer.Option(None, "--tree", help="also bench a token tree (sharded with --mesh): 'auto' "
                                       "(calibrate per-depth/per-rank acceptance on the first --tree-calibration "
                                       "batches, time each candidate's verify and draft, pick the best predicted "
                                       "speedup) or "
                                       "vLLM's speculative_token_tree path list, e.g. \"[(0,), (1,), (0, 0)]\""),
    tree_topk: Optional[int] = typer.Option(None, "--tree-topk", min=1, help="a dynamic (EAGLE-2) tree: children "
                                            "per expanded node (with --tree-depth, --tree-nodes)"),
    tree_depth: Optional[int] = typer.Option(None, "--tree-depth", min=1, help="dynamic tree: levels"),
    tree_nodes: Optional[int] = typer.Option(None, "--tree-nodes", min=1, help="dynamic tree: drafted nodes kept"),
    tree_calibration: int = typer.Option(4, "--tree-calibration", min=1,
                                         help="--tree auto: batches decoded with the calibration tree"),
    mesh: str = shcli.mesh_option(),
    coordinator: Optional[str] = shcli.coordinator_option(),
    num_processes: Optional[int] = shcli.num_processes_option(),
    process_id: Optional[int] = shcli.process_id_option(),
    download: bool = download_option(),
):
    """Measure speculative decoding against the target alone: acceptance (tau, per position), tokens/s,
    speedup, the draft/target cost ratio c and the speedup the formula predicts from them."""
    try:
        names = [set_name(p) for p in prompts]
        plots, outs = set_paths(plot_path, names, "--plot"), set_paths(out_path, names, "--out")

        def report(rep, dev_mesh):  # the main process, as each set finishes
            if as_json:
                print(json.dumps(rep.data), flush=True)
            else:
                _print_bench(rep.data, dev_mesh)

        _run_bench(
            mesh=mesh, coordinator=coordinator, num_processes=num_processes, process_id=process_id, prompts=prompts,
            target=target, draft=draft, k=k, temperature=temperature, top_p=top_p, top_k=top_k,
            max_new_tokens=max_new_tokens, batch_size=batch_size, max_samples=max_samples, shuffle_seed=shuffle_seed,
            chat=chat, draft_sampling=draft_sampling, lossless=lossless, seed=seed, dtype=dtype, cache_dir=cache_dir,
            plot_paths=plots, out_paths=outs, repeats=repeats, prompt_bucket=prompt_bucket, progress=progress,
            download=download, tree=tree, tree_topk=tree_topk, tree_depth=tree_depth, tree_nodes=tree_nodes,
            tree_calibration=tree_calibration, on_report=report, compute=compute)
    except (BridgeError, ValueError) as e:
        fail(e, code=getattr(e, "exit_code", 2))


def _run_bench(*, mesh, coordinator, num_processes, process_id, prompts, target, draft, k, temperature, top_p, top_k,
               max_new_tokens, batch_size, max_samples, shuffle_seed, chat, draft_sampling, lossless, seed, dtype,
               cache_dir, plot_paths, out_paths, repeats, prompt_bucket, progress, download, tree=None, tree_topk=None,
               tree_depth=None, tree_nodes=None, tree_calibration=4, on_report=None, compute="float32"):
    """Set up the devices, read every prompt set, load the target and draft once (into the mesh's
    shardings when it has several devices) and run both sides on each set in turn; process 0 draws
    each set's plot, writes its ``--out`` file and hands its report to ``on_report(report,
    device mesh)`` as the set finishes."""
    from specjax import storage
    from specjax.decode import bench, bench_plot
    from specjax.decode.sampling import SamplingParams
    from specjax.decode.speculative import load_spec_draft
    from specjax.decode.tree_loop import tree_option
    from specjax.sharding.placement import Placement
    from specjax.models import panels

    dev_mesh = shcli.setup(mesh, coordinator, num_processes, process_id)  # before any other JAX work
    sharded = dev_mesh.size > 1
    auto = tree is not None and tree.strip() == "auto"
    tree_spec = "auto" if auto else tree_option(tree, topk=tree_topk, depth=tree_depth, num_nodes=tree_nodes)
    if auto and any(x is not None for x in (tree_topk, tree_depth, tree_nodes)):
        raise ValueError("--tree auto chooses a static tree; drop --tree-topk/--tree-depth/--tree-nodes")
    panels.check_compute(compute, dev_mesh)
    main = is_main_process()
    progress = progress and main
    dt = None if dtype == "auto" else dtype
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if draft_sampling not in ("greedy", "sample"):
        raise ValueError(f"--draft-sampling must be 'greedy' or 'sample', got {draft_sampling!r}")
    # every set read (and checked) before any model loads
    raws = [bench_prompts(p, max_samples=max_samples, shuffle_seed=shuffle_seed) for p in prompts]
    fetch_target(target, download=download)  # repo ids: into the local HF cache (only with --download)
    draft = draft_dir(draft, download=download)
    lt = Placement.of(dev_mesh).load_target(target, dtype=dt, cache_dir=cache_dir, progress=progress)
    sd = load_spec_draft(draft, lt, dtype=dt, mesh=dev_mesh)
    tok = lt.tokenizer
    for spec, raw, plot_path, out_path in zip(prompts, raws, plot_paths, out_paths):
        ids = bench.encode(lt, raw, chat=chat)
        rep = bench.run_bench(lt.model, sd, ids, k=k, sampling=sampling, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, seed=seed, eos_token_ids=lt.eos_token_ids,
                              pad_id=tok.pad_token_id if tok is not None else None, draft_sampling=draft_sampling,
                              lossless=lossless, progress=progress, repeats=repeats, prompt_bucket=prompt_bucket,
                              extra={"target": lt.source, "prompts_source": spec},
                              mesh=dev_mesh if sharded else None, tree=tree_spec, tree_calibration=tree_calibration,
                              compute=compute)
        if plot_path:
            if main:
                bench_plot.plot(rep, plot_path)
            sync("specjax-bench-plot")
            rep.data["plot"] = plot_path
        if out_path and main:
            storage.write_text(out_path, json.dumps(rep.data) + "\n")
        if main and on_report is not None:
            on_report(rep, dev_mesh)


def _print_bench(d: dict, dev_mesh) -> None:
    """The bench report for a reader: acceptance, speeds, the cost ratio and the predicted speedup."""
    sharded = dev_mesh.size > 1
    out = console()
    out.print(f"[bold]{d['algorithm']}[/bold] draft {d['draft']} on {d['target']}: k={d['k']}, "
              f"{d['prompts']} prompts, batch {d['batch_size']}, temperature {d['temperature']}"
              + (f", {describe(dev_mesh)}" if sharded else ""), markup=True)
    out.print(f"tau {d['tau']:.3f} tokens/forward (alpha {d['alpha']:.3f}); per-position acceptance "
              + ", ".join(f"{x:.2f}" for x in d["per_position_acceptance"]) + (" [lossy]" if d["lossy"] else ""))
    out.print(f"target-only {d['target_only']['tok_s']:.1f} tok/s, speculative {d['speculative']['tok_s']:.1f} tok/s: "
              f"speedup {d['speedup']:.2f}x")
    c = d["cost"]
    out.print(f"cost: c = {c['c']:.3f} (draft round {c['draft_round_ms']:.1f} ms / k x step "
              f"{c['target_step_ms']:.1f} ms), verify {c['verify_overhead']:.2f}x a step")
    out.print(f"predicted {d['predicted_speedup']:.2f}x (tau/(k c + 1)); measured/predicted "
              f"{d['speedup_over_predicted']:.2f}; with the measured verify cost "
              f"{d['predicted_speedup_with_verify_cost']:.2f}x "
              f"(ratio {d['speedup_over_predicted_with_verify_cost']:.2f})")
    if "identical_greedy_outputs" in d:
        out.print(f"identical greedy outputs: {d['identical_greedy_outputs']}")
    if "tree" in d:
        _print_tree(out, d)


def _print_tree(out, d: dict) -> None:
    t = d["tree"]
    shape = (f"{t['nodes']} nodes, depth {t['depth']}" if t["kind"] == "static"
             else f"dynamic top-{t['topk']}, depth {t['depth']}, {t['nodes']} nodes")
    if "auto" in t:
        a = t["auto"]
        out.print("tree auto: rank acceptance by depth (rank 0..): "
                  + "; ".join(", ".join(f"{x:.2f}" for x in row) for row in a["calibration"]["rank_acceptance"]))
        for c in a["candidates"]:
            out.print(f"  {c['nodes']:>3} nodes depth {c['depth']}: predicted tau {c['predicted_tau']:.2f}, "
                      f"draft {c['draft_ms']:.1f} ms + verify {c['verify_ms']:.1f} ms, predicted "
                      f"{c['predicted_speedup']:.2f}x")
    out.print(f"tree ({shape}): tau {t['tau']:.3f}, {t['speculative']['tok_s']:.1f} tok/s: speedup {t['speedup']:.2f}x "
              f"({t['speedup_over_chain']:.2f}x the chain), predicted {t['predicted_speedup']:.2f}x; verify "
              f"{t['cost']['verify_ms']:.1f} ms ({t['cost']['verify_overhead']:.2f}x a step), draft "
              f"{t['cost']['draft_ms']:.1f} ms" + (f"; identical greedy outputs {t['identical_greedy_outputs']}"
                                                    if "identical_greedy_outputs" in t else ""))
    if t["kind"] == "static":
        out.print(f"tree paths: {[tuple(p) for p in t['paths']]}")
