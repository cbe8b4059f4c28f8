"""The built-in preference task of `proxima pipeline`: a graded gold score with several parts.

A prompt names three letters, e.g. `cfa:`; a response is a string of letters. The gold
score adds three parts, each in [0, 1]:

- cover: the share of the prompt's letters the response contains;
- length: 1 at `TARGET_LENGTH` letters, falling linearly to 0 at 0 and at twice as many;
- variety: the share of distinct letters among the response's letters (repeats cost).

So the best responses hold the three named letters and three others, each once. No part is
0/1, and they pull against each other (more letters cover more but cost length and
variety), so a small reward model learns them only in part and a policy that pushes its
score far enough finds where it is wrong: the setting in which the gold score can peak while
the proxy still rises (Gao et al. 2022, arXiv:2210.10760).

The demonstrations are deliberately mediocre (random letters, prompt letters over-
represented, random lengths): the SFT policy writes the task's format with a wide spread of
gold scores, which the preferences then sort out.
"""

from __future__ import annotations

import random
from pathlib import Path

from proxima.config import Config
from proxima.tasks.common import task_model, write_jsonl

LETTERS = "abcdefghij"
ALPHABET = LETTERS + ":"
PROMPT_LETTERS = 3
TARGET_LENGTH = 6
MAX_DEMO_LENGTH = 10
GOLD_FN = "proxima.tasks.preferences:gold"


def gold_parts(prompt: str, response: str) -> tuple[float, float, float]:
    """(cover, length, variety) of one response, each in [0, 1] (module docstring)."""
    wanted = set(prompt.rstrip(":"))
    letters = [c for c in response if c in LETTERS]
    cover = len(wanted & set(letters)) / len(wanted) if wanted else 0.0
    length = max(0.0, 1.0 - abs(len(letters) - TARGET_LENGTH) / TARGET_LENGTH)
    variety = len(set(letters)) / len(letters) if letters else 0.0
    return cover, length, variety


def gold(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """The gold score: cover + length + variety, in [0, 3]."""
    return [sum(gold_parts(p, r)) for p, r in zip(prompts, responses, strict=True)]


def _prompt(rng: random.Random) -> str:
    return "".join(rng.sample(LETTERS, PROMPT_LETTERS)) + ":"


def _demonstration(prompt: str, rng: random.Random) -> str:
    """A random response: 1 to MAX_DEMO_LENGTH letters, each a prompt letter with
    probability 0.4, else any letter."""
    named = prompt.rstrip(":")
    n = rng.randint(1, MAX_DEMO_LENGTH)
    return "".join(
        rng.choice(named) if rng.random() < 0.4 else rng.choice(LETTERS) for _ in range(n)
    )


def prepare(cfg: Config, folder: Path) -> tuple[Config, dict]:
    """Write prompts (task.n_train), held-out prompts (task.n_eval, disjoint), demonstrations
    (task.n_sft) and, unless model.actor_path names one, a tiny model (task.arch, task.size)
    into `folder`; returns the config pointed at them, with this task's gold scorer, and what
    was written."""
    t, seed = cfg.task, cfg.trainer.seed
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    every = sorted({_prompt(random.Random(i)) for i in range(20_000)})  # all 720 prompts
    rng.shuffle(every)
    heldout, train = every[: t.n_eval], every[t.n_eval :]
    if not train:
        raise ValueError(
            f"task.n_eval={t.n_eval} leaves no training prompts of the {len(every)} this task "
            "has; lower task.n_eval."
        )
    train_rows = [{"prompt": train[i % len(train)]} for i in range(t.n_train)]
    demos = [
        {"prompt": p, "response": _demonstration(p, rng)} for p in rng.choices(train, k=t.n_sft)
    ]
    paths = {
        "prompts": write_jsonl(folder / "prompts.jsonl", train_rows),
        "heldout": write_jsonl(folder / "heldout.jsonl", [{"prompt": p} for p in heldout]),
        "sft_data": write_jsonl(folder / "sft.jsonl", demos),
    }
    changes = {f"pipeline.{k}": str(v) for k, v in paths.items()}
    changes["pipeline.gold"] = GOLD_FN
    # the user's model learns the task as given (any tokenizer writes these letters)
    changes["model.actor_path"] = cfg.model.actor_path or str(task_model(cfg, folder, ALPHABET))
    info = {"name": "preferences", "files": {k: str(v) for k, v in paths.items()}}
    return cfg.replace(changes), info
