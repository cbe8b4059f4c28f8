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


class _Floor:
    """The models, optimizers and the three phases of one PPO iteration, eager. With
    `shared`, one network: a value head on the actor's final hidden state, one forward,
    backward and step per mini-batch for policy loss + VF_COEF x value loss."""

    def __init__(self, spec: dict, w: Workload, a: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        torch.manual_seed(SEED)
        self.w, self.shared, dev = w, spec["shared"], torch.device(spec["device"])
        self.dev, self.p_len, self.r_len = dev, PROMPT_LEN, w.response
        bf16 = spec["bf16"]
        self.amp = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if bf16 else nullcontext
        f32 = {"dtype": torch.float32}
        self.actor = AutoModelForCausalLM.from_pretrained(a["actor"], **f32).to(dev)
        self.ref = AutoModelForCausalLM.from_pretrained(a["actor"], **f32).to(dev).eval()
        self.rm = AutoModelForSequenceClassification.from_pretrained(a["reward"], **f32)
        self.rm.to(dev).eval()
        for m in (self.ref, self.rm):
            m.requires_grad_(False)
        if self.shared:
            self.head = torch.nn.Linear(self.actor.config.hidden_size, 1, device=dev)
            params = [*self.actor.parameters(), *self.head.parameters()]
            self.opt_a = torch.optim.AdamW(params, lr=LR)
        else:
            critic = AutoModelForSequenceClassification.from_pretrained(a["reward"], **f32)
            self.critic = critic.to(dev)
            self.opt_a = torch.optim.AdamW(self.actor.parameters(), lr=LR)
            self.opt_c = torch.optim.AdamW(self.critic.parameters(), lr=LR)

    def logprobs(self, model, seq):
        import torch

        logits = model(input_ids=seq, logits_to_keep=self.r_len + 1).logits[:, :-1].float()
        lp = torch.log_softmax(logits / TEMPERATURE, -1)
        return lp.gather(-1, seq[:, self.p_len :, None])[..., 0]

    def values(self, model, seq):
        hidden = getattr(model, model.base_model_prefix)(input_ids=seq).last_hidden_state
        return model.score(hidden[:, self.p_len - 1 : -1]).float()[..., 0]

    def generate(self, prompts):
        """One KV-cached `generate`; the old log-probs from its own scores (after temperature
        and token suppression) and, shared, the values of the states the tokens were sampled
        from (the last layer's)."""
        import torch

        self.actor.eval()
        n = len(prompts)
        with torch.no_grad(), self.amp():
            out = self.actor.generate(
                input_ids=prompts,
                attention_mask=torch.ones(n, self.p_len, dtype=torch.long, device=self.dev),
                max_new_tokens=self.r_len,
                do_sample=True,
                temperature=TEMPERATURE,
                top_k=0,
                top_p=1.0,
                use_cache=True,
                return_dict_in_generate=True,
                output_scores=True,
                output_hidden_states=self.shared,
            )
        seq = out.sequences
        scores = torch.stack(out.scores, 1).float()
        old_lp = torch.log_softmax(scores, -1).gather(-1, seq[:, self.p_len :, None])[..., 0]
        old_v = None
        if self.shared:
            with torch.no_grad():
                last = torch.cat([step[-1][:, -1:] for step in out.hidden_states], 1)
                old_v = self.head(last.float())[..., 0]
        return seq, old_lp, old_v

    def score(self, seq, old_lp, old_v):
        """Reference, critic (unless shared) and reward forwards, KL-penalised rewards and
        GAE (gamma 1, lambda 0.95): the values, whitened advantages and returns."""
        import torch

        with torch.no_grad(), self.amp():
            ref_lp = self.logprobs(self.ref, seq)
            if not self.shared:
                old_v = self.values(self.critic, seq)
            score = self.rm(input_ids=seq).logits[:, 0].float()
        rewards = -KL_COEF * (old_lp - ref_lp)
        rewards[:, -1] += score
        n = len(seq)
        adv, last = torch.zeros_like(rewards), torch.zeros(n, device=self.dev)
        for t in reversed(range(self.r_len)):
            nxt = old_v[:, t + 1] if t + 1 < self.r_len else torch.zeros(n, device=self.dev)
            last = rewards[:, t] + nxt - old_v[:, t] + 0.95 * last
            adv[:, t] = last
        returns = adv + old_v
        return old_v, (adv - adv.mean()) / (adv.std() + 1e-8), returns

    def update(self, epochs: int, seq, old_lp, old_v, adv, returns) -> None:
        """`epochs` passes over shuffled mini-batches: clipped policy and value losses."""
        import torch

        self.actor.train()
        n, mb = len(seq), self.w.mini_batch
        for _ in range(epochs):
            order = torch.randperm(n).to(self.dev)
            for s in range(0, n, mb):
                i = order[s : s + mb]
                with self.amp():
                    if self.shared:
                        o = self.actor(
                            input_ids=seq[i],
                            logits_to_keep=self.r_len + 1,
                            output_hidden_states=True,
                        )
                        logits = o.logits[:, :-1].float() / TEMPERATURE
                        lp = torch.log_softmax(logits, -1)
                        lp = lp.gather(-1, seq[i, self.p_len :, None])[..., 0]
                    else:
                        lp = self.logprobs(self.actor, seq[i])
                    ratio = torch.exp(lp - old_lp[i])
                    pg = torch.max(-adv[i] * ratio, -adv[i] * ratio.clamp(0.8, 1.2)).mean()
                    if self.shared:
                        v = self.head(o.hidden_states[-1][:, self.p_len - 1 : -1]).float()[..., 0]
                        vf = self._value_loss(v, old_v[i], returns[i])
                if self.shared:
                    (pg + VF_COEF * vf).backward()
                    self._step(self.opt_a)
                    continue
                pg.backward()
                self._step(self.opt_a)
                with self.amp():
                    vf = self._value_loss(self.values(self.critic, seq[i]), old_v[i], returns[i])
                vf.backward()
                self._step(self.opt_c)

    @staticmethod
    def _value_loss(v, old_v, returns):
        import torch

        vc = old_v + (v - old_v).clamp(-0.2, 0.2)
        return 0.5 * torch.max((v - returns) ** 2, (vc - returns) ** 2).mean()

    @staticmethod
    def _step(opt) -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)


