"""Mistakes a user makes on the command line, each answered by `proxima` with what is wrong
(naming the key, flag, file or variable) and how to fix it, exit status 2 and no traceback,
before any work starts; and the warnings of `proxima config` about paths. Nothing here
trains: a nano model at most is built, or evaluated on a few prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxima import launch
from proxima.cli import main
from proxima.config import load_config
from proxima.models import build_char_tokenizer, build_tiny_reward_model
from tests.e2e.conftest import ALPHABET

pytestmark = pytest.mark.usefixtures("one_thread")


def _failed(capsys) -> str:
    """stderr of a command that stopped with a message, not a traceback."""
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err


# --------------------------------------------------------------------------- torchrun's env


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK and LOCAL_RANK are not: this"),
        ({"WORLD_SIZE": "2", "RANK": "1"}, "WORLD_SIZE=2 is set but LOCAL_RANK is not"),
        ({"RANK": "x"}, "RANK='x' in the environment is not an integer."),
        ({"WORLD_SIZE": "2 "}, None),  # int() reads surrounding spaces: a valid world of 2
        ({"RANK": "1"}, "RANK=1 does not fit a job of WORLD_SIZE=1 process(es)"),
        ({"WORLD_SIZE": "0", "RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE=0 must be >= 1."),
    ],
)
def test_torchrun_environment_partly_set_is_named(no_torchrun, variables, message):
    for name, value in variables.items():
        no_torchrun.setenv(name, value)
    if message is None:
        no_torchrun.setenv("RANK", "0"), no_torchrun.setenv("LOCAL_RANK", "0")
        assert launch.world() == (0, 2, 0)
        return
    with pytest.raises(launch.LaunchEnvironmentError) as err:
        launch.world()
    assert str(err.value).startswith(message)
    assert str(err.value).endswith(
        "torchrun sets RANK, WORLD_SIZE and LOCAL_RANK together: to run one process, unset "
        "them (`unset RANK WORLD_SIZE LOCAL_RANK`); to run N processes, launch with "
        "`torchrun --nproc_per_node N -m proxima train ...`."
    )
    assert isinstance(err.value, ValueError)  # what `cli.main` reports as `error: ...`


def test_torchrun_environment_absent_is_one_process(no_torchrun):
    assert launch.world() == (0, 1, 0) and launch.is_main_process()


@pytest.mark.parametrize("command", ["config", "train"])
def test_stray_world_size_stops_config_and_train(
    no_torchrun, tmp_path, fast_overrides, capsys, command
):
    """A WORLD_SIZE left in the shell: `error: ...` naming it and how to launch, exit 2,
    for `proxima config` and `proxima train` alike; no run folder."""
    no_torchrun.setenv("WORLD_SIZE", "2")
    out = tmp_path / "runs" / "x"
    assert main([command, *fast_overrides(tmp_path / "model", out)]) == 2
    err = _failed(capsys)
    assert "error: WORLD_SIZE=2 is set but RANK and LOCAL_RANK are not" in err
    assert "`torchrun --nproc_per_node N -m proxima train ...`" in err
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- eval --out


def _eval_args(model: Path, prompt_file: Path, reward_spec, out: Path) -> list[str]:
    return [
        "eval",
        "--model",
        str(model),
        "--data",
        str(prompt_file),
        "--reward",
        reward_spec("fn"),
        "--max-prompts",
        "4",
        "--max-new-tokens",
        "2",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]


def test_eval_out_in_a_missing_folder_is_created(tmp_path, make_model, prompt_file, reward_spec):
    out = tmp_path / "results" / "today" / "eval.json"
    assert main(_eval_args(make_model(), prompt_file, reward_spec, out)) == 0
    assert json.loads(out.read_text())["greedy"]["n"] == 4


def test_eval_out_that_cannot_be_written_stops_before_any_model_loads(
    tmp_path, make_model, prompt_file, reward_spec, capsys, monkeypatch
):
    def load_causal_lm(*args, **kwargs):
        raise AssertionError("eval.out is checked before the policy loads")

    model = make_model()
    monkeypatch.setattr("proxima.recipes.evaluation.load_causal_lm", load_causal_lm)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = blocker / "eval.json"
    assert main(_eval_args(model, prompt_file, reward_spec, out)) == 2
    assert (
        f"error: `eval.out`={out}: {blocker} is a file, not a folder; point `eval.out` at a "
        "file in a writable folder." in _failed(capsys)
    )
    assert main(_eval_args(model, prompt_file, reward_spec, tmp_path)) == 2
    assert f"`eval.out`={tmp_path}: {tmp_path} is a folder; name a file in it" in _failed(capsys)

    # a folder where writes fail although os.access says yes (root in /sys): found by trying
    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.TemporaryFile", refused)
    out = tmp_path / "sysfs" / "eval.json"
    assert main(_eval_args(model, prompt_file, reward_spec, out)) == 2
    assert (
        f"`eval.out`={out}: the folder {out.parent} is not writable (Permission denied)"
        in _failed(capsys)
    )


# --------------------------------------------------------------------------- config


def _checkpoint(tmp_path: Path, overrides: list[str]) -> Path:
    """A run folder whose checkpoint iter_2 holds the config of `overrides` (only its
    checkpoint.json is read by `proxima config`)."""
    cfg = load_config(None, overrides, command="config")
    folder = tmp_path / "run" / "checkpoints" / "iter_2"
    folder.mkdir(parents=True)
    (folder / "checkpoint.json").write_text(json.dumps({"iteration": 2, "config": cfg.to_dict()}))
    (folder / "state.pt").write_bytes(b"")
    return tmp_path / "run"


def test_config_with_resume_from_shows_the_checkpoints_config(
    tmp_path, make_model, fast_overrides, capsys
):
    """`proxima config trainer.resume_from=RUN` prints the config `train` would resume with
    (the checkpoint's, not the defaults) and what changed since the checkpoint."""
    model = make_model()
    run = _checkpoint(tmp_path, fast_overrides(model, tmp_path / "out", 2))
    capsys.readouterr()
    argv = ["config", f"trainer.resume_from={run}", "trainer.iterations=4"]
    assert main([*argv, "actor.optim.lr=1e-4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"config: the checkpoint's saved config with {' '.join(argv[1:])}")
    assert "resume: changed since the checkpoint: actor.optim.lr 0.001 -> 0.0001, " in out
    assert "trainer.iterations 2 -> 4" in out
    assert f"actor_path: {model}\n" in out and "train_batch_size: 4\n" in out  # not defaults
    assert "batch plan: 4 prompts x 2 samples = 8 sequences per iteration" in out
    # what `train` refuses, `config` refuses too
    assert main(["config", f"trainer.resume_from={run}"]) == 2
    assert "nothing to do: checkpoint" in _failed(capsys)
    assert main(argv + ["data.train_batch_size=8"]) == 2
    assert "cannot resume from" in _failed(capsys)


def test_config_warns_about_paths_that_do_not_exist(tmp_path, capsys):
    missing = {
        "model.actor_path": tmp_path / "model",
        "data.train_path": tmp_path / "prompts.jsonl",
        "data.eval_path": tmp_path / "held_out.jsonl",
        "reward.model_path": tmp_path / "rm",
    }
    argv = ["config", *(f"{k}={v}" for k, v in missing.items())]
    assert main([*argv, f"reward.function={tmp_path}/rewards.py:fn"]) == 0
    out, err = capsys.readouterr()
    assert f"actor_path: {tmp_path / 'model'}\n" in out  # the config is printed all the same
    for key, path in missing.items():
        assert f"warning: `{key}`: {path} does not exist\n" in err
    assert f"warning: `reward.function`: {tmp_path}/rewards.py does not exist (the file" in err
    assert "warning: `data.sft_path`" not in err  # an empty path is not a missing one
    # several prompt files: each missing one named
    several = f"data.eval_path=[{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}]"
    assert main(["config", *argv[1:], several, f"reward.function={tmp_path}/r.py:fn"]) == 0
    err = capsys.readouterr().err
    for name in ("a.jsonl", "b.jsonl"):
        assert f"warning: `data.eval_path`: {tmp_path / name} does not exist\n" in err


def test_yaml_after_the_overrides_is_asked_to_come_first(tmp_path, capsys):
    yaml_file = tmp_path / "my.yaml"
    yaml_file.write_text("trainer:\n  iterations: 3\n")
    assert main(["train", "trainer.seed=1", str(yaml_file)]) == 2
    assert (
        f"error: `{yaml_file}` comes after the key=value overrides: the YAML file must come "
        f"first, e.g. `proxima train {yaml_file} trainer.seed=1`." in _failed(capsys)
    )
    assert main(["config", str(yaml_file), str(yaml_file)]) == 2
    assert "a command reads one YAML file" in _failed(capsys)


# --------------------------------------------------------------------------- --model


def test_run_folder_as_the_model_names_its_actor(tmp_path, make_model, fast_overrides, capsys):
    """`proxima train model.actor_path=RUN` (a run folder) and `proxima eval --model RUN`:
    the message says to pass RUN/actor; nothing is written."""
    run = tmp_path / "old_run"
    actor = run / "actor"
    actor.mkdir(parents=True)
    for file in make_model().iterdir():
        (actor / file.name).write_bytes(file.read_bytes())
    (run / "summary.json").write_text("{}")
    assert main(["train", *fast_overrides(run, tmp_path / "runs" / "x")]) == 2
    assert (
        f"error: `model.actor_path`: {run} is a proxima run folder (summary.json, actor/), not "
        f"a model folder: pass its trained policy, {actor}, instead." in _failed(capsys)
    )
    assert not (tmp_path / "runs").exists()
    assert main(["sft", "--model", str(run), "--data", "x.jsonl", "--out", str(tmp_path / "o")])
    assert f"`model.actor_path`: {run} is a proxima run folder" in _failed(capsys)


def test_reward_model_as_the_model_says_what_it_is(tmp_path, prompt_file, reward_spec, capsys):
    tok = build_char_tokenizer(ALPHABET)
    rm = tmp_path / "rm"
    build_tiny_reward_model("llama", tok, "nano", max_positions=32).save_pretrained(rm)
    tok.save_pretrained(rm)
    assert main(_eval_args(rm, prompt_file, reward_spec, tmp_path / "e.json")) == 2
    err = _failed(capsys)
    assert (
        f"error: `model.actor_path`: {rm} holds a LlamaForSequenceClassification: "
        "a reward model (a score head, no language-model head), which cannot generate text; "
        "as a reward source it belongs in `reward.model_path` (--reward-model). Pass a causal "
        "language model instead" in err
    )
    assert not (tmp_path / "e.json").exists()


# --------------------------------------------------------------------------- init-model


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("exists", "error: --out {model} already holds a model (config.json); choose another "),
        ("zero", "error: --max-positions must be positive (the most tokens of prompt + "),
        ("negative", "error: --max-positions must be positive"),
        ("both", "error: init-model got both --alphabet and --text-file: pass one, --alphabet"),
        ("vocab", "error: --vocab-size sizes a BPE trained with --text-file; a character "),
        ("file", "error: --out {file}/m: cannot create the folder {file}/m: {file} is a file; "),
    ],
)
def test_init_model_flags_are_named(tmp_path, make_model, capsys, case, message):
    model, file = make_model(), tmp_path / "a_file"
    file.write_text("text\n")
    before = (model / "model.safetensors").read_bytes()
    out = {"exists": model, "file": file / "m"}.get(case, tmp_path / "new")
    argv = ["init-model", "--out", str(out), "--size", "nano", "--alphabet", "ab"]
    argv += {
        "zero": ["--max-positions", "0"],
        "negative": ["--max-positions", "-4"],
        "both": ["--text-file", str(file)],
        "vocab": ["--vocab-size", "8"],
    }.get(case, [])
    assert main(argv) == 2
    err = _failed(capsys)
    assert message.format(model=model, file=file) in err
    assert "overwrite=True" not in err  # no such flag
    assert (model / "model.safetensors").read_bytes() == before
    assert not (tmp_path / "new").exists()
