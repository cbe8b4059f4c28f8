"""`torchrun --nproc_per_node 2 -m proxima train` end to end on a nano model (gloo, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from proxima.cli import main
from tests.distributed.conftest import torchrun
from tests.helpers import run_metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# wall-clock numbers; the explained variance divides by the returns' variance, which is
# tiny in a 3-iteration greedy run, and so magnifies the float rounding of other row layouts;
# ratio_max is each micro-batch's max, averaged, and the micro-batches of 1 and 2 processes
# hold other rows (the same global mini-batch: the same gradient)
# wall clock, and two readings that differ in the last bits between one process and two
NOT_COMPARED = ("time/", "tokens_per_s", "critic/explained_variance", "actor/ratio_max")


def _metrics(run: Path) -> dict[int, dict]:
    return run_metrics(run, NOT_COMPARED)


def _close(a: dict[int, dict], b: dict[int, dict]) -> None:
    assert a.keys() == b.keys() and a
    for step in a:
        assert a[step].keys() == b[step].keys(), step
        for k in a[step]:
            assert b[step][k] == pytest.approx(a[step][k], rel=1e-4, abs=1e-6), (step, k)


@pytest.fixture
def greedy(make_model, fast_overrides, tmp_path):
    """Overrides of a 3-iteration run with greedy sampling (top_k=1): no randomness in the
    rollout, so 1 and 2 processes see the same responses; one mini-batch per iteration."""
    model = make_model("llama")

    def overrides(out: Path, *extra: str) -> list[str]:
        return fast_overrides(
            model,
            out,
            3,
            "rollout.top_k=1",
            "trainer.threads=1",
            "actor.ppo_micro_batch_size=2",
            "critic.ppo_micro_batch_size=2",
            *extra,
        )

    return overrides


@pytest.mark.parametrize(
    "strategy", ["ddp", "fsdp2", "ddp-shared", "fsdp2-shared", "fsdp2-shared-engine"]
)
def test_two_processes_give_the_metrics_of_one(greedy, tmp_path, strategy):
    """`-shared`: the actor with a value head on its backbone, one module under DDP or
    FSDP2 (whose generation then goes through the sharded root); `-engine`: the old
    log-probs, and so the values, from the generation (the head applied inside the
    sharded root's generate)."""
    one, two = tmp_path / "one", tmp_path / "two"
    shared = ("critic.shared_backbone=true",) if "shared" in strategy else ()
    if strategy.endswith("-engine"):
        shared += ("rollout.old_logprobs=engine",)
    assert main(["train", *greedy(one, *shared)]) == 0
    strategy = strategy.split("-")[0]
    torchrun(["-m", "proxima", "train", *greedy(two, f"trainer.strategy={strategy}", *shared)])
    _close(_metrics(one), _metrics(two))
    if shared:
        head = [load_file(run / "value_head" / "model.safetensors") for run in (one, two)]
        for k in head[0]:
            torch.testing.assert_close(head[1][k], head[0][k], atol=1e-5, rtol=1e-4, msg=k)
    assert not two.with_name("two-2").exists()  # one run folder, written by rank 0 only
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["iterations"] == 3
    # the saved actor (gathered from the shards under FSDP2) is the one process's actor
    a = AutoModelForCausalLM.from_pretrained(one / "actor", local_files_only=True).state_dict()
    b = AutoModelForCausalLM.from_pretrained(two / "actor", local_files_only=True).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_resume_under_torchrun_replays_the_run(make_model, fast_overrides, tmp_path, strategy):
    """Sampled rollouts (each rank draws from its own stream): a 2-process run resumed from
    its iteration-2 checkpoint trains iterations 3 and 4 exactly as the uninterrupted run
    (under FSDP2 the checkpoint holds the shards gathered whole, read back into shards)."""
    model = make_model("llama")
    a, b = tmp_path / "a", tmp_path / "b"
    base = ["trainer.threads=1", "trainer.save_every=2", "trainer.keep_checkpoints=0"]
    base.append(f"trainer.strategy={strategy}")
    torchrun(["-m", "proxima", "train", *fast_overrides(model, a, 4, *base)])
    resume = f"trainer.resume_from={a / 'checkpoints' / 'iter_2'}"
    torchrun(["-m", "proxima", "train", *fast_overrides(model, b, 4, *base, resume)])
    first, again = _metrics(a), _metrics(b)
    assert sorted(again) == [3, 4]
    _close({k: first[k] for k in (3, 4)}, again)
    # another number of processes reads the same checkpoint (fresh random streams)
    one = fast_overrides(model, tmp_path / "c", 4, "trainer.threads=1", resume)
    assert main(["train", *one]) == 0 and sorted(_metrics(tmp_path / "c")) == [3, 4]


def test_a_finished_rank_exits_past_finalisation_keeping_its_output(tmp_path):
    """`dist.exit_now`, how a rank that tore down its process group ends: its status, its
    unflushed output and Python's exit handlers kept, the interpreter's finalisation (where
    gloo's threads can abort a run that succeeded) skipped."""
    done = tmp_path / "handler-ran"
    code = (
        "import atexit, sys; from proxima.trainer.dist import exit_now; "
        f"atexit.register(lambda: open({str(done)!r}, 'w').write('ok')); "
        "sys.stdout.write('no newline yet'); sys.stderr.write('said'); exit_now(3)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    assert (proc.stdout, proc.stderr) == ("no newline yet", "said")
    assert done.read_text() == "ok"


def test_failing_reward_on_one_rank_stops_the_job_naming_it(
    make_model, fast_overrides, tmp_path, reward_spec
):
    model = make_model("llama")
    args = fast_overrides(model, tmp_path / "run", 2, "trainer.threads=1")
    args = [a for a in args if not a.startswith("reward.function=")]
    args.append(f"reward.function={reward_spec('fails_on_rank_1')}")
    proc = torchrun(["-m", "proxima", "train", *args], timeout=120, check=False)
    assert proc.returncode != 0
    err = proc.stderr
    assert "rank 1" in err and "reward service unreachable" in err, err[-2000:]


def test_fsdp2_sampled_generation_with_ragged_lengths_finishes(
    make_model, fast_overrides, tmp_path
):
    """Sampled responses of up to 12 tokens end at different lengths on the two ranks; under
    FSDP2 every forward is a collective, so without synced generation the ranks fall out of
    step (a hang, here cut to 60 s by trainer.dist_timeout_s)."""
    model = make_model("llama")
    out = tmp_path / "run"
    extra = ["trainer.threads=1", "trainer.strategy=fsdp2", "rollout.max_response_length=12"]
    extra += ["trainer.dist_timeout_s=60", "eval.max_prompts=6"]
    torchrun(["-m", "proxima", "train", *fast_overrides(model, out, 2, *extra)], timeout=240)
    lengths = [m["response_length"] for m in _metrics(out).values()]
    assert len(lengths) == 2 and all(0 < n <= 12 for n in lengths)


def test_killed_rank_ends_the_job(make_model, fast_overrides, tmp_path, reward_spec):
    """A rank that dies (SIGKILL: no Python error to share) ends the whole job with an error
    from torchrun, well before trainer.dist_timeout_s: no rank is left hanging."""
    model = make_model("llama")
    args = fast_overrides(model, tmp_path / "run", 2, "trainer.threads=1")
    args = [a for a in args if not a.startswith("reward.function=")]
    args += [f"reward.function={reward_spec('dies_on_rank_1')}", "trainer.dist_timeout_s=600"]
    proc = torchrun(["-m", "proxima", "train", *args], timeout=180, check=False)
    assert proc.returncode != 0
    assert "Signal 9" in proc.stderr or "SIGKILL" in proc.stderr, proc.stderr[-2000:]


def test_dynamic_sampling_chooses_the_groups_one_process_would(greedy, tmp_path, reward_spec):
    """DAPO's dynamic sampling over 2 processes: the informative groups are chosen globally,
    in one process's order, so every iteration trains on the batch one process would (rank
    0's rows, the first half, logged in samples.jsonl) with the same accounting; the first
    iteration's metrics are one process's. (Later ones drift by float noise: half of the
    groups have advantage 0 exactly, and Adam's first steps turn the rounding of near-zero
    gradients into steps of a full learning rate; gradient parity is test_parity.py's.)"""
    one, two = tmp_path / "one", tmp_path / "two"
    dapo = (
        f"reward.function={reward_spec('even_first_digit_varies')}",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        "algorithm.filter_groups=true",
        "algorithm.max_gen_batches=3",
        "trainer.log_samples=4",
    )
    assert main(["train", *greedy(one, *dapo)]) == 0
    torchrun(["-m", "proxima", "train", *greedy(two, "trainer.strategy=ddp", *dapo)])
    a, b = _metrics(one), _metrics(two)
    _close({1: a[1]}, {1: b[1]})
    for step in a:
        for key in ("dapo/gen_batches", "dapo/groups_kept", "dapo/groups_filled", "score"):
            assert a[step][key] == b[step][key], (step, key)
    assert any(row["dapo/gen_batches"] > 1 for row in a.values())

    def samples(run: Path) -> list[tuple]:
        rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
        return [(r["step"], r["prompt"], r["score"]) for r in rows]

    assert samples(one) == samples(two)
