"""Checkpoints: every piece of trainer state survives save -> load into a freshly built
trainer, the write is atomic, old checkpoints are pruned only after a new one is complete,
and a user's mistakes (missing folder, changed batch sizes, nothing left to train) stop
with messages naming the cause and the fix. Nano models, a few seconds in all."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from proxima import checkpoint as ckpt
from proxima import rng
from proxima.config import ConfigError, load_config
from proxima.models import ARCHITECTURES, init_model, load_causal_lm, load_critic, saving
from proxima.tasks import resumed_task_config
from proxima.trainer.datasets import load_prompts, load_sft
from proxima.trainer.ppo import PPOTrainer
from proxima.trainer.roles import load_roles

ALPHABET = "0123456789+="
REWARD = Path(__file__).parent / "e2e" / "rewards_fixture.py"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    model = init_model(root / "init", "llama", "nano", alphabet=ALPHABET, max_positions=32)
    prompts = [{"prompt": f"{a}+{b}="} for a in range(10) for b in range(2)]  # 20 prompts
    sft = [{"prompt": f"{a}+1=", "response": str(a + 1)} for a in range(8)]
    (root / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    (root / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    return {"model": model, "prompts": root / "p.jsonl", "sft": root / "s.jsonl"}


def make_cfg(files: dict[str, Path], *extra: str):
    """4 prompts x 2 samples, 3 new tokens; adaptive KL and a ptx loss so that the KL
    coefficient and the SFT loader carry state too; cosine schedules with warm-up."""
    return load_config(
        None,
        [
            f"model.actor_path={files['model']}",
            "model.device=cpu",
            f"data.train_path={files['prompts']}",
            f"data.sft_path={files['sft']}",
            "data.train_batch_size=4",
            "data.max_prompt_length=8",
            f"reward.function={REWARD}:fn",
            "rollout.n=2",
            "rollout.max_response_length=3",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.horizon=10",
            "actor.ptx_coef=0.1",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size=2",
            "actor.optim.lr=1e-3",
            "actor.optim.schedule=cosine",
            "actor.optim.warmup_steps=1",
            "critic.ppo_mini_batch_size=8",
            "critic.ppo_micro_batch_size=4",
            "critic.optim.lr=1e-3",
            "trainer.iterations=6",
            *extra,
        ],
    )


def make_trainer(cfg) -> PPOTrainer:
    device = torch.device("cpu")
    roles = load_roles(cfg, device)
    prompts = load_prompts(cfg, cfg.data.train_path, roles.tokenizer)
    sft = load_sft(cfg, cfg.data.sft_path, roles.tokenizer, 16)
    return PPOTrainer(cfg, roles, prompts, device, sft_data=sft)


def _tensors_equal(a, b) -> bool:
    """Deep equality of nested dicts / lists / tensors (state dicts)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.fixture(scope="module")
def saved(files, tmp_path_factory):
    """A trainer after 2 steps, its checkpoint, and the RNG state right after saving."""
    torch.manual_seed(0)
    trainer = make_trainer(make_cfg(files))
    for _ in range(2):
        trainer.step()
    folder = tmp_path_factory.mktemp("saved") / "iter_2"
    ckpt.save_checkpoint(folder, trainer, {"note": "unit"})
    return trainer, folder, rng.rng_state()


def test_round_trip_restores_every_piece_of_state(files, saved):
    trainer, folder, rng_after_save = saved
    fresh = make_trainer(make_cfg(files))  # built from the initial folders, at iteration 0
    torch.manual_seed(123)  # scramble the global RNG: the checkpoint must set it back
    np.random.seed(123)
    random.seed(123)
    ckpt.load_checkpoint(folder, fresh)

    assert fresh.iteration == 2
    for name in ("actor", "critic"):
        a, b = trainer.trained[name], fresh.trained[name]
        assert _tensors_equal(a.model.state_dict(), b.model.state_dict()), name
        assert _tensors_equal(a.optimizer.state_dict(), b.optimizer.state_dict()), name
        assert a.scheduler.state_dict() == b.scheduler.state_dict(), name
    # optimizer steps per iteration: actor 8 sequences / mini-batch 4 = 2, critic 8 / 8 = 1
    assert fresh.trained["actor"].scheduler.last_epoch == 4
    assert fresh.trained["critic"].scheduler.last_epoch == 2
    # the adaptive controller moved: 0.1 -> 0.1 * (1 + e1 * 8/10) * (1 + e2 * 8/10) != 0.1
    assert fresh.kl_ctl.value == trainer.kl_ctl.value != 0.1
    assert (
        fresh.loader.state_dict()
        == trainer.loader.state_dict()
        == {
            "epoch": 0,
            "position": 2,
            "seed": 42,
        }
    )
    # ptx: one SFT micro-batch of 2 per actor optimizer step -> 4 of the 8 // 2 = 4 batches
    assert fresh.sft_loader.state_dict() == trainer.sft_loader.state_dict()
    assert fresh.sft_loader.state_dict() == {"epoch": 0, "position": 4, "seed": 43}
    assert torch.equal(fresh.generator.get_state(), trainer.generator.get_state())
    restored = rng.rng_state()
    assert torch.equal(restored["torch"], rng_after_save["torch"])
    assert torch.equal(restored["numpy"]["keys"], rng_after_save["numpy"]["keys"])
    assert restored["python"] == rng_after_save["python"]


