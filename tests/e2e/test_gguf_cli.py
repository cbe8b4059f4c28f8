"""`proxima export | import | chat` and a run whose actor is a .gguf file, on a nano model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("gguf")

from proxima.cli import main  # noqa: E402
from proxima.models.gguf import CACHE_ENV  # noqa: E402

pytestmark = pytest.mark.slow


def test_export_import_chat(tmp_path, make_model, capsys):
    model = make_model("llama")
    file = tmp_path / "m.gguf"
    assert main(["export", str(model), "--gguf", str(file), "--type", "f32"]) == 0
    assert "wrote" in capsys.readouterr().out and file.read_bytes()[:4] == b"GGUF"
    assert main(["export", str(model), "--gguf", str(file)]) == 2  # never overwritten
    assert "exists; choose another" in capsys.readouterr().err
    folder = tmp_path / "imported"
    assert main(["import", str(file), "--out", str(folder)]) == 0
    assert (folder / "config.json").is_file()
    assert main(["chat", str(folder), "--prompt", "1+2=", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()  # the answer was printed
    assert main(["chat", str(tmp_path / "nowhere")]) == 2
    assert "holds no model" in capsys.readouterr().err


def test_train_from_a_gguf_actor(tmp_path, make_model, fast_overrides, monkeypatch, capsys):
    """model.actor_path=FILE.gguf: imported once into the cache, the run trains that folder
    (the reference and critic start from it too), and its config names the folder."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    file = tmp_path / "m.gguf"
    assert main(["export", str(make_model("llama")), "--gguf", str(file), "--type", "f32"]) == 0
    out = tmp_path / "run"
    assert main(["train", *fast_overrides(file, out, 1)]) == 0
    assert "importing" in capsys.readouterr().out
    actor = json.loads((out / "summary.json").read_text())["config"]["model"]["actor_path"]
    assert actor.startswith(str(tmp_path / "cache" / "gguf"))
    assert (out / "actor" / "config.json").is_file()
    # the run folder (with proxima's own config.json beside actor/) names its trained actor
    assert main(["chat", str(out), "--prompt", "1+2=", "--max-new-tokens", "3"]) == 0
    assert main(["export", str(out), "--gguf", str(tmp_path / "trained.gguf")]) == 0
    capsys.readouterr()
    assert main(["train", *fast_overrides(file, tmp_path / "run2", 1)]) == 0
    assert "importing" not in capsys.readouterr().out  # the second run reuses the folder