def floor_cell(spec: dict, w: Workload, a: dict, iterations: int, workdir: Path) -> list[dict]:
    """The eager compute the PPO math needs, in plain torch + transformers (no framework)."""
    import torch

    floor = _Floor(spec, w, a)
    prompts = torch.tensor(load_prompt_ids(spec["prompt_file"]), device=floor.dev)
    eos = floor.actor.generation_config.eos_token_id
    records = []
    for _ in range(iterations):
        rows = torch.randperm(len(prompts))[: w.prompts].to(floor.dev)
        sync(spec["device"])
        t0 = time.perf_counter()
        seq, old_lp, old_v = floor.generate(prompts[rows])
        sync(spec["device"])
        t1 = time.perf_counter()
        old_v, adv, returns = floor.score(seq, old_lp, old_v)
        sync(spec["device"])
        t2 = time.perf_counter()
        floor.update(spec["epochs"], seq, old_lp, old_v, adv, returns)
        sync(spec["device"])
        t3 = time.perf_counter()
        steps = spec["epochs"] * MINI_BATCHES
        records.append(
            {
                "seconds": t3 - t0,
                "phases": {"gen": t1 - t0, "score": t2 - t1, "train": t3 - t2},
                "tokens": tokens_before_eos(seq[:, PROMPT_LEN:], eos),
                "steps": {"actor": steps, "critic": 0 if floor.shared else steps},
            }
        )
    return records
