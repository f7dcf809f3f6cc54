"""`specjax data ...`: build training data (prompts -> target rows -> hidden states -> vocab).

The target, the pipeline and the hidden-state extractor (jax, flax) are imported inside the
commands that use them, so that `specjax --help` stays fast."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from bridge.atomic import atomic_file
from bridge.errors import BridgeError
from specjax import storage
from specjax.commands.common import console, download_option, fail, fetch_target
from specjax.sharding import cli as shcli
from specjax.sharding import is_main_process
from specjax.train.dataset import read_meta, read_rows
from specjax.train.errors import PromptFileError
from specjax.train.prompts import builtin_prompts
from specjax.train.vocab import (
    TOKEN_FREQ_NAME, build_vocab_mapping, load_token_freq, save_token_freq, save_vocab_mapping, token_frequencies,
)

data_app = typer.Typer(help="Training data: prompts, target-regenerated rows, hidden-state caches, t2d/d2t.",
                       no_args_is_help=True, add_completion=False)


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")


def _ids(text: Optional[str]) -> Optional[list[int]]:
    if not text:
        return None
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected integers like '2,15,27'") from None


def _log(msg: str) -> None:
    if is_main_process():
        console(stderr=True).print(msg, style="dim")


def _load_target(target: str, dev_mesh, progress: bool, download: bool = False):
    """The target on ``dev_mesh`` (straight into its shardings) when it has several devices, else
    on the default device; with ``download`` a repo id is fetched into the HF cache first."""
    from specjax.sharding.placement import Placement

    fetch_target(target, download=download)
    return Placement.of(dev_mesh).load_target(target, progress=progress)


@data_app.command("prepare")
def prepare_cmd(
    out: Optional[str] = typer.Option(None, "--out", "-o", help="data directory to create (or resume), local or a "
                                      "bucket URL (gs://b/data); with --config, the recipe's data.path"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="a training recipe (configs/*.yaml): build its "
                                          "data.path from its data.prepare settings, as `specjax train` would"),
    set_: List[str] = typer.Option([], "--set", "-s", help="with --config: recipe override, key=value"),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="'default', a .gguf, an HF dir or a cached repo "
                                         "id [default: the recipe's target, else 'default']"),
    prompts: List[str] = typer.Option(["builtin:stdlib"], "--prompts", "-p",
                                      help="builtin:<stdlib|stdlib-code|stdlib-source|eval-code|eval-prose>[:<n>], "
                                           "hf:<id>[:<config>][:<split>] (local HF datasets cache), a .jsonl/.json/"
                                           ".parquet/.arrow file, a save_to_disk directory or a directory of such "
                                           "files; give it twice or more to mix sources (read in order)"),
    max_samples: Optional[int] = typer.Option(None, "--max-samples", min=1,
                                              help="use the first N prompt records (after --shuffle-seed)"),
    shuffle_seed: Optional[int] = typer.Option(None, "--shuffle-seed",
                                               help="shuffle the prompt records first (datasets' shuffle order)"),
    regenerate: bool = typer.Option(True, "--regenerate/--no-regenerate",
                                    help="let the target write the assistant turns (self-distillation)"),
    keep_answers: bool = typer.Option(False, "--keep-answers",
                                      help="with --regenerate: conversations that have an assistant turn are used as "
                                           "given, only those with none are regenerated (a recipe's regenerate: "
                                           "unanswered)"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", min=0),
    seq_length: int = typer.Option(2048, "--seq-length", min=2, help="rows are clipped to this many tokens"),
    max_prompt_tokens: int = typer.Option(512, "--max-prompt-tokens", min=1),
    aux_layer_ids: Optional[str] = typer.Option(None, "--aux-layer-ids", help="default [2, n//2, n-3]"),
    draft_vocab_size: Optional[int] = typer.Option(None, "--draft-vocab-size", min=1,
                                                   help="also write d2t-<N>.npy / t2d-<N>.npy"),
    hs_dtype: str = typer.Option("bfloat16", "--hidden-states-dtype", help="bfloat16 | float32"),
    batch_size: int = typer.Option(32, "--batch-size", min=1),
    compute_dtype: str = typer.Option("float32", "--compute-dtype",
                                      help="float32 | bfloat16: the target's matmuls while it regenerates and "
                                           "extracts hidden states (bfloat16: "
                                           "bf16 products, float32 sums; about 1.6x faster on a CPU with AVX512-BF16)"),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = typer.Option(False, "--json"),
    mesh: str = shcli.mesh_option(),
    coordinator: Optional[str] = shcli.coordinator_option(),
    num_processes: Optional[int] = shcli.num_processes_option(),
    process_id: Optional[int] = shcli.process_id_option(),
    download: bool = download_option(),
):
    """Prompts -> chat rows with assistant-only loss masks -> hidden states (speculators' layout).

    Resumable: rerun the same command after an interruption and it continues where it stopped
    (answers already regenerated and rows already extracted are kept). ``--config RECIPE`` builds
    the recipe's ``data.path`` exactly as ``specjax train`` would (a complete one is left alone).

    On a mesh of several devices the target loads straight into its shardings and the
    hidden-state extraction splits its batches over the data and fsdp axes.

    The prompt input is read and every record checked before the target loads; a bad one exits
    with an error naming the file and the record, and nothing is written."""
    if keep_answers and regenerate:
        regenerate = "unanswered"
    flags = dict(prompts=prompts[0] if len(prompts) == 1 else list(prompts), regenerate=regenerate,
                 max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                 seq_length=seq_length, aux_layer_ids=aux_layer_ids,
                 hidden_states_dtype=hs_dtype, batch_size=batch_size, max_prompt_tokens=max_prompt_tokens,
                 draft_vocab_size=draft_vocab_size, seed=seed, max_samples=max_samples, shuffle_seed=shuffle_seed,
                 compute_dtype=compute_dtype)
    try:
        if compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--compute-dtype {compute_dtype!r}: expected float32 or bfloat16")
        inputs = _prepare_inputs(config, set_, out, target, flags, as_json=as_json)
        if inputs is None:
            return
        cfg, out, target, spec, records = inputs
        res = _prepare_on_target(cfg, out, target, spec, records, mesh=mesh, coordinator=coordinator,
                                 num_processes=num_processes, process_id=process_id, as_json=as_json,
                                 download=download)
    except (BridgeError, ValueError) as e:
        fail(e, code=getattr(e, "exit_code", 2))
    _say_prepared(res, out, as_json=as_json)


def _say_prepared(res: dict, out: str, *, as_json: bool) -> None:
    """Process 0 reports what `data prepare` built: rows, tokens and time, or the JSON of it."""
    if not is_main_process():
        return
    if as_json:
        print(json.dumps(res, default=str))
    else:
        console().print(f"{res['rows']} rows, {res['tokens']} tokens ({res['supervised_tokens']} supervised) in "
                        f"{res['seconds']}s -> {out}")


def _prepare_inputs(config: Optional[Path], set_: List[str], out: Optional[str], target: Optional[str],
                    flags: dict, *, as_json: bool):
    """What `data prepare` builds and from which prompts: the recipe's data directory, target (the
    flags win) and settings, or a DataSpec from the flags; the prompt records are read and checked
    before the target loads. Returns ``(recipe, out, target, spec, records)`` (``spec`` None with a
    recipe: it needs the target's depth), or None when the recipe's directory is already complete
    (said so)."""
    from specjax.train.pipeline import DataSpec, recipe_prompts, spec_prompts

    if config is not None:  # the recipe's settings; its data directory is resumed, a complete one kept
        if flags["max_samples"] is not None or flags["shuffle_seed"] is not None:
            raise typer.BadParameter("with --config, set data.prepare.max_samples / shuffle_seed in the recipe "
                                     "(or --set max_samples=N)")
        from specjax.train.config import load_recipe

        cfg = load_recipe(config, set_)
        out = cfg.data.path if out is None else out
        target = cfg.target if target is None else target
        done = read_meta(out)
        if done.get("complete"):
            if is_main_process():
                print(json.dumps(done, default=str)) if as_json else console().print(
                    f"{out} is already complete ({done.get('rows')} rows); nothing to do")
            return None
        return cfg, out, target, None, recipe_prompts(cfg)  # the input checked before the target loads
    if set_:
        raise typer.BadParameter("--set takes effect with --config only")
    if out is None:
        raise typer.BadParameter("give --out DIR (or --config RECIPE)")
    storage.path(out)  # a bucket URL without its filesystem package fails here, before the target loads
    spec = DataSpec(**{**flags, "aux_layer_ids": _ids(flags["aux_layer_ids"])})
    return None, out, target, spec, spec_prompts(spec)  # the input checked before the target loads


def _prepare_on_target(cfg, out: str, target: Optional[str], spec, records, *, mesh: str, coordinator, num_processes,
                       process_id, as_json: bool, download: bool) -> dict:
    """Set up the devices, load the target (into the mesh's shardings when it has several devices)
    and build the data directory from ``records``; with a recipe, its spec for the target's depth."""
    from specjax.train.pipeline import prepare_data, recipe_data_spec

    dev_mesh = shcli.setup(mesh, coordinator, num_processes, process_id)  # before any JAX work
    lt = _load_target(target or "default", dev_mesh, progress=not as_json and is_main_process(),
                      download=download)
    if cfg is not None:
        spec = recipe_data_spec(cfg, lt.config.num_hidden_layers)
    return prepare_data(out, spec, lt, progress=not as_json and is_main_process(), log=_log, records=records)


@data_app.command("extract")
def extract_cmd(
    data: str = typer.Option(..., "--data", "-d", help="a tokenized dataset directory (ours or speculators') or its "
                                                       "bucket URL"),
    target: str = typer.Option("default", "--target", "-t"),
    aux_layer_ids: Optional[str] = typer.Option(None, "--aux-layer-ids", help="default [2, n//2, n-3]"),
    hs_dtype: str = typer.Option("bfloat16", "--hidden-states-dtype"),
    max_batch_tokens: int = typer.Option(4096, "--max-batch-tokens", min=64),
    as_json: bool = typer.Option(False, "--json"),
    mesh: str = shcli.mesh_option(),
    coordinator: Optional[str] = shcli.coordinator_option(),
    num_processes: Optional[int] = shcli.num_processes_option(),
    process_id: Optional[int] = shcli.process_id_option(),
    download: bool = download_option(),
):
    """Write hidden_states/hs_{i}.safetensors for every row that lacks one (resumable).

    On a mesh of several devices the target loads straight into its shardings and each batch is
    split over the data and fsdp axes; only process 0 writes files. A bucket URL is staged into
    the local cache and the new files are uploaded when the extraction finishes (markers last)."""
    from specjax.train.hidden_states import default_aux_layer_ids, extract_hidden_states
    from specjax.train.pipeline import updating_data_dir

    progress = not as_json and is_main_process()
    try:
        dev_mesh = shcli.setup(mesh, coordinator, num_processes, process_id)  # before any JAX work
        with updating_data_dir(data, progress=progress) as local:
            rows = read_rows(local)
            lt = _load_target(target, dev_mesh, progress=progress, download=download)
            aux = _ids(aux_layer_ids) or default_aux_layer_ids(lt.config.num_hidden_layers)
            res = extract_hidden_states(lt.model, rows, local, aux_layer_ids=aux, dtype=hs_dtype,
                                        max_batch_tokens=max_batch_tokens, progress=not as_json,
                                        target_name=lt.source, log=_log,
                                        mesh=dev_mesh if dev_mesh.size > 1 else None)
    except (BridgeError, ValueError) as e:
        fail(e, code=getattr(e, "exit_code", 2))
    if not is_main_process():
        return
    print(json.dumps(res)) if as_json else console().print(
        f"{res['written']} written, {res['skipped']} already cached, {res['tokens']} tokens in {res['seconds']}s")


@data_app.command("vocab")
def vocab_cmd(
    data: str = typer.Option(..., "--data", "-d", help="a tokenized dataset directory or its bucket URL"),
    draft_vocab_size: int = typer.Option(..., "--draft-vocab-size", min=1),
    target_vocab_size: Optional[int] = typer.Option(None, "--target-vocab-size", help="default: from --target"),
    target: str = typer.Option("default", "--target", "-t"),
    download: bool = download_option(),
):
    """Token frequencies (token_freq.pt) and d2t-<N>.npy / t2d-<N>.npy, as speculators builds them
    (written into the directory; a bucket URL's new files are uploaded)."""
    from specjax.train.pipeline import updating_data_dir

    try:
        with updating_data_dir(data, progress=False) as local:
            fp = local / TOKEN_FREQ_NAME
            if fp.is_file():
                freq = load_token_freq(fp)
            else:
                freq = token_frequencies(read_rows(local))
                save_token_freq(fp, freq)
            if target_vocab_size is None:
                from specjax.models.loading import load_target

                fetch_target(target, download=download)
                target_vocab_size = load_target(target, progress=False).config.vocab_size
            d2t, t2d = build_vocab_mapping(freq, draft_vocab_size, target_vocab_size)
            pd, pt = save_vocab_mapping(local, d2t, t2d)
    except (BridgeError, ValueError) as e:
        fail(e, code=getattr(e, "exit_code", 2))
    total = sum(freq.values())
    kept = sum(freq.get(int(i), 0) for i in (t2d.nonzero()[0]))
    console().print(f"{pd.name}, {pt.name}: {len(freq)} distinct supervised tokens; the draft vocabulary covers "
                    f"{100 * kept / max(total, 1):.2f}% of supervised tokens")


@data_app.command("prompts")
def prompts_cmd(
    name: str = typer.Argument("stdlib", help="stdlib | stdlib-code | stdlib-source | eval-code | eval-prose"),
    out: Path = typer.Option(..., "--out", "-o", help="JSONL file to write ({\"prompt\": ...} per line; "
                             "{\"conversations\": [...]} for a set with answers)"),
    n: Optional[int] = typer.Option(None, "--n", min=1),
    seed: int = typer.Option(0, "--seed"),
):
    """Write a built-in prompt set (made from the Python standard library) as JSONL."""
    try:
        convs = builtin_prompts(name, n, seed=seed)
    except PromptFileError as e:
        fail(e)
    with atomic_file(out, text=True) as f:
        for c in convs:
            rec = {"prompt": c[0]["content"]} if len(c) == 1 else {"conversations": c}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    console().print(f"{len(convs)} prompts -> {out}")


@data_app.command("inspect")
def inspect_cmd(data: str = typer.Argument(..., help="a data directory or its bucket URL")):
    """Rows, tokens, layer set and completeness of a data directory."""
    from specjax.train.hidden_states import hs_path, is_complete
    from specjax.train.pipeline import local_data_dir

    try:
        data = local_data_dir(data, progress=False)
        rows = read_rows(data)
    except BridgeError as e:
        fail(e)
    meta = read_meta(data)
    cached = sum(is_complete(hs_path(data, i)) for i in range(len(rows)))
    print(json.dumps({"rows": len(rows), "tokens": int(rows.lengths.sum()),
                      "supervised_tokens": rows.supervised_tokens(), "hidden_states_cached": cached,
                      **{k: meta[k] for k in ("target", "layer_ids", "hidden_states_dtype", "complete") if k in meta}},
                     indent=2))
