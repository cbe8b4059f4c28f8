"""Python reward functions: loading by spec, calling, and every failure message."""

import math
import textwrap

import numpy as np
import pytest
import torch

from proxima.rewards.function import FunctionReward, RewardError, load_reward_function

PROMPTS = ["1+1=", "2+2=", "3+3="]
RESPONSES = ["2", "5", "6"]
COLUMNS = {"answer": ["2", "4", "6"], "source": ["x", "y", "z"]}


def write(path, source):
    path.write_text(textwrap.dedent(source))
    return path


def call(fn, prompts=PROMPTS, responses=RESPONSES, columns=COLUMNS):
    seq = torch.zeros((len(prompts), 4), dtype=torch.long)
    return FunctionReward(fn, name="fn")(prompts, responses, columns, seq, torch.ones_like(seq))


EXACT = """
    def exact(prompts, responses, answer, **kwargs):
        return [float(r == a) for r, a in zip(responses, answer)]
    helper_value = 3
"""


def test_file_spec_loads_and_scores(tmp_path):
    path = write(tmp_path / "my_reward.py", EXACT)
    source = FunctionReward.from_spec(f"{path}:exact")
    scores = source(PROMPTS, RESPONSES, COLUMNS, None, None)
    assert scores.dtype == torch.float32 and scores.device.type == "cpu"
    assert scores.tolist() == [1.0, 0.0, 1.0]  # "2"=="2", "5"!="4", "6"=="6"
    assert source.name == f"{path}:exact"


def test_file_can_import_a_sibling_module(tmp_path):
    write(tmp_path / "sib_helpers_q1.py", "def bonus():\n    return 0.5\n")
    path = write(
        tmp_path / "uses_sibling.py",
        "from sib_helpers_q1 import bonus\n\ndef fn(prompts, responses, **kw):\n"
        "    return [bonus()] * len(responses)\n",
    )
    assert call(load_reward_function(f"{path}:fn")).tolist() == [0.5, 0.5, 0.5]


def test_module_spec_loads(tmp_path, monkeypatch):
    pkg = tmp_path / "rw_pkg_zq"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write(pkg / "scorer.py", EXACT)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_function("rw_pkg_zq.scorer:exact")
    assert call(fn).tolist() == [1.0, 0.0, 1.0]


def test_spec_without_colon():
    with pytest.raises(ValueError, match=r"'reward\.py' needs a ':' and a name"):
        load_reward_function("reward.py")


def test_missing_file(tmp_path):
    spec = f"{tmp_path}/absent.py:fn"
    with pytest.raises(ValueError, match=r"absent\.py not found.*fix the path"):
        load_reward_function(spec)


def test_file_import_error_carries_its_message(tmp_path):
    path = write(tmp_path / "broken.py", "import math\nraise RuntimeError('boom at import')\n")
    with pytest.raises(ValueError, match=r"broken\.py failed with RuntimeError: boom at import"):
        load_reward_function(f"{path}:fn")


def test_missing_module():
    with pytest.raises(ValueError, match=r"'no_such_mod_qq'.*ModuleNotFoundError"):
        load_reward_function("no_such_mod_qq:fn")


def test_missing_attribute_lists_public_functions(tmp_path):
    path = write(
        tmp_path / "several.py",
        "def alpha(p, r): ...\ndef beta(p, r): ...\ndef _private(p, r): ...\nCONST = 1\n",
    )
    with pytest.raises(
        ValueError, match=r"no attribute 'gamma'; public functions found: \['alpha', 'beta'\]"
    ):
        load_reward_function(f"{path}:gamma")


def test_not_callable(tmp_path):
    path = write(tmp_path / "consts.py", "threshold = 0.5\n")
    with pytest.raises(ValueError, match="'threshold' is a float; it must be a function"):
        load_reward_function(f"{path}:threshold")


def test_only_named_columns_are_passed():
    seen = {}

    def fn(prompts, responses, answer):  # no **kwargs: "source" must not be passed
        seen["answer"] = answer
        return [1] * len(responses)

    assert call(fn).tolist() == [1.0, 1.0, 1.0]
    assert seen["answer"] == COLUMNS["answer"]

    def named_like_columns(prompts, responses, answer):  # a column "prompts" must not clash
        return [float(a) for a in answer]

    columns = {"prompts": ["x"] * 3, "answer": ["1"] * 3}
    assert call(named_like_columns, columns=columns).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "value",
    [
        [True, False, True],
        np.array([1.0, 0.0, 1.0]),
        torch.tensor([1, 0, 1]),
        (1, 0.0, np.int64(1)),
    ],
)
def test_accepted_return_types(value):
    assert call(lambda p, r, **k: value).tolist() == [1.0, 0.0, 1.0]


def test_raising_function_names_function_exception_and_first_failing_sample():
    def picky(prompts, responses, **kw):
        return [float(r) if r != "5" else int("x" + r) for r in responses]

    with pytest.raises(RewardError) as err:
        call(picky)
    msg = str(err.value)
    assert "reward function fn raised ValueError: invalid literal" in msg
    # The per-sample retry points at sample 1, the one whose response is "5".
    assert "first failing sample 1: prompt '2+2=', response '5'" in msg
    assert "Columns passed: ['answer', 'source']" in msg


def test_function_that_only_fails_on_batches_still_reports():
    def batch_only(prompts, responses, **kw):
        if len(responses) > 1:
            raise KeyError("batch")
        return [0.0]

    with pytest.raises(RewardError, match="raised KeyError") as err:
        call(batch_only)
    assert "first failing sample" not in str(err.value)


def test_nan_and_inf_are_reported_with_indices():
    with pytest.raises(RewardError) as err:
        call(lambda p, r, **k: [0.0, math.nan, math.inf])
    msg = str(err.value)
    assert "non-finite scores at indices [1, 2]" in msg
    assert "first: nan for prompt '2+2=', response '5'" in msg


def test_length_mismatch():
    with pytest.raises(RewardError, match=r"returned shape \(2,\) for a batch of 3 responses"):
        call(lambda p, r, **k: [1.0, 2.0])


def test_wrong_return_types():
    with pytest.raises(RewardError, match="returned a float; return a list of 3 numbers"):
        call(lambda p, r, **k: 1.0)
    with pytest.raises(RewardError, match=r"returned 'high' \(str\) at index 1"):
        call(lambda p, r, **k: [1.0, "high", 0.0])
    with pytest.raises(RewardError, match=r"shape \(3, 1\)"):
        call(lambda p, r, **k: torch.zeros(3, 1))
