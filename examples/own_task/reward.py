"""Exact-match 0/1 reward: `reward.function=examples/own_task/reward.py:exact`."""


def exact(prompts: list[str], responses: list[str], answer: list[str], **_) -> list[float]:
    return [float(r.strip() == a) for r, a in zip(responses, answer, strict=True)]
