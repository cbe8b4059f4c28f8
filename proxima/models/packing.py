"""Packed rows (`model.packing`): the sequences of a padded batch laid end to end, with no
padding between them, each sequence's positions starting again at 0.

A padded batch [B, L] computes B x L positions, and with long-tailed lengths most of them
are padding. `pack` lays the tokens each row attends to into rows as wide as the longest
sequence (`types.packed_rows`: first fit, longest first), so the shorter sequences fill
the room the longest leaves: fewer rows of the same width, never more positions than the
padded batch (its rows right-aligned and trimmed), and no attention score more per row.

What keeps each sequence to itself is the model: Hugging Face models that build their
masks with `transformers.masking_utils` read the packing from the position ids when they
get no attention mask (a position that does not follow the one before starts a new
sequence: `find_packed_sequence_indices`) and build the mask their attention
implementation needs: a block-diagonal causal mask for SDPA and eager, the sequences'
boundaries for flash-attention's varlen kernels, a BlockMask for FlexAttention; a
sliding-window layer keeps its window inside each sequence too. transformers'
`DataCollatorWithFlattening` and the padding-free training of verl and OpenRLHF use the
same layout. A model whose forward does not read packing from the position ids would let a
sequence attend to the ones before it in its row: `models.forward.packing_problem` tries
each model once before a run starts.

The room left at the end of a row holds one more sequence of filler (the row's first
token, positions from 0): it comes after every real token, so no real token attends to it,
and no output of it is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from proxima.models.loading import scalar_head
from proxima.models.unwrap import base_model
from proxima.types import attended_lengths, packed_rows, prompt_groups


@dataclass(frozen=True)
class PackedRows:
    """The attended tokens of a padded batch [B, L], packed into K rows of width W."""

    input_ids: torch.Tensor  # [K, W]
    position_ids: torch.Tensor  # [K, W] from 0 at each sequence's first token
    # [B, L] long: the flat place (row x W + column) of each attended token, -1 elsewhere
    # (the tokens of a shared prompt: the same places in every row that holds it)
    where: torch.Tensor
    # [K, 1, W, W] who attends to whom (`pack_shared`: each response to its prompt and to
    # itself), in the form the attention implementation adds or selects by; None: the
    # model builds the mask from the position ids
    attention_mask: torch.Tensor | None = None

    def inputs(self) -> dict[str, torch.Tensor | bool]:
        """The forward's arguments: the 4D mask of shared prompts, else no attention mask
        (the model reads the packing from the position ids), and no KV cache (with one,
        transformers reads no packing)."""
        out = {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask
        return out

    def take(self, x: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
        """[K, W, ...] per-position outputs -> [N, ...] at the flat `places` [N]."""
        return x.flatten(0, 1)[places]

    def predicting(self, keep: torch.Tensor) -> torch.Tensor:
        """[N] flat places of the positions that predict the kept response tokens: response
        token t (column L - R + t of the padded batch) is predicted at the position before
        it. keep: [B, R] bool; the order is `keep.nonzero()`'s (`models.forward.unpack`)."""
        r = keep.shape[1]
        before = self.where[:, -r - 1 : -1][keep]
        if bool((before < 0).any()):
            raise ValueError(
                "a kept response token follows a position the attention mask leaves out: "
                "packed rows hold only the attended tokens, so nothing predicts it there; "
                "every kept token's preceding position must be attended"
            )
        return before

    def last_tokens(self) -> torch.Tensor:
        """[B] flat places of each row's last attended token."""
        attended = self.where >= 0
        cols = torch.arange(self.where.shape[1], device=self.where.device)
        last = torch.where(attended, cols, -1).amax(dim=1).clamp(min=0)
        return self.where.gather(1, last.unsqueeze(1)).squeeze(1)


def one_row_attention(config) -> bool:
    """Whether a model's attention implementation (`config._attn_implementation`) takes
    packed sequences in one row only: transformers' flash-attention path reads sequence
    boundaries from the position ids only in a batch of one row, where SDPA, eager and
    FlexAttention mask every row of a batch."""
    return "flash" in str(getattr(config, "_attn_implementation", "") or "")


