"""Prompt inputs read through pyarrow and ``datasets`` (the columnar reader family of
:mod:`specjax.train.prompts`): parquet files batch by batch, arrow files and ``save_to_disk``
directories memory-mapped, and datasets in the local HF datasets cache (offline). Each reader
returns the raw records (and, where a split is chosen, where they came from); parsing and
checking the records is :mod:`specjax.train.prompts`' job. Errors are :class:`PromptFileError`.

pyarrow and ``datasets`` are imported inside the readers: a JSON or built-in input never loads them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from specjax.train.errors import PromptFileError


def read_parquet(path: Path) -> list:
    """The records of a parquet file, batch by batch (a non-UTF-8 string names its record and column)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise PromptFileError(f"not a readable parquet file ({e})", path=str(path)) from None
    rows: list = []
    for batch in pf.iter_batches(batch_size=4096):
        try:
            rows.extend(batch.to_pylist())
        except UnicodeDecodeError:  # find the row and column: a string column holding non-UTF-8 bytes
            for i in range(batch.num_rows):
                for name, col in zip(batch.schema.names, batch.columns):
                    try:
                        col[i].as_py()
                    except UnicodeDecodeError as e:
                        raise PromptFileError(f"record {len(rows) + i + 1}: column '{name}' holds bytes that are not "
                                              f"UTF-8 ({e.reason}, byte 0x{e.object[e.start]:02x}); expected UTF-8 "
                                              "text", path=str(path), key=name) from None
            raise
    return rows


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars or info logs from ``datasets`` while it reads (restored after)."""
    import datasets
    from datasets.utils import logging as dlog

    bars = datasets.is_progress_bar_enabled()
    level = dlog.get_verbosity()
    datasets.disable_progress_bars()
    dlog.set_verbosity_error()
    try:
        yield datasets
    finally:
        dlog.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _one_split(dd, where: str, split: str | None, hint: str):
    """A split of a ``DatasetDict``: ``split``, else ``train``, else the only one."""
    names = list(dd.keys())
    if split is None:
        split = "train" if "train" in names else (names[0] if len(names) == 1 else None)
        if split is None:
            raise PromptFileError(f"holds the splits {names} and none is 'train'; choose one: {hint}", path=where)
    if split not in names:
        raise PromptFileError(f"has no split {split!r}; it has {names}", path=where, key="split")
    return dd[split], split


def read_arrow(path: Path) -> list:
    """The records of an arrow file (``datasets.Dataset.from_file``, memory-mapped)."""
    with _quiet_datasets() as datasets:
        try:
            ds = datasets.Dataset.from_file(str(path))
        except Exception as e:  # noqa: BLE001  (pyarrow raises several kinds for a bad file)
            raise PromptFileError(f"not a readable arrow file ({type(e).__name__}: {e})", path=str(path)) from None
        return ds.to_list()


def is_saved_dataset(d: Path) -> bool:
    """A directory written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (d / "dataset_dict.json").is_file() or ((d / "state.json").is_file() and (d / "dataset_info.json").is_file())


def read_saved(d: Path) -> tuple[str, list]:
    """The records of a ``save_to_disk`` directory and where they are (a DatasetDict's split: ``<dir>/<split>``)."""
    with _quiet_datasets() as datasets:
        try:
            ds = datasets.load_from_disk(str(d))
        except Exception as e:  # noqa: BLE001
            raise PromptFileError(f"a save_to_disk directory that datasets cannot load ({type(e).__name__}: {e})",
                                  path=str(d)) from None
        where = str(d)
        if isinstance(ds, datasets.DatasetDict):
            ds, split = _one_split(ds, where, None, f"give {d}/<split>")
            where = str(d / split)
        return where, ds.to_list()


def hf_fetch_command(repo_id: str, config: str | None, split: str | None) -> str:
    args = ", ".join([repr(repo_id)] + ([repr(config)] if config else []) + ([f"split={split!r}"] if split else []))
    return f"HF_HUB_OFFLINE=0 python -c \"import datasets; datasets.load_dataset({args})\""


def parse_hf_spec(spec: str) -> tuple[str, str | None, str | None]:
    """``hf:<id>[:<config>][:<split>]`` -> (id, config, split); empty fields are None."""
    parts = spec[len("hf:"):].split(":")
    if not parts[0] or len(parts) > 3:
        raise PromptFileError(f"{spec!r}: expected hf:<id>[:<config>][:<split>], e.g. "
                              "hf:HuggingFaceH4/ultrachat_200k::train_sft", key="prompts")
    repo_id, config, split = (parts + [None, None])[:3]
    return repo_id, config or None, split or None


def read_hf(spec: str, cache_dir: str | None) -> tuple[str, list]:
    """The records of ``hf:<id>[:<config>][:<split>]`` in the local datasets cache and their ``hf:id:config:split``."""
    repo_id, config, split = parse_hf_spec(spec)
    fetch = hf_fetch_command(repo_id, config, split)
    with _quiet_datasets() as datasets:
        where = cache_dir or datasets.config.HF_DATASETS_CACHE
        try:
            ds = datasets.load_dataset(repo_id, config, cache_dir=cache_dir)
        except (ConnectionError, FileNotFoundError) as e:
            why = "HF_HUB_OFFLINE is set" if datasets.config.HF_HUB_OFFLINE else f"{type(e).__name__}: {e}"
            raise PromptFileError(f"{repo_id} is not in the local HF datasets cache ({where}) and cannot be "
                                  f"downloaded ({why}). Fetch it once where the hub is reachable: {fetch}",
                                  path=spec) from None
        except ValueError as e:  # the cache has the dataset but not this config
            msg = "; ".join(x.strip() for x in str(e).splitlines() if x.strip())
            raise PromptFileError(f"{msg} (in {where}); fetch it where the hub is reachable: {fetch}",
                                  path=spec, key="config") from None
        ds, split = _one_split(ds, spec, split, f"hf:{repo_id}:{config or ''}:<split>")
        return f"hf:{repo_id}:{config or ''}:{split}", ds.to_list()
