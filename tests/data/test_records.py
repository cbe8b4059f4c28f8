"""load_records: every supported format round-trips; errors name the path, cause and fix."""

import json

import pytest

from proxima.data.records import load_records

ROWS = [
    {"prompt": "2+2=", "answer": 4},
    {"prompt": "3+5=", "answer": 8},
]


def test_jsonl_round_trip_skips_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    assert load_records(path) == ROWS


def test_json_list_and_single_list_field(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps(ROWS))
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"version": 2, "data": ROWS}))
    assert load_records(a) == ROWS
    assert load_records(b) == ROWS


def test_json_object_with_two_lists_is_rejected(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train": ROWS, "test": ROWS}))
    with pytest.raises(ValueError, match=r"exactly one list.*\['train', 'test'\]"):
        load_records(path)


def test_parquet_round_trip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load_records(path) == ROWS


def test_csv_round_trip_keeps_numbers(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('prompt,answer\n2+2=,4\n"3+5=",8\n')
    assert load_records(path) == ROWS  # answer parsed as int, not "4"


def test_hf_dataset_folder_and_dataset_dict(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "plain"))
    assert load_records(tmp_path / "plain") == ROWS

    ds = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert load_records(tmp_path / "dd") == ROWS  # the "train" split

    datasets.DatasetDict({"only": ds.select([1])}).save_to_disk(str(tmp_path / "one"))
    assert load_records(tmp_path / "one") == ROWS[1:]

    two = datasets.DatasetDict({"a": ds, "b": ds})
    two.save_to_disk(str(tmp_path / "two"))
    with pytest.raises(ValueError, match=r"splits \['a', 'b'\].*none is 'train'"):
        load_records(tmp_path / "two")


def test_bad_jsonl_line_reports_line_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3 is not valid JSON"):
        load_records(path)


def test_non_object_row_is_rejected(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a"}\n["not", "an", "object"]\n')
    with pytest.raises(ValueError, match="row 1 is a list, not an object"):
        load_records(path)


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl.*supported: \.jsonl"):
        load_records(tmp_path / "nope.jsonl")
    txt = tmp_path / "prompts.txt"
    txt.write_text("hello")
    with pytest.raises(ValueError, match=r"prompts\.txt \(suffix '\.txt'\); supported"):
        load_records(txt)


def test_folder_not_from_save_to_disk(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not one written by datasets.save_to_disk"):
        load_records(tmp_path / "empty")


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_file_that_is_not_utf8_is_named_with_the_fix(tmp_path, suffix):
    text = {
        ".jsonl": '{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n',
        ".json": '[{"prompt": "caf\xe9"}]',
        ".csv": "prompt\ncaf\xe9\n",
    }[suffix]
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(text.encode("latin-1"))  # é is the one byte 0xe9, not UTF-8
    where = {".jsonl": "on line 2", ".json": "at offset", ".csv": "on line 2"}[suffix]
    with pytest.raises(ValueError, match=rf"latin1\{suffix} is not UTF-8 text \(byte 0xe9 {where}"):
        load_records(path)
    with pytest.raises(ValueError, match="dataset files must be UTF-8: convert it, e.g. `iconv"):
        load_records(path)
    path.write_bytes(text.encode("utf-8"))
    assert load_records(path)[-1] == {"prompt": "café"}


def test_records_remember_their_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    assert load_records(path).source == str(path)
