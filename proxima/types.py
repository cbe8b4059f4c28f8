"""Experience: everything phases 1-5 produce for the update (phase 6), in one typed container.

Shapes: B sequences, P prompt positions (left-padded), R response positions (right-padded).
Per-token tensors are aligned on response tokens: ``old_logprobs[b, t]`` is the
log-probability of response token t of row b (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

# the [B, R] fields, aligned on response tokens
PER_TOKEN = (
    "response_mask",
    "old_logprobs",
    "ref_logprobs",
    "values",
    "kl",
    "token_rewards",
    "advantages",
    "returns",
    "rollout_logprobs",
    "is_weights",
    "sum_pi_squared",
    "teacher_logprobs",
    "turn_rewards",
)


@dataclass(kw_only=True)
class Experience:
    input_ids: torch.Tensor  # [B, P + R] prompt (left-padded) then response (right-padded)
    attention_mask: torch.Tensor  # [B, P + R] 1 on real prompt tokens and real response tokens
    response_mask: torch.Tensor  # [B, R] 1 on response tokens up to and including the first stop
    old_logprobs: torch.Tensor  # [B, R] actor log-probs at rollout time (logits / temperature)
    ref_logprobs: torch.Tensor | None = None  # [B, R] reference log-probs
    values: torch.Tensor | None = None  # [B, R] critic values at rollout time
    scores: torch.Tensor | None = None  # [B] raw score of the reward source
    stopped: torch.Tensor | None = None  # [B] bool: the response ended with a stop token
    kl: torch.Tensor | None = (
        None  # [B, R] per-token KL(actor || reference), the reward's estimator
    )
    token_rewards: torch.Tensor | None = None  # [B, R]
    advantages: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R]
    group_ids: torch.Tensor | None = None  # [B] prompt index of each sequence (rollout.n groups)
    # [B, R] the rollout engine's own log-probs of the sampled tokens (the behaviour policy
    # it actually sampled from), when the engine returned them
    rollout_logprobs: torch.Tensor | None = None
    # [B, R] the policy loss's weights from pi_old / mu: truncated importance weights
    # (algorithm.rollout_correction) times the rejection mask (algorithm.rollout_rejection),
    # or None when neither is on
    is_weights: torch.Tensor | None = None
    # [B, R] sum over the vocabulary of pi_old^2 at each response token, when the advantage
    # estimator needs it (optimal_token_baseline), else None
    sum_pi_squared: torch.Tensor | None = None
    # [B] the score of a greedy response to the row's prompt (ReMax's baseline), or None
    reward_baselines: torch.Tensor | None = None
    # [B, K] the raw score of each of reward.sources (K sources), or None for one source
    score_components: torch.Tensor | None = None
    # [B, R] multi-turn episodes: each turn's reward at its last action token, else None
    turn_rewards: torch.Tensor | None = None
    # [B, R] on-policy distillation: the frozen teacher's log-probs of the sampled tokens
    # (logits / temperature, as old_logprobs), else None
    teacher_logprobs: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    @property
    def response_ids(self) -> torch.Tensor:
        """[B, R] the response tokens."""
        return self.input_ids[:, self.prompt_length :]

    def _tensor_fields(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def to(self, device: torch.device | str) -> Experience:
        moved = {k: v.to(device) for k, v in self._tensor_fields().items()}
        return dataclasses.replace(self, **moved)

    def select(self, idx: torch.Tensor | list[int]) -> Experience:
        """The rows `idx` of every tensor field."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        picked = {k: v[idx.to(v.device)] for k, v in self._tensor_fields().items()}
        return dataclasses.replace(self, **picked)

    def trimmed(self, keep_response_width: bool = False) -> Experience:
        """The same rows without the padding columns every row has: the prompt columns no
        row attends to (left padding) and, unless `keep_response_width`, the response
        columns no row has a real response token in. Positions are counted from each row's
        first real token and attention is causal, so every real token's log-prob and value
        are unchanged (`seq-mean-token-sum-norm` divides by the response width: keep it
        there)."""
        r = self.response_mask.shape[1]
        start, lo, hi = shared_padding(self.attention_mask, self.response_mask, keep_response_width)
        if start == 0 and (lo, hi) == (0, r):
            return self
        keep = slice(start, self.prompt_length + hi)
        changed = {
            "input_ids": self.input_ids[:, keep],
            "attention_mask": self.attention_mask[:, keep],
        }
        for name in PER_TOKEN:
            value = getattr(self, name)
            if value is not None:
                changed[name] = value[:, lo:hi]
        return dataclasses.replace(self, **changed)

    def right_aligned(self) -> Experience:
        """Every row moved right until its last real token is in the last column (its
        right padding moved to the left, before its prompt), the [B, R] fields with it:
        a group of rows then needs only its longest row's width (`trimmed`), not the
        longest prompt plus the longest response. Each row keeps its tokens in order, its
        positions (from the mask) and its causal context, so no log-prob or value changes;
        response token t of a row with n response tokens sits at column R - n + t."""
        shift = right_shifts(self.attention_mask)
        if not bool(shift.any()):
            return self
        changed = {
            "input_ids": roll_rows(self.input_ids, shift),
            "attention_mask": roll_rows(self.attention_mask, shift),
        }
        for name in PER_TOKEN:
            value = getattr(self, name)
            if value is not None:
                changed[name] = roll_rows(value, shift)
        return dataclasses.replace(self, **changed)

    def split(self, size: int) -> list[Experience]:
        """Consecutive chunks of `size` rows (the last may be smaller)."""
        return [
            self.select(torch.arange(i, min(i + size, self.batch_size)))
            for i in range(0, self.batch_size, size)
        ]


