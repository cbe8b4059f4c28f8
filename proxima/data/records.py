"""Load a dataset file into a list of plain records (one dict per row).

Supported: ``.jsonl``, ``.json`` (a list of objects, or an object holding one list of
objects), ``.parquet``, ``.csv``, and a folder written by ``datasets.save_to_disk``.
Everything downstream (prompt and SFT datasets) works on ``list[dict]`` so that a format
is one function here and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SUPPORTED = "supported: .jsonl .json .parquet .csv or a folder from datasets.save_to_disk"


class Records(list):
    """The rows of a dataset file (a plain list of dicts) and the file they came from
    (``source``), so that what is found in them later (a warning about the prompts) can
    name the file."""

    def __init__(self, rows: list[dict[str, Any]], source: str | Path = "") -> None:
        super().__init__(rows)
        self.source = str(source)


def source_of(records: Any) -> str:
    """The file ``records`` were read from, or "" for rows built in memory."""
    return getattr(records, "source", "")


def load_records(path: str | Path) -> Records:
    """Read every row of ``path`` as a dict; raise with the cause and the fix on failure."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"dataset not found: {path}. Check the path in the config ({SUPPORTED})."
        )
    if path.is_dir():
        records = _load_hf_folder(path)
    else:
        suffix = path.suffix.lower()
        readers = {".jsonl": _load_jsonl, ".json": _load_json, ".parquet": _load_parquet}
        readers[".csv"] = _load_csv
        if suffix not in readers:
            raise ValueError(f"unsupported dataset file {path} (suffix {suffix!r}); {SUPPORTED}.")
        records = readers[suffix](path)
    return Records(_check_rows(records, path), source=path)


def _check_rows(records: list[Any], path: Path) -> list[dict[str, Any]]:
    for i, row in enumerate(records):
        if not isinstance(row, dict):
            raise ValueError(
                f"{path}: row {i} is a {type(row).__name__}, not an object; every row must be "
                'a JSON object such as {"prompt": "..."}.'
            )
    return records


def _not_utf8(path: Path, where: str) -> ValueError:
    """A file that is not UTF-8 text: JSON and CSV text is UTF-8, and prompts read in another
    encoding would reach the tokenizer as other characters."""
    return ValueError(
        f"{path} is not UTF-8 text ({where}); dataset files must be UTF-8: convert it, e.g. "
        f"`iconv -f latin1 -t utf-8 {path.name} > utf8.{path.suffix.lstrip('.')}` for a "
        "Latin-1 file."
    )


def _utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a UTF-8 file; the line and byte that are not
    UTF-8 otherwise."""
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                yield line_no, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                byte = raw[exc.start : exc.start + 1].hex()
                where = f"byte 0x{byte} on line {line_no}, position {exc.start + 1}"
                raise _not_utf8(path, where) from None


def _load_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    for line_no, line in _utf8_lines(path):
        if not line.strip():
            continue  # blank lines (often a trailing one) carry no record
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path}: line {line_no} is not valid JSON ({exc.msg} at column {exc.colno}); "
                "fix that line: a .jsonl file holds one JSON object per line."
            ) from exc
    return records


def _load_json(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, f"byte 0x{exc.object[exc.start]:02x} at offset {exc.start}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
            "fix the file or save it as .jsonl (one object per line)."
        ) from exc
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        lists = [k for k, v in data.items() if isinstance(v, list)]
        if len(lists) == 1:
            return data[lists[0]]
        raise ValueError(
            f"{path}: a JSON object must hold exactly one list of records, found list fields "
            f"{lists} among keys {sorted(data)}; store a top-level list of objects instead."
        )
    raise ValueError(
        f"{path}: top-level JSON is a {type(data).__name__}; expected a list of objects."
    )


def _load_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # a dependency of `datasets`

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several unrelated types for corrupt files
        raise ValueError(f"{path}: cannot read as parquet ({exc}); check the file.") from exc


def _load_csv(path: Path) -> list[dict[str, Any]]:
    import pyarrow.csv as pacsv

    # pyarrow infers column types (numbers stay numbers) where the csv module gives strings.
    # pyarrow reads a column that is not UTF-8 as bytes rather than failing: checked first
    for _ in _utf8_lines(path):
        pass
    try:
        return pacsv.read_csv(path).to_pylist()
    except Exception as exc:
        raise ValueError(
            f"{path}: cannot read as CSV ({exc}); the first line must be a header."
        ) from exc


def _load_hf_folder(path: Path) -> list[dict[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise ValueError(
            f"{path} is a folder but not one written by datasets.save_to_disk ({exc}); {SUPPORTED}."
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded.keys())
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(splits) == 1:
            loaded = loaded[splits[0]]
        else:
            raise ValueError(
                f"{path} holds splits {splits} and none is 'train'; save the split to use "
                "on its own (dataset_dict[name].save_to_disk(folder)) or name it 'train'."
            )
    return loaded.to_list()
