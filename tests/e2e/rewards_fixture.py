"""Reward functions loaded by the end-to-end tests through `reward.function=<file>.py:<fn>`."""

from __future__ import annotations


def fn(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """Dense reward: the fraction of the response's characters that are "7" (0 if empty).

    A random policy over the 12-character arithmetic alphabet scores about 1/12; a policy
    that writes only sevens scores 1.
    """
    return [r.count("7") / len(r) if r else 0.0 for r in responses]


def prompt_starts_with_1(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """0/1 reward that ignores the response, so an evaluation's accuracy is known exactly."""
    return [float(p.startswith("1")) for p in prompts]


def fails_on_rank_1(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """`fn` on every rank of a torchrun job but rank 1, where it raises."""
    import os

    if os.environ.get("RANK") == "1":
        raise ValueError("reward service unreachable (raised on purpose by the test)")
    return fn(prompts, responses)


def dies_on_rank_1(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """`fn`, but rank 1 of a torchrun job is killed (SIGKILL) the first time it scores."""
    import os
    import signal

    if os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return fn(prompts, responses)


def copies_first_char(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """0/1 reward: 1 when the response starts with the prompt's first character ("3+4=" ->
    "3..."). It depends on the prompt, so a constant answer cannot earn it: about 1/10 for
    a random policy over the 12-character alphabet, 1 once the digit is copied."""
    return [float(bool(r) and r[0] == p[0]) for p, r in zip(prompts, responses, strict=True)]


CALLS = {"n": 0}  # this file is imported anew for every run: each run counts from 0


def fails_at_call_3(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """`fn`, but the third call (the third iteration's scoring) raises."""
    CALLS["n"] += 1
    if CALLS["n"] == 3:
        raise ValueError("scoring service down (raised on purpose by the test)")
    return fn(prompts, responses)


def exits(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """A reward function that ends the process: sys.exit(5)."""
    import sys

    sys.exit(5)


def huge(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """1e30 for every response: unclipped, the critic's value loss is not finite."""
    return [1e30] * len(responses)


def even_first_digit_varies(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """DAPO's dynamic sampling: a prompt whose first digit is even scores its samples 0, 1,
    2, ... in the order they come (its group always varies); an odd one scores 0.5 (its group
    is always constant, so filter_groups drops it)."""
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        seen[p] = seen.get(p, -1) + 1
        out.append(float(seen[p]) if int(p[0]) % 2 == 0 else 0.5)
    return out


def constant(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """The same score for everything: no group carries a signal."""
    return [1.0 for _ in prompts]


def first_sample_correct(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """1 for the first sample of each prompt in the call, 0 for the others: with n samples
    per prompt exactly one is correct, so pass@k = k / n."""
    seen: set[str] = set()
    out = []
    for p in prompts:
        out.append(0.0 if p in seen else 1.0)
        seen.add(p)
    return out


def set_is_ones(prompts: list[str], responses: list[str], dataset: list[str]) -> list[float]:
    """0/1 reward read from the `dataset` column of several prompt files: 1 for the set
    named "ones"."""
    return [float(d == "ones") for d in dataset]


def repeats_one_char(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """Pays a response for saying one character over and over: its most frequent character's
    count / 6 (the runs' rollout.max_response_length)."""
    return [max((r.count(c) for c in set(r.strip())), default=0) / 6 for r in responses]


def sigterm_at_call_3(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """`fn`, but the third call sends SIGTERM to this process (as a scheduler would)."""
    import os
    import signal

    CALLS["n"] += 1
    if CALLS["n"] == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return fn(prompts, responses)