def pack(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, one_row: bool = False
) -> PackedRows:
    """The tokens each row of `input_ids` [B, L] attends to (`attention_mask` [B, L]), in
    order, packed into rows as wide as the longest of them (`types.packed_rows`), or
    with `one_row` all in one row (flash-attention's varlen path in transformers reads
    packed position ids only in a batch of one row, `one_row_attention`)."""
    attended = attention_mask.bool()
    lengths = attended_lengths(attention_mask)
    width = max(1, sum(lengths) if one_row else max(lengths, default=1))
    rows = packed_rows(lengths, width)
    device = input_ids.device
    # each sequence's start in the flat [K x W] layout, in the order rows are filled
    starts = torch.zeros(len(lengths), dtype=torch.long)
    for k, row in enumerate(rows):
        offset = k * width
        for i in row:
            starts[i] = offset
            offset += lengths[i]
    positions = attended.long().cumsum(dim=1) - 1  # each sequence's own positions
    where = torch.where(attended, starts.to(device).unsqueeze(1) + positions, -1)
    flat_ids = input_ids.new_empty(len(rows) * width)
    flat_pos = torch.empty(len(rows) * width, dtype=torch.long, device=device)
    filler = torch.ones(len(rows) * width, dtype=torch.bool, device=device)
    flat_ids[where[attended]] = input_ids[attended]
    flat_pos[where[attended]] = positions[attended]
    filler[where[attended]] = False
    ids, pos, filler = (t.view(len(rows), width) for t in (flat_ids, flat_pos, filler))
    # the end of a row: its first token again, positions from 0 (a sequence of its own)
    ids = torch.where(filler, ids[:, :1], ids)
    pos = torch.where(filler, filler.long().cumsum(dim=1) - 1, pos)
    return PackedRows(input_ids=ids, position_ids=pos, where=where)


def shared_mask_form(config, dtype: torch.dtype) -> torch.dtype | None:
    """The 4D attention mask `pack_shared` gives a model: bool (True: attends) for SDPA,
    float (0 or the minimum of `dtype`, the model's, added to the scores) for eager;
    None where a custom mask cannot carry shared prompts: flash-attention and
    FlexAttention read no 4D mask, and a sliding-window layer would get the full layers'
    mask (its window lost)."""
    impl = str(getattr(config, "_attn_implementation", None) or "eager")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "layer_types", None) or []
    sliding = any("sliding" in str(t) or "chunked" in str(t) for t in layers)
    if sliding or (not layers and getattr(text, "sliding_window", None)):
        return None
    if impl == "sdpa":
        return torch.bool
    if impl == "eager":
        return dtype
    return None


