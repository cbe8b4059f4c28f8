"""The floor's cell: the PPO math in plain torch + transformers, no framework."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

from benchmarks.common.assets import load_prompt_ids
from benchmarks.common.timing import sync
from benchmarks.common.workloads import (
    KL_COEF,
    LR,
    MINI_BATCHES,
    PROMPT_LEN,
    SEED,
    TEMPERATURE,
    VF_COEF,
    Workload,
)
from benchmarks.systems.lengths import tokens_before_eos


def floor_cell(spec: dict, w: Workload, a: dict, iterations: int, workdir: Path) -> list[dict]:
    """The eager compute the PPO math needs, in plain torch + transformers (no framework)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(SEED)
    bf16, shared, dev = spec["bf16"], spec["shared"], torch.device(spec["device"])
    amp = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if bf16 else nullcontext
    actor = AutoModelForCausalLM.from_pretrained(a["actor"], dtype=torch.float32).to(dev)
    ref = AutoModelForCausalLM.from_pretrained(a["actor"], dtype=torch.float32).to(dev).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(a["reward"], dtype=torch.float32)
    rm.to(dev).eval()
    for m in (ref, rm):
        m.requires_grad_(False)
    if shared:  # one network: a value head on the actor's final hidden state
        head = torch.nn.Linear(actor.config.hidden_size, 1, device=dev)
        opt_a = torch.optim.AdamW([*actor.parameters(), *head.parameters()], lr=LR)
    else:
        critic = AutoModelForSequenceClassification.from_pretrained(
            a["reward"], dtype=torch.float32
        ).to(dev)
        opt_a = torch.optim.AdamW(actor.parameters(), lr=LR)
        opt_c = torch.optim.AdamW(critic.parameters(), lr=LR)
    prompts = torch.tensor(load_prompt_ids(spec["prompt_file"]), device=dev)
    p_len, r_len, mb = PROMPT_LEN, w.response, w.mini_batch
    eos = actor.generation_config.eos_token_id

    def logprobs(model, seq):
        logits = model(input_ids=seq, logits_to_keep=r_len + 1).logits[:, :-1].float()
        return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, seq[:, p_len:, None])[..., 0]

    def values(model, seq):
        hidden = getattr(model, model.base_model_prefix)(input_ids=seq).last_hidden_state
        return model.score(hidden[:, p_len - 1 : -1]).float()[..., 0]

    def whiten(x):
        return (x - x.mean()) / (x.std() + 1e-8)

    records = []
    for _ in range(iterations):
        rows = torch.randperm(len(prompts))[: w.prompts].to(dev)
        sync(spec["device"])
        t0 = time.perf_counter()
        actor.eval()
        with torch.no_grad(), amp():
            out = actor.generate(
                input_ids=prompts[rows],
                attention_mask=torch.ones(w.prompts, p_len, dtype=torch.long, device=dev),
                max_new_tokens=r_len,
                do_sample=True,
                temperature=TEMPERATURE,
                top_k=0,
                top_p=1.0,
                use_cache=True,
                return_dict_in_generate=True,
                output_scores=True,
                output_hidden_states=shared,
            )
        seq = out.sequences
        response = seq[:, p_len:]
        # the sampling distribution's own log-probs (after temperature and token suppression)
        scores = torch.stack(out.scores, 1).float()
        old_lp = torch.log_softmax(scores, -1).gather(-1, response[..., None])[..., 0]
        if shared:  # values of the states the tokens were sampled from: the last layer's
            with torch.no_grad():
                last = torch.cat([step[-1][:, -1:] for step in out.hidden_states], 1)
                old_v = head(last.float())[..., 0]
        sync(spec["device"])
        t1 = time.perf_counter()
        with torch.no_grad(), amp():
            ref_lp = logprobs(ref, seq)
            if not shared:
                old_v = values(critic, seq)
            score = rm(input_ids=seq).logits[:, 0].float()
        rewards = -KL_COEF * (old_lp - ref_lp)
        rewards[:, -1] += score
        adv, last = torch.zeros_like(rewards), torch.zeros(w.prompts, device=dev)
        for t in reversed(range(r_len)):  # GAE, gamma 1, lambda 0.95
            nxt = old_v[:, t + 1] if t + 1 < r_len else torch.zeros(w.prompts, device=dev)
            last = rewards[:, t] + nxt - old_v[:, t] + 0.95 * last
            adv[:, t] = last
        returns, adv = adv + old_v, whiten(adv)
        sync(spec["device"])
        t2 = time.perf_counter()
        actor.train()
        for _ in range(spec["epochs"]):
            order = torch.randperm(w.prompts).to(dev)
            for s in range(0, w.prompts, mb):
                i = order[s : s + mb]
                if shared:  # one forward / backward / step for both losses
                    with amp():
                        o = actor(
                            input_ids=seq[i], logits_to_keep=r_len + 1, output_hidden_states=True
                        )
                        logits = o.logits[:, :-1].float() / TEMPERATURE
                        lp = torch.log_softmax(logits, -1).gather(-1, seq[i, p_len:, None])[..., 0]
                        ratio = torch.exp(lp - old_lp[i])
                        pg = torch.max(-adv[i] * ratio, -adv[i] * ratio.clamp(0.8, 1.2)).mean()
                        v = head(o.hidden_states[-1][:, p_len - 1 : -1]).float()[..., 0]
                        vc = old_v[i] + (v - old_v[i]).clamp(-0.2, 0.2)
                        vf = 0.5 * torch.max((v - returns[i]) ** 2, (vc - returns[i]) ** 2).mean()
                    (pg + VF_COEF * vf).backward()
                    opt_a.step()
                    opt_a.zero_grad(set_to_none=True)
                    continue
                with amp():
                    ratio = torch.exp(logprobs(actor, seq[i]) - old_lp[i])
                    pg = torch.max(-adv[i] * ratio, -adv[i] * ratio.clamp(0.8, 1.2)).mean()
                pg.backward()
                opt_a.step()
                opt_a.zero_grad(set_to_none=True)
                with amp():
                    v = values(critic, seq[i])
                    vc = old_v[i] + (v - old_v[i]).clamp(-0.2, 0.2)
                    vf = 0.5 * torch.max((v - returns[i]) ** 2, (vc - returns[i]) ** 2).mean()
                vf.backward()
                opt_c.step()
                opt_c.zero_grad(set_to_none=True)
        sync(spec["device"])
        t3 = time.perf_counter()
        steps = spec["epochs"] * MINI_BATCHES
        records.append(
            {
                "seconds": t3 - t0,
                "phases": {"gen": t1 - t0, "score": t2 - t1, "train": t3 - t2},
                "tokens": tokens_before_eos(response, eos),
                "steps": {"actor": steps, "critic": 0 if shared else steps},
            }
        )
    return records