def test_step_after_load_equals_step_after_save(files, saved):
    """The resumed trainer's next iteration is the uninterrupted one's, bit for bit."""
    trainer, folder, rng_after_save = saved
    fresh = make_trainer(make_cfg(files))
    ckpt.load_checkpoint(folder, fresh)
    resumed, _ = fresh.step()
    rng.set_rng_state(rng_after_save)  # the saved trainer continues from the same point
    original, _ = trainer.step()
    timing = {k for k in original if k.startswith("time/")} | {"tokens_per_s"}
    assert {k: v for k, v in resumed.items() if k not in timing} == {
        k: v for k, v in original.items() if k not in timing
    }
    assert _tensors_equal(trainer.roles.actor.state_dict(), fresh.roles.actor.state_dict())


def test_checkpoint_json_is_human_readable(saved):
    _, folder, _ = saved
    meta = json.loads((folder / "checkpoint.json").read_text())
    assert meta["iteration"] == 2 and meta["extra"] == {"note": "unit"}
    assert meta["config"]["data"]["train_batch_size"] == 4
    assert meta["proxima_version"] and meta["time"][:2] == "20"
    assert sorted(p.name for p in folder.iterdir()) == [
        "actor",
        "checkpoint.json",
        "critic",
        "state.pt",
    ]
    # actor/ and critic/ are ordinary HF folders: loadable on their own, tokenizer included
    actor = load_causal_lm(folder / "actor")
    critic = load_critic(folder / "critic", init_from="critic")
    assert (folder / "actor" / "tokenizer.json").is_file()
    assert actor.config.model_type == critic.config.model_type == "llama"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_weights_load_in_place_for_every_architecture(arch, tmp_path):
    # gpt_neox is saved by transformers 5 under the hub name `embed_out` for its `lm_head`
    src = init_model(tmp_path / "a", arch, "nano", alphabet=ALPHABET, max_positions=32, seed=1)
    other = init_model(tmp_path / "b", arch, "nano", alphabet=ALPHABET, max_positions=32, seed=2)
    for loader, kwargs in ((load_causal_lm, {}), (load_critic, {"seed": 5})):
        model = loader(src, **kwargs)
        model.save_pretrained(tmp_path / f"saved-{loader.__name__}")
        target = loader(other, **kwargs)
        assert not _tensors_equal(model.state_dict(), target.state_dict())
        params_before = [id(p) for p in target.parameters()]
        saving._load_weights(target, tmp_path / f"saved-{loader.__name__}", "actor")
        assert _tensors_equal(model.state_dict(), target.state_dict())
        assert [id(p) for p in target.parameters()] == params_before  # in place


def test_atomic_write_leaves_nothing_on_error(saved, tmp_path, monkeypatch):
    trainer, _, _ = saved

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", fail)  # after the models are written
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path / "iter_9", trainer)
    assert list(tmp_path.iterdir()) == []  # neither iter_9 nor its temporary folder


def test_existing_folder_is_never_overwritten(saved, tmp_path):
    trainer, _, _ = saved
    (tmp_path / "iter_2").mkdir()
    (tmp_path / "iter_2" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="iter_2 already exists"):
        ckpt.save_checkpoint(tmp_path / "iter_2", trainer)
    assert (tmp_path / "iter_2" / "keep.txt").read_text() == "mine"


def test_periodic_keeps_newest_and_prunes_only_after_success(saved, tmp_path, monkeypatch):
    trainer, _, _ = saved
    start = trainer.iteration
    try:
        for it in (8, 9, 10):  # numeric order: iter_10 is newer than iter_9
            trainer.iteration = it
            ckpt.save_periodic(trainer, tmp_path, keep=2)
        root = tmp_path / "checkpoints"
        assert [p.name for p in ckpt.list_checkpoints(root)] == ["iter_9", "iter_10"]
        assert ckpt.find_checkpoint(tmp_path) == root / "iter_10"  # a run folder -> latest
        monkeypatch.setattr(ckpt.torch, "save", lambda *a, **k: 1 / 0)
        trainer.iteration = 11
        with pytest.raises(ZeroDivisionError):
            ckpt.save_periodic(trainer, tmp_path, keep=2)
        # the failed save left no folder behind and deleted nothing
        assert sorted(p.name for p in root.iterdir()) == ["iter_10", "iter_9"]
    finally:
        trainer.iteration = start


