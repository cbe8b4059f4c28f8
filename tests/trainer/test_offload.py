"""model.offload (`trainer.offload`): the moves are exact round trips (weights, gradients,
AdamW state and its step count, bit for bit, every tensor keeping its identity), the CPU
buffers are allocated once, each phase finds what it needs on the device, and a run with
offload gives the metrics and weights of a run without. On a CPU the moves are CPU to CPU
copies: the code path runs, the storages change, nothing is gained."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from proxima.models import build_tiny_reward_model, load_tokenizer
from proxima.trainer.offload import Offload, offload_optimizer, restore_optimizer
from tests.trainer.nano import nano_files, nano_trainer

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
NOT_COMPARED = ("time/", "tokens_per_s")  # wall-clock readings


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """A small model after two AdamW steps, with a gradient pending (the state is there)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(5, 4)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    opt.zero_grad()
    model(x).square().sum().backward()  # a third gradient, pending
    return model, opt


def _snapshot(model, opt) -> dict:
    out = {}
    for i, p in enumerate(model.parameters()):
        out[f"p{i}"] = p.detach().clone()
        out[f"g{i}"] = p.grad.clone()
        for k, v in opt.state[p].items():
            out[f"s{i}.{k}"] = v.clone()
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_a_round_trip_is_exact_and_keeps_every_identity():
    model, opt = _trained()
    params = list(model.parameters())
    before, ptrs = _snapshot(model, opt), [p.data_ptr() for p in params]
    off = Offload(CPU)
    off.add_weights("critic weights", [model])
    off.add_optimizer("critic optimizer", opt)
    off.enter("generate")  # neither is needed there
    assert off.where() == {"critic weights": False, "critic optimizer": False}
    assert all(p.grad is None for p in params)  # stashed in the store
    assert all(p.data_ptr() != ptr for p, ptr in zip(params, ptrs, strict=True))  # moved
    state = opt.state[params[0]]
    assert state["exp_avg"] is off.store.buffers[("state", id(params[0]), "exp_avg")]
    off.enter("update")
    assert off.where() == {"critic weights": True, "critic optimizer": True}
    assert list(model.parameters()) == params and list(opt.state) == params  # same objects
    after = _snapshot(model, opt)
    _assert_same(before, after)
    assert float(opt.state[params[0]]["step"]) == 2.0  # AdamW's step count, as it was


def test_training_after_round_trips_equals_training_without():
    (a, opt_a), (b, opt_b) = _trained(), _trained()
    off = Offload(CPU)
    off.add_weights("critic weights", [b])
    off.add_optimizer("critic optimizer", opt_b)
    for _ in range(2):
        off.enter("generate")
        off.enter("score")  # the weights come back, the optimizer state stays away
        assert off.where() == {"critic weights": True, "critic optimizer": False}
        off.enter("update")
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.step()
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
    _assert_same(_snapshot(a, opt_a), _snapshot(b, opt_b))


def test_the_cpu_buffers_are_allocated_once():
    model, opt = _trained()
    off = Offload(CPU)
    off.add_weights("reference", [model])
    off.add_optimizer("actor optimizer", opt)
    off.enter("generate")
    first = dict(off.store.buffers)
    # 4 parameters: data, gradient, exp_avg, exp_avg_sq and the step (on the CPU device)
    assert len(first) == 4 * 5
    assert all(not b.is_pinned() for b in first.values())  # pinned only for a GPU
    off.enter("update")
    off.enter("generate")
    assert off.store.buffers.keys() == first.keys()
    assert all(off.store.buffers[k] is first[k] for k in first)  # reused, not reallocated


def test_each_phase_finds_what_it_needs():
    parts = {}
    off = Offload(CPU, reference_in_update=True)
    for name in ("critic weights", "reference", "teacher", "reward models"):
        parts[name] = torch.nn.Linear(2, 2)
        off.add_weights(name, [parts[name]])
    _, opt = _trained()
    off.add_optimizer("actor optimizer", opt)
    want = {
        "generate": set(),
        "reward": {"reward models"},
        "score": {"critic weights", "reference", "teacher"},
        "update": {"critic weights", "reference", "actor optimizer"},  # use_kl_loss
        "evaluate": {"reward models"},
    }
    for phase, resident in want.items():
        off.enter(phase)
        assert {k for k, v in off.where().items() if v} == resident, phase
    off.enter("advantages")  # a phase RESIDENT does not name changes nothing
    assert {k for k, v in off.where().items() if v} == want["evaluate"]


def test_the_lora_reference_has_nothing_to_move():
    off = Offload(CPU)
    off.add_weights("reference", [torch.nn.Identity()])  # no parameters of its own
    assert off.parts == {}


