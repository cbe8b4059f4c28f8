"""The sandbox's two uses: the multi-turn environment `PythonEnv` and the reward
functions `tests_passed` / `all_tests_passed` (`CodeTestsReward`)."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

from proxima.sandbox.run import Limits, SandboxResult, run_python

CODE_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)


def code_block(text: str) -> str | None:
    """The last ```python (or ```py) fenced block of ``text``, or None."""
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


class PythonEnv:
    """A multi-turn environment (``rollout.env.cls=proxima.sandbox:PythonEnv``): an action
    with a ```python block runs its last one in the sandbox and is answered with its output
    (stdout, then stderr, at most ``max_observation_chars``, and the outcome when it is not
    ok) as a ```output block; an action without one ends the episode. Every turn's reward
    is 0 (score the episode with a reward source, e.g. `tests_passed`, or subclass); the
    turn's record keeps the run's `SandboxResult.info` as its ``info``. Subclass to change
    ``limits`` or ``max_observation_chars``."""

    limits = Limits(wall_s=5.0, cpu_s=5)
    max_observation_chars = 2000

    def __init__(self, row: dict) -> None:
        self.row = row

    def step(self, action: str) -> tuple[str | None, float, bool, dict]:
        code = code_block(action)
        if code is None:
            return None, 0.0, True, {}
        result = run_python(code, self.limits)
        return self.observation(result), 0.0, False, {"sandbox": result.info()}

    def observation(self, result: SandboxResult) -> str:
        text = result.stdout + result.stderr
        if len(text) > self.max_observation_chars:
            text = text[: self.max_observation_chars] + f"\n... ({len(text)} characters)"
        if not result.ok:
            text += f"\n[{result.outcome}: {result.detail}]"
        return f"\n```output\n{text.strip()}\n```\n"


class CodeTestsReward:
    """A reward function (``reward.function=proxima.sandbox:tests_passed``): each response's
    code (its last ```python block, or the whole response when it has none) runs in a
    sandbox of its own, followed by the row's ``tests`` (a list of Python statements, e.g.
    asserts, or one string with one per line), each test on its own; the score is the share
    of tests that pass (``all_or_nothing``: 1 when all do, else 0). Up to ``workers``
    sandboxes run at once. A test passes when it runs without an exception after the code;
    the code runs with ``__name__ == "solution"`` (its ``if __name__ == "__main__":`` part
    does not run). Tests that ran before a limit was passed still count. A test's pass is
    printed with a random token the script does not hold, so code that prints passes scores
    nothing; code that digs the token out of the interpreter (its frames) could still forge
    them: the sandbox contains code, it does not make tests tamper-proof."""

    def __init__(
        self, limits: Limits | None = None, all_or_nothing: bool = False, workers: int = 4
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"CodeTestsReward: workers={workers!r} must be an integer >= 1.")
        self.limits = limits or Limits()
        self.all_or_nothing, self.workers = all_or_nothing, workers

    def __call__(self, prompts: list[str], responses: list[str], tests: list) -> list[float]:
        with ThreadPoolExecutor(self.workers, thread_name_prefix="sandbox") as pool:
            return list(pool.map(self.score, responses, tests))

    def score(self, response: str, tests: list[str] | str) -> float:
        """One response's score against its tests."""
        tests = tests.splitlines() if isinstance(tests, str) else list(tests)
        tests = [t for t in tests if t.strip()]
        if not tests:
            raise ValueError("CodeTestsReward: a row has no tests; give each row a `tests` list.")
        code = code_block(response) or response
        token = os.urandom(16).hex()  # not in the script: printing "... pass" does not count
        result = run_python(_harness(code, tests), self.limits, stdin=token + "\n")
        passed = sum(line == f"{token} pass" for line in result.stdout.splitlines())
        if self.all_or_nothing:
            return float(passed == len(tests))
        return passed / len(tests)


def _harness(code: str, tests: list[str]) -> str:
    """A script that reads the pass token from stdin (before the code could read it), runs
    ``code``, then each test, printing ``<token> pass`` for each one that raised nothing."""
    return (
        "import sys\n"
        "_token = sys.stdin.readline().strip()\n"
        "_ns = {'__name__': 'solution'}\n"
        f"exec(compile({code!r}, 'solution.py', 'exec'), _ns)\n"
        f"for _i, _test in enumerate({tests!r}):\n"
        "    try:\n"
        "        exec(compile(_test, f'test {_i}', 'exec'), _ns)\n"
        "    except Exception as _e:\n"
        "        print(f'test {_i} failed: {type(_e).__name__}: {_e}', file=sys.stderr)\n"
        "    else:\n"
        "        print(_token, 'pass', flush=True)\n"
    )


tests_passed = CodeTestsReward()
all_tests_passed = CodeTestsReward(all_or_nothing=True)
