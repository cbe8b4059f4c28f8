"""`proxima chat`'s flags checked before the model loads, and a prompt with characters the
tokenizer cannot spell said, as training says it for prompt files."""

from __future__ import annotations

import pytest

from proxima.cli import main
from proxima.data.prompts import UnknownCharactersWarning
from proxima.models.tiny import init_model
from proxima.recipes.chat import answer, load_for_chat

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", " \n"], "--prompt is empty"),
        (["--prompt", "1+1=", "--temperature", "-1"], "--temperature -1.0: must be 0"),
        (["--prompt", "1+1=", "--temperature", "nan"], "--temperature nan: must be 0"),
        (["--prompt", "1+1=", "--max-new-tokens", "0"], "--max-new-tokens 0: must be at"),
    ],
)
def test_bad_flags_stop_before_the_model_loads(tmp_path, flags, said, capsys):
    # the model does not exist: only a check made before loading can answer
    assert main(["chat", str(tmp_path / "no-model"), *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_characters_without_a_token_are_warned(tmp_path, capsys):
    folder = init_model(tmp_path / "m", size="nano", alphabet="0123456789+=", max_positions=32)
    model, tokenizer = load_for_chat(folder)
    with pytest.warns(UnknownCharactersWarning, match=r"\('x', 'y'\).*reads '<unk>'"):
        answer(model, tokenizer, "1+x=y", max_new_tokens=2)
