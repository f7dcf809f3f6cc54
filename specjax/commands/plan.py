"""`specjax plan`: compile a recipe's programs for a TPU slice on this host (deviceless, abstract
params) and print, per program, whether it fits and its roofline."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from specjax.commands.common import console, fail


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)


def plan_cmd(
    config: str = typer.Option(..., "--config", "-c", help="a training recipe (YAML)"),
    topology: str = typer.Option(..., "--topology", help="TPU slice: v5e:2x4, v6e:2x4, v5p:2x2x2, v4:2x2x4, ..."),
    mesh: str = typer.Option("data=1,tensor=-1", "--mesh",
                             help="mesh preset, YAML file or inline sizes over the slice's chips"),
    programs: str = typer.Option("train,extract,generate,speculate", "--programs",
                                 help="comma-separated: train, extract, generate, speculate, verify (k + 1 rows), "
                                 "tree (the tree loop and one tree round), train-online (data.online: the target "
                                 "inside the train step)"),
    batch: Optional[int] = typer.Option(None, "--batch", min=1,
                                        help="rows (train/extract; default data x fsdp) or sequences (decode; default 1)"),
    seq: Optional[int] = typer.Option(None, "--seq", min=8, help="train/extract row length (default data.total_seq_len)"),
    prompt_len: int = typer.Option(2048, "--prompt-len", min=1, help="decode: prompt tokens"),
    new_tokens: int = typer.Option(2048, "--new-tokens", min=1, help="decode: max new tokens"),
    k: Optional[int] = typer.Option(None, "--k", min=1, help="speculate: draft tokens per round; verify: drafted tokens or tree nodes, k + 1 rows "
                                   "(default loss.ttt_steps)"),
    tree: Optional[str] = typer.Option(None, "--tree", help="tree program: vLLM's speculative_token_tree path list "
                                       "(default \"[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]\")"),
    target: Optional[str] = typer.Option(None, "--target",
                                         help="target config: a config.json, an HF dir, a cached hub id or a preset "
                                              "hub id (default: the recipe's target)"),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, help="scale the target down to this many layers"),
    overrides: List[str] = typer.Option([], "--set", help="recipe override KEY=VALUE (repeatable)"),
    scan_layers: Optional[str] = typer.Option(None, "--scan-layers",
                                              help="the target's layers: off (unrolled), on (stored stacked as "
                                              "loading stores them under SPECJAX_SCAN_LAYERS=1; every forward "
                                              "and the decode loops under lax.scan) or auto (forwards without a "
                                              "KV cache scan where a layer's residual stream outweighs its "
                                              "weights per chip); default $SPECJAX_SCAN_LAYERS, else off"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON list of objects"),
):
    """Compile the recipe's programs for a TPU topology without a TPU (libtpu: pip install
    "specjax[tpu]") and report per chip: memory vs HBM, flops, bytes, roofline, collectives."""
    from bridge.errors import BridgeError
    from specjax.models.layer_scan import SCAN_SETTINGS, layer_scan, scan_setting
    from specjax.plan import PlanError, TopologyError, plan
    from specjax.sharding.errors import ShardingError
    from specjax.train.config import load_recipe
    from specjax.train.errors import TrainError

    c = console()
    if scan_layers is not None and scan_layers not in SCAN_SETTINGS:
        fail(ValueError(f"--scan-layers {scan_layers!r}: expected one of {', '.join(SCAN_SETTINGS)}"))
    try:
        cfg = load_recipe(config, list(overrides))
        with layer_scan(scan_layers or scan_setting()):
            rows = plan(cfg, topology, mesh=mesh, programs=programs, target=target,
                        target_overrides=None if layers is None else {"num_hidden_layers": layers}, batch=batch,
                        seq=seq, prompt_len=prompt_len, new_tokens=new_tokens, k=k, tree=tree,
                        on_report=None if as_json else lambda r: c.print(_line(r)))
    except (PlanError, TopologyError, ShardingError, TrainError, BridgeError) as e:
        fail(e)
    if as_json:
        print(json.dumps([r.to_dict() for r in rows]))
    elif rows:
        c.print(f"\n{rows[0].topology}, {rows[0].mesh}")


def _line(r) -> str:
    shape = " ".join(f"{k}={v}" for k, v in r.shape.items())
    if not r.compiled:
        extra = f" (needs {r.peak_gib:.2f} GiB of {r.hbm_gib:g})" if r.peak_gib is not None else ""
        return f"[bold]{r.program}[/bold] {shape}: [red]not compiled[/red]{extra}: {r.error[:400]}"
    fit = "[green]fits[/green]" if r.fits else "[red]does not fit[/red]"
    coll = ", ".join(f"{k} {v}" for k, v in r.collectives.items() if v) or "none"
    return (f"[bold]{r.program}[/bold] {shape}\n"
            f"  memory/chip: args {r.argument_gib:.2f} + out {r.output_gib:.2f} - alias {r.alias_gib:.2f} + temp "
            f"{r.temp_gib:.2f} + code {r.code_gib:.2f} = peak {r.peak_gib:.2f} GiB (+ resident {r.resident_gib:.2f}) "
            f"of {r.hbm_gib:g}: {fit}, headroom {r.headroom_pct:.1f}%"
            + (f" (layers scanned; unrolled: peak {r.unrolled_peak_gib:.2f} GiB, {r.unrolled_hbm_bytes:.3g} B of HBM "
               f"traffic)" if r.unrolled_peak_gib is not None else "")
            + f"\n  per {r.per}: {r.flops:.3g} flop"
            + (f" ({r.kernel_flops:.3g} in flash attention)" if r.kernel_flops else "")
            + f", {r.hbm_bytes:.3g} B of HBM traffic (XLA's count {r.bytes:.3g}) -> roofline {r.roofline_ms:.3f} ms ({r.bound}-bound), "
            f"{r.tok_per_s:,.0f} tok/s ceiling, MFU ceiling {r.mfu_ceiling:.2f}\n"
            f"  collectives: {coll}; compile {r.compile_s:.1f} s"
            + (f" + step {r.step_compile_s:.1f} s" if r.step_compile_s is not None else "")
            + (f" + unrolled twin {r.cost_compile_s:.1f} s" if r.cost_compile_s is not None else ""))