def pack_shared(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, split: int, form: torch.dtype
) -> PackedRows | None:
    """The batch [B, L] packed with each prompt once for all its samples: rows with the same
    first `split` columns (`prompt_groups`) lay their attended tokens there once, then
    each row's own tokens after column `split`, one after another:
    [prompt | response 1 | response 2 | ...], a group as one sequence in `types.packed_rows`.
    Positions are each row's own (its response after its prompt); the 4D mask lets a token
    see the earlier tokens of its prompt and of its own response, nothing else. A prompt's
    keys and values are then computed once, and every response reads the same ones (and,
    training, sends its gradient back into them). None when no two rows share a prompt.
    `form`: the mask's dtype (`shared_mask_form`)."""
    groups = prompt_groups(input_ids, attention_mask, split)
    if len(groups) == input_ids.shape[0]:
        return None
    attended = attention_mask.bool()
    device = input_ids.device
    head = attended[:, :split].sum(dim=1).tolist()  # each row's tokens before `split`
    tail = attended[:, split:].sum(dim=1).tolist()
    sizes = [head[g[0]] + sum(tail[r] for r in g) for g in groups]
    width = max(1, max(sizes))
    places = packed_rows(sizes, width)
    n_rows = len(places)
    positions = attended.long().cumsum(dim=1) - 1
    where = torch.full_like(positions, -1)
    # per place: its segment (a group, or the filler of a row's end) and its branch (0: the
    # prompt, i + 1: the group's i-th response)
    segment = torch.full((n_rows * width,), -1, dtype=torch.long)
    branch = torch.zeros(n_rows * width, dtype=torch.long)
    for k, row in enumerate(places):
        offset = k * width
        for gi in row:
            group = groups[gi]
            c = head[group[0]]
            segment[offset : offset + sizes[gi]] = gi
            first = group[0]
            cols = attended[first, :split].nonzero()[:, 0]
            for r in group:  # the prompt: the same places for every row of the group
                where[r, cols] = offset + torch.arange(c, device=device)
            at = offset + c
            for i, r in enumerate(group):
                cols = split + attended[r, split:].nonzero()[:, 0]
                where[r, cols] = at + torch.arange(tail[r], device=device)
                branch[at : at + tail[r]] = i + 1
                at += tail[r]
            offset += sizes[gi]
    flat_ids = input_ids.new_zeros(n_rows * width)
    flat_pos = torch.zeros(n_rows * width, dtype=torch.long, device=device)
    flat_ids[where[attended]] = input_ids[attended]
    flat_pos[where[attended]] = positions[attended]
    filler = (segment < 0).view(n_rows, width)
    ids, pos = flat_ids.view(n_rows, width), flat_pos.view(n_rows, width)
    ids = torch.where(filler, ids[:, :1], ids)  # the end of a row: positions from 0
    pos = torch.where(filler, filler.long().cumsum(dim=1) - 1, pos)
    seg = torch.where(filler, -1, segment.view(n_rows, width).to(device))
    br = branch.view(n_rows, width).to(device)
    same = seg[:, :, None] == seg[:, None, :]
    sees = (br[:, None, :] == 0) | (br[:, None, :] == br[:, :, None])
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    allowed = (same & sees & causal)[:, None]  # [K, 1, W (query), W (key)]
    if form != torch.bool:
        allowed = torch.zeros(allowed.shape, dtype=form, device=device).masked_fill(
            ~allowed, torch.finfo(form).min
        )
    return PackedRows(input_ids=ids, position_ids=pos, where=where, attention_mask=allowed)


def rows_cost(rows: PackedRows, config) -> float:
    """A pass's multiply-adds through packed `rows`, up to a constant: the layers' linear
    maps per position (hidden x (4 hidden + 3 intermediate)) and the attention scores and
    their weighted sum per row (4 hidden x W x W, every pair computed, the mask applied
    after)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", 64)
    inner = getattr(text, "intermediate_size", None) or 4 * hidden
    k, w = rows.input_ids.shape
    return k * w * hidden * (4 * hidden + 3 * inner) + k * w * w * 4 * hidden


# The probe's sequences, as (prompt, response) lengths: packed by rows of 8, [A] and [B C]
# (C sees B before it in its row, as any sequence after the first does); their token ids
# are spread over the vocabulary (`_probe_ids`).
PROBE = ((5, 3), (3, 2), (2, 1))
TOLERANCE = 0.1  # of what a sequence that saw the one before it would change


def _probe_ids(lengths: list[int], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, L] right-padded sequences of these lengths (distinct ids modulo `vocab`) and
    their attention mask."""
    width, start = max(lengths), 0
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = (torch.arange(start, start + n) * 7 + 3) % vocab
        mask[i, :n] = 1
        start += n
    return ids.to(device), mask.to(device)


def _final_hidden(model: nn.Module, scores: bool, **inputs) -> torch.Tensor:
    """The backbone's last hidden states [rows, L, H] through the call a pass makes: the
    reward model's backbone (`reward_model_scores`), or the whole model with the input of
    its head recorded (the LM head; a critic's value head)."""
    if scores:
        return model.base_model(**inputs).last_hidden_state
    inner = base_model(model)
    head = inner.get_output_embeddings()
    head = scalar_head(inner) if head is None else head
    seen: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        model(**inputs)
    finally:
        handle.remove()
    return seen[-1]


