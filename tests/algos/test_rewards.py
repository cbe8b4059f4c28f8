import pytest
import torch

from proxima.algos import last_token_index, token_rewards

SCORES = torch.tensor([7.0, -9.0, 2.0, 3.0])
KL = torch.tensor(
    [
        [0.5, 1.0, -1.0, 99.0],
        [1.0, 99.0, 2.0, 99.0],
        [4.0, 4.0, 4.0, 4.0],
        [0.0, 99.0, 99.0, 99.0],
    ]
)
# Row 0: three tokens; row 1: a hole at t=1; row 2: empty; row 3: one token.
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]])


def test_last_token_index():
    index, has_tokens = last_token_index(MASK)
    assert index.tolist() == [2, 2, 0, 0]
    assert has_tokens.tolist() == [True, True, False, True]


def test_token_rewards_literal_clip_both_sides():
    # -0.1 * kl on real tokens; clip(score, -5, 5) added at the last real token.
    # Row 0: [-0.05, -0.1, +0.1 + clip(7) = 5.1, 0]
    # Row 1: [-0.1, 0 (hole), -0.2 + clip(-9) = -5.2, 0]
    # Row 2: empty -> no KL and no score.
    # Row 3: [-0.1 * 0 + 3 (inside the clip), 0, 0, 0]
    out = token_rewards(SCORES, KL, MASK, kl_coef=0.1, clip_reward_value=5.0)
    expected = torch.tensor(
        [
            [-0.05, -0.1, 5.1, 0.0],
            [-0.1, 0.0, -5.2, 0.0],
            [0.0, 0.0, 0.0, 0.0],
            [3.0, 0.0, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(out, expected)
    assert out.dtype == torch.float32


def test_token_rewards_without_clip():
    # clip_reward_value=None: raw scores 7 and -9 are added; kl_coef 0 leaves only scores.
    out = token_rewards(SCORES, KL, MASK, kl_coef=0.0, clip_reward_value=None)
    expected = torch.zeros(4, 4)
    expected[0, 2], expected[1, 2], expected[3, 0] = 7.0, -9.0, 3.0
    torch.testing.assert_close(out, expected)


def test_token_rewards_ignores_nan_kl_on_padding():
    kl = KL.clone()
    kl[0, 3] = float("nan")
    kl[2] = float("inf")
    out = token_rewards(SCORES, kl, MASK, 0.1, 5.0)
    assert torch.isfinite(out).all()
    assert out[2].abs().sum().item() == 0.0


def test_token_rewards_does_not_modify_inputs():
    scores, kl, mask = SCORES.clone(), KL.clone(), MASK.clone()
    token_rewards(scores, kl, mask, 0.1, 5.0)
    assert torch.equal(scores, SCORES) and torch.equal(kl, KL) and torch.equal(mask, MASK)


def test_token_rewards_errors():
    with pytest.raises(ValueError, match=r"kl \[4, 4\] vs response_mask \[4, 3\]"):
        token_rewards(SCORES, KL, MASK[:, :3], 0.1, 5.0)
    with pytest.raises(ValueError, match=r"scores \[3\] vs kl \[4, 4\]"):
        token_rewards(SCORES[:3], KL, MASK, 0.1, 5.0)
    with pytest.raises(ValueError, match="clip_reward_value must be > 0"):
        token_rewards(SCORES, KL, MASK, 0.1, 0.0)


def test_token_rewards_zero_width():
    out = token_rewards(SCORES, torch.zeros(4, 0), torch.zeros(4, 0), 0.1, 5.0)
    assert out.shape == (4, 0)


def test_overlong_penalty_is_dapos_linear_ramp():
    from proxima.algos import overlong_penalty

    # max 16, buffer 4: free up to 12 tokens, then -1/4 per token down to -1 at 16
    lengths = torch.tensor([3, 12, 13, 14, 16])
    got = overlong_penalty(lengths, max_length=16, buffer_length=4, penalty_factor=1.0)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    half = overlong_penalty(lengths, max_length=16, buffer_length=4, penalty_factor=0.5)
    assert half.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(lengths, max_length=16, buffer_length=0)
