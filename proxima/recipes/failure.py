"""A failed run in words: the first error (`Failure`: what, at which iteration, in which
phase), what else could not be written after it, and plainly what is kept and how to go on
(`failure_message`). The recipe (`recipes.ppo`) keeps what it can; this says what it kept."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

# the phases of a failure that leave the iteration complete (nothing to undo): after the step
AFTER_THE_STEP = ("evaluation before training", "evaluation", "logging", "checkpoint")
SAVING = "saving the models"  # the phase of a run whose result could not be written


class Failure(NamedTuple):
    """The first error that struck a run."""

    error: Exception
    iteration: int
    phase: str

    @property
    def complete(self) -> bool:
        """The iteration is complete as it is (the error came after its step)."""
        return self.phase in AFTER_THE_STEP or self.phase == SAVING


def failure_message(
    failed: dict,
    run_dir: Path,
    *,
    unwritten: list[str],
    summary_written: bool,
    kept_models: bool,
    removed: bool,
    trained: int,
    iteration: int,
) -> str:
    """The first error (`failed`: summary.json's entry), then what else could not be
    written, then plainly what is kept and how to go on. `trained`: the iterations this
    run trained; `iteration`: the trainer's; `removed`: the run folder was removed."""

    text = f"iteration {failed['iteration']} failed in phase `{failed['phase']}`"
    if failed["phase"] == "evaluation before training":
        text = "the evaluation before training failed"
    if failed["phase"] == SAVING:
        text = f"the result of iteration {failed['iteration']} could not be written"
    lines = [f"{text}: {failed['error']}"]
    lines += [f"also not written: {what}" for what in unwritten]
    marked = "summary.json marked failed" if summary_written else "no summary.json could be written"
    if failed["checkpoint"] is not None and failed["phase"] == SAVING:
        lines.append(
            f"kept: the checkpoint {failed['checkpoint']}, which holds the trained models "
            f"(its actor/ is the result), and the run folder {run_dir} ({marked})"
        )
    elif failed["checkpoint"] is not None:
        lines.append(
            f"kept: the checkpoint {failed['checkpoint']} and the run folder "
            f"{run_dir} ({marked}); once the cause is fixed, resume with "
            f"`proxima train trainer.resume_from={failed['checkpoint']}`"
        )
    elif kept_models:
        lines.append(
            f"kept: the models of iteration {iteration} in "
            f"{run_dir} (actor/, the critic's; {marked}); no checkpoint could be "
            f"written, so a new run starts from them (model.actor_path={run_dir}/actor)"
        )
    elif removed:
        lines.append(f"nothing was trained yet: the run folder {run_dir} is removed")
    elif trained > 0:
        lines.append(
            f"kept: no checkpoint and no models (none could be written): the "
            f"{iteration} iterations trained are lost; the run folder "
            f"{run_dir} keeps the lines of metrics.jsonl and samples.jsonl that were "
            f"written whole ({marked}). Free space, then start the run again"
        )
    else:
        lines.append(f"nothing was trained yet; the run folder is {run_dir}")
    return "\n".join(lines)
