"""Records read with Hugging Face ``datasets``: local .txt, .jsonl/.json and .parquet files (each file read on its
own, so an empty file or a missing field is named), or a dataset name that ``datasets.load_dataset`` resolves (the
hub where the network allows; offline, the error says how to get it)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .settings import DataError, TextSettings

BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def fields_needed(fmt: str, text_field: str) -> tuple[str, ...]:
    return {"text": (text_field,), "prompt_completion": ("prompt", "completion"), "chat": ("messages",)}[fmt]


def record_format(fmt: str, columns: list[str], text_field: str) -> str:
    """The format of records with `columns` (``auto``: chat, else prompt_completion, else text)."""
    if fmt != "auto":
        return fmt
    if "messages" in columns:
        return "chat"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    return "text"


def _builder(path: Path) -> str:
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"data.files: {path} is not a .txt, .jsonl, .json or .parquet file (the formats read here); "
                        "convert it, or pass its dataset name as data.dataset.")
    return builder


def load_local(settings: TextSettings) -> tuple[Any, str, list[tuple[str, int]]]:
    """(records of all files in order, their format, [(file, records)]): every file must exist, hold records and
    the fields of the format."""
    import datasets

    parts, counts, fmt = [], [], None
    for name in settings.files:
        path = Path(name).expanduser().resolve()
        if not path.is_file():
            raise DataError(f"data.files: {name} does not exist (or is not a file); give existing files, e.g. "
                            "data.files=[/abs/path/docs.jsonl].")
        if path.stat().st_size == 0:
            raise DataError(f"data.files: {path} is empty; remove it from data.files or give it records.")
        builder = _builder(path)
        extra = {"sample_by": settings.sample_by} if builder == "text" else {}
        try:
            part = datasets.load_dataset(builder, data_files=[str(path)], split="train",
                                         cache_dir=str(settings.cache_dir / "datasets"), **extra)
        except Exception as err:  # a line that is not JSON, a parquet file that is not one
            raise DataError(f"data.files: {path} could not be read as {builder} ({type(err).__name__}: {err}).") \
                from err
        if len(part) == 0:
            raise DataError(f"data.files: {path} holds no records; remove it from data.files or give it records.")
        columns = list(part.column_names)
        fmt_here = record_format(settings.format, columns, settings.text_field)
        missing = [f for f in fields_needed(fmt_here, settings.text_field) if f not in columns]
        if missing:
            key = "data.text_field" if fmt_here == "text" else "data.format"
            raise DataError(f"data.files: the records of {path} have no field {missing[0]!r} (they have "
                            f"{', '.join(columns)}); set {key} to the field that holds the "
                            f"{'text' if fmt_here == 'text' else 'data'} (format {fmt_here}).")
        if fmt is not None and fmt_here != fmt:
            raise DataError(f"data.files: {path} holds {fmt_here} records, the files before it {fmt} records; "
                            "give files of one format.")
        fmt = fmt_here
        parts.append(part.select_columns(list(fields_needed(fmt_here, settings.text_field))))
        counts.append((str(path), len(part)))
    return (datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]), fmt, counts


def load_hub(settings: TextSettings) -> tuple[Any, str, list[tuple[str, int]]]:
    """(records, format, [(dataset name, records)]) of ``datasets.load_dataset(data.dataset, ...)``; offline, a
    DataError saying how to get it."""
    import datasets

    name = settings.dataset
    try:
        records = datasets.load_dataset(name, settings.dataset_config, split=settings.split,
                                        cache_dir=str(settings.cache_dir / "datasets"))
    except (ConnectionError, OSError) as err:
        raise DataError(
            f"data.dataset={name!r} is not in the local cache and the Hugging Face hub cannot be reached "
            f"({type(err).__name__}: {err}). Run the same command once where the network reaches the hub (it is "
            f"kept in {settings.cache_dir / 'datasets'}; HF_DATASETS_OFFLINE=1 then reads it from there), or give "
            "local files: data.files=[/abs/path/docs.jsonl].") from err
    columns = list(records.column_names)
    fmt = record_format(settings.format, columns, settings.text_field)
    missing = [f for f in fields_needed(fmt, settings.text_field) if f not in columns]
    if missing:
        raise DataError(f"data.dataset={name!r} has no field {missing[0]!r} (it has {', '.join(columns)}); set "
                        f"{'data.text_field' if fmt == 'text' else 'data.format'} to the field that holds the data.")
    if len(records) == 0:
        raise DataError(f"data.dataset={name!r} (split {settings.split}) holds no records.")
    return records.select_columns(list(fields_needed(fmt, settings.text_field))), fmt, [(name, len(records))]


def load_records(settings: TextSettings) -> tuple[Any, str, list[tuple[str, int]]]:
    return load_local(settings) if settings.files else load_hub(settings)


def source_key(settings: TextSettings) -> list:
    """What identifies the records, known before reading them: each local file by path, size and modification time;
    a hub dataset by name, configuration and split (a cache made from it is reused offline; remove the cache to read
    a newer version)."""
    if settings.files:
        paths = [Path(f).expanduser().resolve() for f in settings.files]
        return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else (str(p), None) for p in paths]
    return [settings.dataset, settings.dataset_config, settings.split]