def shared_padding(
    attention_mask: torch.Tensor, response_mask: torch.Tensor, keep_response_width: bool = False
) -> tuple[int, int, int]:
    """(start, lo, hi) of rows laid out as `Experience`'s: the response columns [lo, hi)
    some row has a real response token in (at least one column: an all-masked batch still
    goes through the model; all of them with `keep_response_width`), and the first column
    any row attends to (the padding before it is every row's), at the latest the one
    before the response columns (whose logits give the first response token's)."""
    r = response_mask.shape[1]
    p = attention_mask.shape[1] - r
    cols = response_mask.bool().any(dim=0).nonzero()
    if keep_response_width:
        lo, hi = 0, r
    elif not cols.numel():
        lo, hi = 0, min(1, r)
    else:
        lo, hi = int(cols.min()), int(cols.max()) + 1
    real = attention_mask.bool().any(dim=0)
    first = int(real.float().argmax()) if bool(real.any()) else p
    return max(0, min(first, p + lo - 1)), lo, hi


def right_shifts(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] how far each row moves right to put its last attended column last (0 for a row
    that attends to nothing)."""
    n = attention_mask.shape[1]
    cols = torch.arange(n, device=attention_mask.device)
    last = torch.where(attention_mask.bool(), cols, -1).amax(dim=1)
    return torch.where(last >= 0, n - 1 - last, 0)


def roll_rows(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Row b of `x` [B, ..., N] rolled right by shift[b] (circularly) along the last dim."""
    n = x.shape[-1]
    shift = shift.to(x.device).view(-1, *([1] * (x.dim() - 1)))
    idx = (torch.arange(n, device=x.device) - shift) % n
    return x.gather(-1, idx.expand_as(x))


def attended_lengths(attention_mask: torch.Tensor) -> list[int]:
    """[B] how many tokens each row attends to."""
    return attention_mask.bool().sum(dim=1).tolist()