def _moved(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest distance (L2) between two [N, H] tokens' hidden states."""
    return float((a - b).float().norm(dim=-1).max())


def shares_prompts(model: nn.Module) -> bool:
    """Whether packed passes may lay a prompt once for its samples in `model`
    (`pack_shared`): its attention takes the 4D mask that needs (`shared_mask_form`) and,
    once `packing_problem` tried it, kept the samples apart through it."""
    inner = base_model(model)
    dtype = next(inner.parameters()).dtype
    ok = shared_mask_form(inner.config, dtype) is not None
    return ok and getattr(inner, "_proxima_shared_prompts", True)


def _keeps_shared(model: nn.Module, scores: bool, form: torch.dtype) -> bool:
    """The probe of `pack_shared`: a prompt of 3 tokens and two samples of 2 and 3 tokens
    through one shared row give the padded batch's last hidden states, each token closer to
    its own than TOLERANCE x what the second sample changes when it sees the first."""
    inner = base_model(model)
    vocab = getattr(inner.config, "vocab_size", None) or inner.config.get_text_config().vocab_size
    device = next(inner.parameters()).device
    ids, mask = _probe_ids([5, 6], vocab, device)
    ids[1, :3] = ids[0, :3]  # the same prompt, then each sample its own tokens
    ids = torch.cat([ids.new_zeros((2, 1)), ids], dim=1)  # a column of left padding
    mask = torch.cat([mask.new_zeros((2, 1)), mask], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    padded = _final_hidden(
        model, scores, input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
    )
    rows = pack_shared(ids, mask, 4, form)
    got = rows.take(_final_hidden(model, scores, **rows.inputs()), rows.where[mask.bool()])
    joined = torch.cat([ids[0, 1:6], ids[1, 4:7]]).unsqueeze(0)  # the second sees the first
    seen = _final_hidden(model, scores, input_ids=joined, use_cache=False)[0, 5:]
    leak = _moved(seen, padded[1, 4:7])
    return _moved(got, padded[mask.bool()]) <= TOLERANCE * leak


@torch.no_grad()
def packing_problem(model: nn.Module, scores: bool = False) -> str | None:
    """Why `model` cannot take packed rows, or None when it can: its last hidden states of
    the `PROBE` sequences through packed rows must be those of the padded batch, each token
    closer to its own than TOLERANCE x what a sequence changes when it sees the one before
    it, with its positions running on or from 0 (a model that reads no packing from the
    position ids lets it see it). `scores`: the model is a
    reward model, called as `models.forward.reward_model_scores` calls it."""
    inner = base_model(model)
    config = inner.config
    vocab = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size
    device = next(inner.parameters()).device
    lengths = [p + r for p, r in PROBE]
    ids, mask = _probe_ids(lengths, vocab, device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    padded = _final_hidden(
        model, scores, input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
    )
    rows = pack(ids, mask, one_row_attention(config))
    got = rows.take(_final_hidden(model, scores, **rows.inputs()), rows.where[mask.bool()])
    want = padded[mask.bool()]
    # what C's tokens become when they see B's: as one sequence (positions running on), and
    # with their own positions from 0 (a mask that lets C see B)
    b, c = lengths[1], lengths[2]
    joined = torch.cat([ids[1, :b], ids[2, :c]]).unsqueeze(0)
    restarted = torch.cat([torch.arange(b), torch.arange(c)]).unsqueeze(0).to(device)
    leak = min(
        _moved(_final_hidden(model, scores, **call)[0, b:], padded[2, :c])
        for call in (
            {"input_ids": joined, "use_cache": False},
            {
                "input_ids": joined,
                "attention_mask": torch.ones_like(joined),
                "position_ids": restarted,
                "use_cache": False,
            },
        )
    )
    off = _moved(got, want)
    if off <= TOLERANCE * leak or off == 0.0:
        dtype = next(inner.parameters()).dtype
        form = shared_mask_form(config, dtype)
        inner._proxima_shared_prompts = form is not None and _keeps_shared(model, scores, form)
        return None
    impl = getattr(config, "_attn_implementation", None)
    return (
        f"{type(inner).__name__} (attention: {impl}) does not keep packed sequences apart: "
        f"through packed rows a token's last hidden state moves by up to {off:.3g} from the "
        f"padded batch's, where a sequence that sees the one before it moves by {leak:.3g}; its "
        "forward must build its attention mask from the position ids when it gets none "
        "(transformers' masking_utils)"
    )
