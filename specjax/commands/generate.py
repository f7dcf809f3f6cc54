"""`specjax generate`: target-only or (with ``--draft``) speculative generation on the command line.

The decode loops and the target loader (jax, flax) are imported inside the command, so that
`specjax --help` stays fast."""

from __future__ import annotations

import json
import time
from typing import List, Optional

import typer

from bridge.errors import BridgeError
from specjax.commands.common import console, download_option, draft_dir, fail, fetch_target
from specjax.sharding import cli as shcli
from specjax.sharding import describe, is_main_process


def register(app: typer.Typer) -> None:
    app.command("generate")(generate_cmd)


def generate_cmd(
    prompt: List[str] = typer.Option(..., "--prompt", "-p", help="prompt text (repeat for a batch)"),
    target: str = typer.Option("default", "--target", "-t",
                               help="'default' (embedded SmolLM2), a .gguf file, an HF model dir, or an HF repo id "
                                    "(local HF cache; --download fetches it)"),
    chat: bool = typer.Option(False, "--chat", help="render each prompt as a user message with the chat template"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
    top_k: int = typer.Option(0, "--top-k", min=0, help="0 = off"),
    seed: int = typer.Option(0, "--seed"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (keep) | float32 | bfloat16 | float16"),
    compute: str = typer.Option("float32", "--compute", help="float32 | bfloat16: the matmuls' arithmetic on one CPU "
                                "device (bfloat16: bf16 products with float32 sums on the CPU kernels)"),
    cache_dir: Optional[str] = typer.Option(None, "--cache-dir",
                                            help="cache a dequantised GGUF as an HF dir here (also SPECJAX_CACHE_DIR)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    draft: Optional[str] = typer.Option(None, "--draft", "-d",
                                        help="speculative decoding with this draft: a speculators checkpoint dir or HF "
                                             "repo id, or 'self' / 'self:M' (the target's first M layers)"),
    k: Optional[int] = typer.Option(None, "--k", min=1, help="draft tokens per round (default: the checkpoint's)"),
    draft_sampling: str = typer.Option("greedy", "--draft-sampling",
                                       help="with --draft: greedy proposals (speculators default) | sample"),
    lossless: bool = typer.Option(False, "--lossless",
                                  help="with --draft: ignore the checkpoint's verifier_accept_k/accept_tolerance"),
    tree: Optional[str] = typer.Option(None, "--tree",
                                       help="with --draft: draft a static token tree, vLLM's speculative_token_tree "
                                            "path list, e.g. \"[(0,), (1,), (0, 0)]\" (EAGLE-3, MTP, self drafts)"),
    tree_topk: Optional[int] = typer.Option(None, "--tree-topk", min=1, help="with --draft: a dynamic (EAGLE-2) tree: "
                                            "children per expanded node (with --tree-depth, --tree-nodes)"),
    tree_depth: Optional[int] = typer.Option(None, "--tree-depth", min=1, help="dynamic tree: levels"),
    tree_nodes: Optional[int] = typer.Option(None, "--tree-nodes", min=1, help="dynamic tree: drafted nodes kept"),
    mesh: str = shcli.mesh_option(),
    coordinator: Optional[str] = shcli.coordinator_option(),
    num_processes: Optional[int] = shcli.num_processes_option(),
    process_id: Optional[int] = shcli.process_id_option(),
    download: bool = download_option(),
):
    """Generate continuations with the target alone, or speculatively with --draft (either way the
    whole decode loop is one jit; speculative greedy output equals the target's)."""
    from specjax.decode.tree_loop import tree_option
    from specjax.models import panels
    from specjax.sharding.placement import Placement

    fetch_target(target, download=download)  # repo ids: into the local HF cache (only with --download)
    draft = draft_dir(draft, download=download)
    try:
        dev_mesh = shcli.setup(mesh, coordinator, num_processes, process_id)  # before any other JAX work
        panels.check_compute(compute, dev_mesh)
        tree_spec = tree_option(tree, topk=tree_topk, depth=tree_depth, num_nodes=tree_nodes)
        if tree_spec is not None and draft is None:
            raise ValueError("a token tree (--tree / --tree-topk ...) needs --draft")
        t0 = time.perf_counter()
        dt = None if dtype == "auto" else dtype
        lt = Placement.of(dev_mesh).load_target(target, dtype=dt, cache_dir=cache_dir, progress=not as_json)
        t1 = time.perf_counter()
        outs, stats = _decode(prompt, lt, draft, tree_spec, dev_mesh, chat=chat, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, dtype=dt, k=k,
                              draft_sampling=draft_sampling, lossless=lossless, compute=compute)
        t2 = time.perf_counter()
    except (BridgeError, ValueError) as e:
        fail(e, code=getattr(e, "exit_code", 2))
    if not is_main_process():  # multi-process: every process ran the same program; one prints
        return
    _print_generated(prompt, outs, stats, lt=lt, draft=draft, dev_mesh=dev_mesh, times=(t0, t1, t2), as_json=as_json)


def _decode(prompt: List[str], lt, draft: Optional[str], tree_spec, dev_mesh, *, chat, max_new_tokens, temperature,
            top_p, top_k, seed, dtype, k, draft_sampling, lossless, compute="float32"):
    """Which loop decodes: a token tree, the target alone, or a speculative chain with ``draft``.
    Returns ``(outputs, acceptance stats or None)``."""
    from specjax.decode.generate import generate
    from specjax.decode.speculative import speculative_generate
    from specjax.decode.tree_loop import tree_generate

    if tree_spec is not None:
        return tree_generate(prompt, tree=tree_spec, target=lt, draft=draft, chat=chat, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, dtype=dtype,
                             draft_sampling=draft_sampling, mesh=dev_mesh, compute=compute)
    if draft is None:
        return generate(prompt, target=lt, chat=chat, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_p=top_p, top_k=top_k, seed=seed, mesh=dev_mesh, compute=compute), None
    return speculative_generate(prompt, target=lt, draft=draft, chat=chat, max_new_tokens=max_new_tokens, k=k,
                                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, dtype=dtype,
                                draft_sampling=draft_sampling, lossless=lossless, mesh=dev_mesh, compute=compute)


def _print_generated(prompt: List[str], outs, stats, *, lt, draft, dev_mesh, times, as_json: bool) -> None:
    """The completions: one JSON object, or each text on stdout with its timing and acceptance on stderr."""
    t0, t1, t2 = times
    n_tok = sum(len(o.token_ids) for o in outs)
    if as_json:
        print(json.dumps({
            "target": lt.source, "kind": lt.kind, "load_s": round(t1 - t0, 3), "generate_s": round(t2 - t1, 3),
            **({"mesh": describe(dev_mesh)} if dev_mesh.size > 1 else {}),
            **({"draft": draft, "acceptance": stats.to_dict()} if stats is not None else {}),
            "completions": [{"prompt": p, "text": o.text, "token_ids": o.token_ids,
                             "prompt_tokens": len(o.prompt_token_ids), "stop_reason": o.stop_reason}
                            for p, o in zip(prompt, outs)],
        }, ensure_ascii=False))
        return
    out = console()
    for i, (p, o) in enumerate(zip(prompt, outs)):
        if len(outs) > 1:
            out.print(f"[bold]--- {i}[/bold] ({o.stop_reason}, {len(o.token_ids)} tokens)", markup=True)
        print(o.text)
    console(stderr=True).print(f"{n_tok} tokens in {t2 - t1:.2f}s (incl. compile); load {t1 - t0:.2f}s", style="dim")
    if stats is not None:
        console(stderr=True).print(
            f"draft {draft}: k={stats.k}, tau {stats.tau:.2f} tokens per target forward, per-position acceptance "
            + ", ".join(f"{x:.2f}" for x in stats.per_position) + (" (lossy acceptance)" if stats.lossy else ""),
            style="dim")