def test_the_step_count_stays_where_adamw_keeps_it():
    """On a GPU AdamW's step is a CPU scalar: only the state on the device moves (here the
    device is `meta`, so the CPU step and every CPU tensor stay)."""
    model, opt = _trained()
    steps = [opt.state[p]["step"] for p in model.parameters()]
    off = Offload(torch.device("meta"))
    offload_optimizer(opt, off.store, off.device)
    assert off.store.buffers == {}
    restore_optimizer(opt, off.store, off.device)
    assert [opt.state[p]["step"] for p in model.parameters()] == steps


@dataclass
class OffloadRun:
    rows: list[dict]  # each iteration's metrics, wall-clock readings left out
    state: dict[str, torch.Tensor]  # the trained roles' weights and AdamW state at the end
    away: dict[str, set[str]]  # phase -> the offload parts on the CPU as it began (last time)
    # phase -> where the AdamW state was as it began (device types; iterations 2+)
    optimizer_devices: dict[str, set[str]] = field(default_factory=dict)
    # CUDA, iterations 2+: the bytes allocated as generation begins (after the moves), most
    generating: int = 0


def offload_run(files, offload: bool, iterations: int, *extra: str, device: str = "cpu"):
    """`iterations` steps of the nano trainer on `device`, with or without offload."""
    torch.manual_seed(0)
    trainer = nano_trainer(files, *extra, offload=offload, device=device)
    cuda = device.startswith("cuda")
    run = OffloadRun([], {}, {})

    class Listener:  # told as each phase begins (after the moves before it)
        def start(self, name):
            if trainer.offload is not None and name != "offload":
                run.away[name] = {k for k, v in trainer.offload.where().items() if not v}
            if trainer.iteration > 0 and name != "offload":
                devices = run.optimizer_devices.setdefault(name, set())
                for role in trainer.trained.values():
                    devices |= {s["exp_avg"].device.type for s in role.optimizer.state.values()}
            if cuda and name == "generate" and trainer.iteration > 0:
                run.generating = max(run.generating, torch.cuda.memory_allocated())

        def end(self, name, seconds):
            pass

    trainer.timer.listener = Listener()
    for _ in range(iterations):
        metrics, _ = trainer.step()
        run.rows.append({k: v for k, v in metrics.items() if not k.startswith(NOT_COMPARED)})
    if offload:
        trainer.offload.enter("update")  # everything back, to compare
    for name, role in trainer.trained.items():
        for k, v in role.unwrapped.state_dict().items():
            run.state[f"{name}.{k}"] = v.detach().cpu().clone()
        for i, s in role.optimizer.state_dict()["state"].items():
            for k, v in s.items():
                run.state[f"{name}.opt.{i}.{k}"] = v.cpu().clone()
    trainer.close()
    return run


def _reward_model(files, root) -> str:
    tok = load_tokenizer(files["model"])
    build_tiny_reward_model("llama", tok, size="nano", seed=1).save_pretrained(root / "rm")
    tok.save_pretrained(root / "rm")
    return str(root / "rm")


def test_a_run_with_offload_equals_a_run_without(tmp_path):
    """Every part moves: a value model, the reference (in the update too, under
    actor.use_kl_loss), a reward model, both optimizers."""
    files = nano_files(tmp_path)
    rm = _reward_model(files, tmp_path)
    extra = ("actor.use_kl_loss=true", "reward.function=", f"reward.model_path={rm}")
    plain = offload_run(files, False, 2, *extra)
    run = offload_run(files, True, 2, *extra)
    assert run.rows == plain.rows  # every metric, bit for bit
    _assert_same(plain.state, run.state)
    optimizers = {"actor optimizer", "critic optimizer"}
    frozen = {"critic weights", "reference", "reward models"}
    assert run.away["generate"] == optimizers | frozen
    assert run.away["reward"] == optimizers | {"critic weights", "reference"}
    assert run.away["score"] == optimizers | {"reward models"}
    assert run.away["update"] == {"reward models"}


def test_the_iteration_reports_its_moving_seconds(tmp_path):
    files = nano_files(tmp_path)
    trainer = nano_trainer(files, "trainer.iterations=1")
    assert trainer.offload is None  # model.offload=auto on a CPU: nothing moves
    metrics, _ = trainer.step()
    assert "time/offload" not in metrics
    trainer.close()
    trainer = nano_trainer(files, "trainer.iterations=1", offload=True)
    metrics, _ = trainer.step()
    assert metrics["time/offload"] > 0
    trainer.close()
