"""Evaluation metrics over k samples per prompt: unbiased pass@k and mean@k.

pass@k is the estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code", arXiv:2107.03374, eq. 1): with n samples of which c are correct,
pass@k = 1 - C(n - c, k) / C(n, k), the probability that at least one of k samples drawn
without replacement from the n is correct. It is unbiased for every k <= n, unlike the
"best of k of a bootstrap" estimate, which underestimates it. Computed as
1 - prod_{i = n - c + 1}^{n} (1 - k / i), exact and free of huge binomials.
"""

from __future__ import annotations

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct out of ``n`` samples (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_at_k_table(correct: torch.Tensor) -> dict[int, float]:
    """{k: mean over prompts of pass@k} for every k in 1..n, from ``correct`` [P, n] (bool or
    0/1: sample j of prompt p is correct)."""
    correct = correct.bool()
    p, n = correct.shape
    if p == 0 or n == 0:
        return {}
    counts = correct.sum(dim=1).tolist()
    return {k: sum(pass_at_k(n, c, k) for c in counts) / p for k in range(1, n + 1)}


def mean_at_k(scores: torch.Tensor) -> float:
    """mean@k: the mean score over all k samples of every prompt, scores [P, k]."""
    return float(scores.float().mean()) if scores.numel() else 0.0