def packed_rows(lengths: list[int], width: int) -> list[list[int]]:
    """Sequences of these `lengths` laid end to end in rows of at most `width` tokens
    (first fit, longest first: each sequence goes into the first row it fits in, else a new
    row; a sequence longer than `width` gets a row of its own). Returns each row's
    sequences in order, by index."""
    rows: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, load in enumerate(loads) if load + lengths[i] <= width), None)
        if row is None:
            rows.append([i])
            loads.append(lengths[i])
        else:
            rows[row].append(i)
            loads[row] += lengths[i]
    return rows


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, split: int) -> list:
    """Rows in groups by their first `split` columns (ids and mask the same: the samples
    of one prompt, in the batch's own layout), in the order of each group's first row."""
    head = torch.cat([input_ids[:, :split], attention_mask[:, :split]], dim=1)
    _, inverse = torch.unique(head, dim=0, return_inverse=True)
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(inverse.tolist()):
        groups.setdefault(g, []).append(row)
    return list(groups.values())


def prompt_sorted_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, split: int, rows: int
) -> list[list[int]]:
    """`rows` rows to a group, as SORTED's, with a prompt's samples kept together (packed
    passes lay a prompt once for them, `models.packing.pack_shared`): the prompts'
    groups (`prompt_groups`), the one with the longest sequence first, cut every `rows`
    rows (a prompt's samples are split only where `rows` is no multiple of them)."""
    if rows < 1:
        raise ValueError(f"length-sorted groups need rows >= 1, got {rows}")
    lengths = attended_lengths(attention_mask)
    groups = prompt_groups(input_ids, attention_mask, split)
    groups.sort(key=lambda g: -max(lengths[i] for i in g))
    order = [i for g in groups for i in g]
    return [order[i : i + rows] for i in range(0, len(order), rows)]


# `*.max_tokens_per_micro` = SORTED (the default): no token budget; the rows sorted by length
# and cut into micro-batches of the fixed number of rows, each trimmed of the padding its
# rows share: never more rows or tokens per pass than fixed micro-batches, fewer padded ones
SORTED = -1


def token_budget_groups(
    attention_mask: torch.Tensor, budget: int, packed: bool = False, rows: int = 0
) -> list[list[int]]:
    """Row indices in groups by a token budget (verl's dynamic batch size): rows sorted by
    how many columns they attend to, longest first; each group as many rows as fit in
    `budget` padded tokens once the rows are right-aligned (`Experience.right_aligned`):
    rows x its longest row; a row longer than the budget alone. `budget` = SORTED: the
    rows in the same order, `rows` to a group (as packed sequences too).

    `packed` (`model.packing`): a group's sequences are laid end to end in rows as wide
    as its longest (`packed_rows`), so a group costs its packed rows x its longest row;
    each sequence joins the first group it fits in (a shorter one fills a gap an earlier
    group left), else starts one."""
    if packed and budget != SORTED:
        return _packed_groups(attended_lengths(attention_mask), budget)
    attended = attention_mask.bool()
    cols = torch.arange(attended.shape[1], device=attended.device)
    first = torch.where(attended, cols, attended.shape[1]).amin(dim=1)
    last = torch.where(attended, cols, -1).amax(dim=1)
    span = (last + 1 - first).clamp(min=0).tolist()
    order = sorted(range(len(span)), key=lambda i: -span[i])
    if budget == SORTED:
        if rows < 1:
            raise ValueError(f"length-sorted groups need rows >= 1, got {rows}")
        return [order[i : i + rows] for i in range(0, len(order), rows)]
    groups: list[list[int]] = []
    for i in order:  # longest first: a group's first row is its longest
        if groups and (len(groups[-1]) + 1) * span[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _packed_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """`token_budget_groups` with packed rows: first fit over the groups, and inside a
    group first fit over its rows, which is `packed_rows` on the group's sequences (they
    arrive longest first), so the rows a pass packs are the rows counted here."""
    groups: list[list[int]] = []
    loads: list[list[int]] = []  # each group's rows, in tokens
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        for group, rows in zip(groups, loads, strict=True):
            width = lengths[group[0]]  # the group's longest sequence
            row = next((r for r, load in enumerate(rows) if load + n <= width), None)
            if row is not None:
                rows[row] += n
            elif (len(rows) + 1) * width <= budget:
                rows.append(n)
            else:
                continue
            group.append(i)
            break
        else:
            groups.append([i])
            loads.append([n])
    return groups