def test_missing_checkpoint_names_folder_and_contents(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere does not exist.*state\.pt"):
        ckpt.find_checkpoint(tmp_path / "nowhere")
    (tmp_path / "run").mkdir()
    with pytest.raises(FileNotFoundError, match=r"run is not a checkpoint.*checkpoints/"):
        ckpt.find_checkpoint(tmp_path / "run")


def test_incomplete_checkpoint_without_weights(files, saved, tmp_path):
    _, folder, _ = saved
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("state.pt", "checkpoint.json"):
        (broken / name).write_bytes((folder / name).read_bytes())
    with pytest.raises(FileNotFoundError, match=r"broken/actor holds no \*\.safetensors"):
        ckpt.load_checkpoint(broken, make_trainer(make_cfg(files)))


def test_changed_batch_sizes_are_listed(files, saved):
    _, folder, _ = saved
    trainer = make_trainer(make_cfg(files, "data.train_batch_size=8", "rollout.n=1"))
    with pytest.raises(ValueError) as err:
        ckpt.load_checkpoint(folder, trainer)
    msg = str(err.value)
    assert "data.train_batch_size: checkpoint 4, this run 8" in msg
    assert "rollout.n: checkpoint 2, this run 1" in msg
    assert "checkpoint.json" in msg and "actor.optim.lr" not in msg


def test_changed_learning_rate_takes_effect(files, saved):
    # lr is not a shape: the new value applies from the restored schedule position.
    # cosine over 6 iterations x 2 mini-batches = 12 steps, warm-up 1: after 2 iterations
    # (step 4) the factor is 0.5 * (1 + cos(pi * (4 - 1) / (12 - 1))), lr = 5e-4 * that.
    _, folder, _ = saved
    trainer = make_trainer(make_cfg(files, "actor.optim.lr=5e-4"))
    ckpt.load_checkpoint(folder, trainer)
    opt, sched = trainer.trained["actor"].optimizer, trainer.trained["actor"].scheduler
    expected = 5e-4 * 0.5 * (1 + np.cos(np.pi * 3 / 11))
    assert sched.last_epoch == 4
    assert opt.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12)
    assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]


def test_check_resume_nothing_to_do(files, saved):
    _, folder, _ = saved
    cfg = make_cfg(files, f"trainer.resume_from={folder}", "trainer.iterations=2")
    with pytest.raises(ValueError, match=r"nothing to do.*iteration 2.*Raise trainer\.iterations"):
        ckpt.check_resume(cfg)
    assert ckpt.check_resume(make_cfg(files, f"trainer.resume_from={folder}")) == folder
    assert ckpt.check_resume(make_cfg(files)) is None
    with pytest.raises(ConfigError, match="trainer.keep_checkpoints"):
        make_cfg(files, "trainer.keep_checkpoints=-1")


def test_resumed_task_run_takes_paths_from_checkpoint(files, saved, tmp_path):
    """A task run is not prepared again: the checkpoint's resolved paths are used, so the
    reference stays the original initial actor (model.actor_path), not the checkpoint's."""
    _, folder, _ = saved
    meta = json.loads((folder / "checkpoint.json").read_text())
    meta["config"]["task"]["name"] = "arithmetic"  # as if the task had filled the paths
    task_ckpt = tmp_path / "checkpoints" / "iter_2"
    task_ckpt.mkdir(parents=True)
    (task_ckpt / "checkpoint.json").write_text(json.dumps(meta))
    (task_ckpt / "state.pt").write_bytes(b"")  # only checkpoint.json is read
    cfg = make_cfg(files, f"trainer.resume_from={tmp_path}")  # the run folder
    cfg = cfg.replace(
        {
            "task.name": "arithmetic",
            "model.actor_path": "",
            "data.train_path": "",
            "reward.function": "",
        }
    )
    cfg = resumed_task_config(cfg)
    assert ckpt.check_resume(cfg) == task_ckpt
    assert cfg.model.actor_path == str(files["model"])
    assert cfg.data.train_path == str(files["prompts"])
    assert cfg.reward.function == f"{REWARD}:fn"


def test_rng_state_survives_weights_only_load(tmp_path):
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    state = rng.rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (torch.rand(2), np.random.rand(2), random.random())
    rng.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(2), expected[0])
    assert np.array_equal(np.random.rand(2), expected[1])
    assert random.random() == expected[2]
    snapshot = rng.rng_state()
    with rng.preserve_rng():  # draws inside the block leave the streams where they were
        torch.rand(5), np.random.rand(5), random.random()
    after = (torch.rand(2), np.random.rand(2), random.random())
    rng.set_rng_state(snapshot)
    assert torch.equal(torch.rand(2), after[0])
    assert np.array_equal(np.random.rand(2), after[1])
    assert random.random() == after[2]
