"""The calculator task (`proxima train tools`) with the latencies of real tools and reward
servers, for bench_async_overlap.py: each call of the calculator takes 50-200 ms (drawn per
call from its own generator, so the run's random streams are untouched), and `judge` is a
reward function that answers after 0.2 s (served by `proxima serve-reward`, as a reward
server with latency; it scores 0: the environment gives the reward)."""

from __future__ import annotations

import random
import time

from proxima.tasks.tools import Calculator

_clock = random.Random(0)


class SlowCalculator(Calculator):
    """`Calculator`, each step 50-200 ms late."""

    def step(self, action: str) -> tuple[str | None, float, bool]:
        time.sleep(_clock.uniform(0.05, 0.2))
        return super().step(action)


def judge(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    time.sleep(0.2)
    return [0.0] * len(responses)
