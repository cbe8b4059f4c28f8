"""`proxima pipeline`: RLHF from preferences, end to end, judged by a gold scorer.

InstructGPT's and DeepSpeed-Chat's three steps in one run folder, with a gold scorer in the
place of the human labeller (Gao et al. 2022, "Scaling Laws for Reward Model
Overoptimization", arXiv:2210.10760), so that what PPO does to the preferences' intent can
be measured, not only what it does to the proxy:

1. `task`: the built-in task `pipeline.task` writes its prompts (and demonstrations and
   tiny model, or names its chat model) and names its gold (skipped when `pipeline.prompts`
   names yours);
2. `sft`: supervised fine-tuning on `pipeline.sft_data` (skipped without demonstrations);
3. `pairs`: `pipeline.pairs` response pairs per prompt sampled from the SFT policy, labelled
   by Bradley-Terry samples of the gold scores (`algos.sample_preferences`);
4. `rm`: `proxima rm` on those pairs, its normalisation fitted on the SFT policy's samples;
5. `ppo`: `proxima train` against the reward model (critic from it, `pipeline.critic_from_rm`),
   the gold logged beside it as a reward source of weight 0 (`reward/gold`);
6. `dpo` (with `pipeline.dpo`): `proxima dpo` on the same pairs, started from the SFT
   policy: the policy trained on the preferences directly, without the reward model;
7. `evaluate`: the SFT policy and `pipeline.eval_points` PPO checkpoints on the held-out
   prompts: gold score, proxy score and KL to the SFT policy; the best checkpoint within
   `pipeline.kl_budget`; the DPO policy beside them; summary.json, pipeline_eval.jsonl and
   the figure.

pipeline.json records the stages finished; `trainer.resume_from=RUN` goes on in RUN after
them, with RUN's config (`Pipeline.resume`).
"""

from __future__ import annotations

import itertools
import json
import shutil
import string
import time
from pathlib import Path

import torch

from proxima import launch
from proxima.algos import sample_preferences
from proxima.checkpoint import checkpoint_iteration, list_checkpoints
from proxima.config import Config, ConfigError, validate
from proxima.config.roles import role_plan
from proxima.data import load_records
from proxima.data.preferences import ENDED_SUFFIX, PreferenceDataset
from proxima.data.prompts import render_prompt
from proxima.launch import Interrupted
from proxima.logging import plot_overoptimization, progress, read_metrics, write_atomic
from proxima.models import (
    init_model,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    reward_model_scores,
    score_normalization,
)
from proxima.recipes.common import new_run_dir, process_setup, save_model
from proxima.recipes.dpo import dpo as train_dpo
from proxima.recipes.ppo import PPORecipe
from proxima.recipes.rm import reward_model
from proxima.rewards import FunctionReward, ModelReward, load_reward_function
from proxima.rollout.collect import generate_rollout, score_rollout
from proxima.tasks import preference_task
from proxima.trainer.checks import check_enough, check_lengths, with_key
from proxima.trainer.datasets import load_prompts, load_sft
from proxima.trainer.evaluate import scores_and_kl
from proxima.trainer.rm import all_pair_scores
from proxima.trainer.sft import sft_train

STAGES = ("task", "sft", "pairs", "rm", "ppo", "dpo", "evaluate")
STATUS = "pipeline.json"  # the stages finished, and what `Pipeline.resume` needs
GOLD, PROXY = "gold", "rm"  # the reward sources' names in the PPO run (reward/gold, reward/rm)


def pipeline(cfg: Config) -> dict:
    """Run the whole chain into one new run folder; returns the summary (summary.json)."""
    _, world, _ = launch.world()
    if world > 1:
        raise ConfigError(
            "`proxima pipeline` runs in one process. To train its PPO stage on several, run "
            "the stages as commands: `proxima sft`, `proxima rm`, then `torchrun ... proxima "
            "train reward.model_path=...` (docs/preferences.md)."
        )
    run = Pipeline(cfg)
    return run.run()


class Pipeline:
    """The stages, each writing into its own sub-folder of one run folder; what a stage wrote
    stays there when a later one fails or is interrupted (`pipeline.json` says how far it
    got)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.device = process_setup(cfg)
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.result: dict = {}

    def run(self) -> dict:
        self.check_inputs()
        done: list[str] = []
        if self.cfg.trainer.resume_from:
            self.run_dir = Path(self.cfg.trainer.resume_from)
            done = self.resume()
            print(f"run folder: {self.run_dir} (resumed after its `{done[-1]}` stage)")
        else:
            self.run_dir = new_run_dir(self.cfg.trainer.output_dir)
            print(f"run folder: {self.run_dir}")
        steps = (self.prepare, self.sft, self.pairs, self.rm, self.ppo, self.dpo, self.evaluate)
        stages = [
            (name, step)
            for name, step in zip(STAGES, steps, strict=True)
            if name != "dpo" or self.cfg.pipeline.dpo
        ]
        for i, (name, step) in enumerate(stages, start=1):
            if name in done:
                seconds = self.seconds[name]
                print(f"\n[pipeline {i}/{len(stages)}] {name}: done earlier ({seconds:.0f} s)")
                continue
            print(f"\n[pipeline {i}/{len(stages)}] {name}")
            began = time.perf_counter()
            try:
                step()
            except BaseException:
                if i == 1 and not done:  # a failed start leaves no folder behind
                    shutil.rmtree(self.run_dir, ignore_errors=True)
                    print(f"removed {self.run_dir}: the pipeline's inputs did not check out")
                    raise
                self._write_status(failed=name)
                print(
                    f"the pipeline stopped in its `{name}` stage; what the earlier stages "
                    f"wrote is in {self.run_dir} ({STATUS}); go on from there with "
                    f"`proxima pipeline trainer.resume_from={self.run_dir}`"
                )
                raise
            self.seconds[name] = round(time.perf_counter() - began, 2)
            self._write_status()
        return self._finish()

    def check_inputs(self) -> None:
        """Your files, before any folder is made: the gold scorer imports, every file reads
        (the built-in task writes its own)."""
        p = self.cfg.pipeline
        if not p.prompts:
            return
        with_key("pipeline.gold", load_reward_function, p.gold)
        self.records = {}
        for key in ("prompts", "heldout", "sft_data"):
            path = getattr(p, key)
            if path:
                self.records[key] = with_key(f"pipeline.{key}", load_records, path)
        count = len(self.records["prompts"])
        if not p.heldout and p.heldout_size >= count:
            raise ConfigError(
                f"`pipeline.heldout_size`={p.heldout_size} would hold out all {count} prompts "
                "of pipeline.prompts; lower it or set pipeline.heldout to a file of held-out "
                "prompts."
            )
        train = count if p.heldout else count - p.heldout_size
        if train < self.cfg.data.train_batch_size:
            raise ConfigError(
                f"{train} training prompts in pipeline.prompts (after the held-out ones) are "
                f"fewer than `data.train_batch_size`={self.cfg.data.train_batch_size}, the "
                "prompts of one PPO iteration: lower it, or add prompts."
            )

    def _write_status(self, failed: str | None = None) -> None:
        """pipeline.json: the stages finished, their seconds, and what `resume` needs to go
        on after them (the config the task resolved, what the stages measured)."""
        status = {"finished": list(self.seconds), "stage_seconds": self.seconds}
        if failed:
            status["failed"] = failed
        status.update(config=self.cfg.to_dict(), result=self.result)
        write_atomic(self.run_dir / STATUS, json.dumps(status, indent=2, default=str))

    def resume(self) -> list[str]:
        """`trainer.resume_from=RUN`: go on in RUN after the stages its pipeline.json says
        finished (the config is that run's, `saved_pipeline_config`). What a stage that did
        not finish wrote is moved aside (`<stage>.interrupted`), never deleted, and the stage
        runs again. Returns the finished stages."""
        state = read_status(self.run_dir)
        done = [name for name in state["finished"] if name in STAGES]
        if "evaluate" in done:
            raise ValueError(
                f"nothing to do: the pipeline in {self.run_dir} finished every stage (its "
                "summary.json). Start a new run without trainer.resume_from."
            )
        self.seconds = {k: float(v) for k, v in state["stage_seconds"].items() if k in done}
        self.result = dict(state.get("result") or {})
        for name in STAGES:
            partial = self.run_dir / name
            if name not in done and name != "task" and partial.exists():
                aside = _free_name(self.run_dir / f"{name}.interrupted")
                partial.rename(aside)
                print(f"the `{name}` stage did not finish: what it wrote is now in {aside}")
        if "task" in done:
            self.load_inputs()
        return done

    # ------------------------------------------------------------------ 1. task

    def prepare(self) -> None:
        """The built-in task (or the user's files), every input checked before training."""
        cfg = self.cfg
        task = preference_task(cfg.pipeline.task)
        if not cfg.pipeline.prompts:
            cfg, self.result["task"] = task.prepare(cfg, self.run_dir / "task")
        elif not cfg.model.actor_path:
            model = task.default_model() if task.default_model else self._tiny_policy()
            cfg = cfg.replace({"model.actor_path": str(model)})
        self.cfg = cfg
        self.load_inputs(split=True)

    def load_inputs(self, split: bool = False) -> None:
        """The gold, the tokenizer, the prompts (`split`: pipeline.prompts split into the run's
        prompts/ first) and demonstrations of the task's config, checked."""
        cfg = self.cfg
        self.gold = with_key("pipeline.gold", FunctionReward.from_spec, cfg.pipeline.gold)
        self.tok = load_tokenizer(cfg.model.actor_path)
        self.prompt_files = self._prompt_files(split)
        self.prompts, self.heldout = (
            list(with_key(f"pipeline.{key}", load_prompts, cfg, str(path), self.tok))
            for key, path in (
                ("prompts", self.prompt_files["train"]),
                ("heldout", self.prompt_files["heldout"]),
            )
        )
        check_lengths(cfg, self.prompts, self.heldout)
        if cfg.pipeline.sft_data:
            self.demos = with_key(
                "pipeline.sft_data",
                load_sft,
                cfg,
                cfg.pipeline.sft_data,
                self.tok,
                cfg.sft.max_length,
            )
            check_enough(self.demos, 1, "sft.batch_size", "pipeline.sft_data")
        print(
            f"{len(self.prompts)} prompts, {len(self.heldout)} held out; gold scorer "
            f"{cfg.pipeline.gold}; policy {cfg.model.actor_path}"
        )

    def _tiny_policy(self) -> Path:
        """No model.actor_path with your prompts: a tiny model (task.arch, task.size) whose
        character tokenizer covers printable ASCII and every character of the prompts and
        demonstrations, long enough for the longest prompt and response."""
        cfg, texts = self.cfg, []
        keys = [cfg.data.prompt_key, cfg.data.response_key]
        for records in self.records.values():
            texts += [render_prompt(r[k], None) for r in records for k in keys if k in r]
        alphabet = "".join(
            sorted(set(string.printable) - set("\t\r\x0b\x0c") | set("".join(texts)))
        )
        longest = max((len(t) for t in texts), default=0)
        # a demonstration's prompt and response, or a prompt and a sampled response, fit
        need = 2 * longest + cfg.rollout.max_response_length + 8
        folder = init_model(
            self.run_dir / "init",
            arch=cfg.task.arch,
            size=cfg.task.size,
            alphabet=alphabet,
            max_positions=max(64, need),
            seed=cfg.trainer.seed,
        )
        print(
            f"model.actor_path is empty: built a {cfg.task.size} {cfg.task.arch} with a "
            f"character tokenizer of {len(alphabet)} characters at {folder}"
        )
        return folder

    def _prompt_files(self, split: bool) -> dict[str, Path]:
        """The training and held-out prompt files: pipeline.prompts and pipeline.heldout, or
        pipeline.prompts split by seed (`split`: written to prompts/train.jsonl,
        prompts/heldout.jsonl; else written by the run before)."""
        p = self.cfg.pipeline
        if p.heldout:
            return {"train": Path(p.prompts), "heldout": Path(p.heldout)}
        folder = self.run_dir / "prompts"
        if not split:
            return {name: folder / f"{name}.jsonl" for name in ("train", "heldout")}
        records = self.records["prompts"]
        order = torch.randperm(len(records), generator=_generator(self.cfg, 1)).tolist()
        parts = {"heldout": order[: p.heldout_size], "train": sorted(order[p.heldout_size :])}
        folder.mkdir()
        for name, rows in parts.items():
            lines = "".join(json.dumps(records[i], default=str) + "\n" for i in rows)
            (folder / f"{name}.jsonl").write_text(lines)
        return {name: folder / f"{name}.jsonl" for name in ("train", "heldout")}

    # ------------------------------------------------------------------ 2. sft

    @property
    def sft_dir(self) -> Path:
        """The SFT policy: the sft stage's, or without demonstrations the model itself."""
        if not self.cfg.pipeline.sft_data:
            return Path(self.cfg.model.actor_path)
        return self.run_dir / "sft"

    def sft(self) -> None:
        cfg, s = self.cfg, self.cfg.sft
        if not cfg.pipeline.sft_data:
            print(f"no demonstrations (pipeline.sft_data): the pairs come from {self.sft_dir}")
            return
        model = load_causal_lm(cfg.model.actor_path, device=self.device)
        losses = sft_train(
            model,
            self.tok,
            self.demos,
            steps=s.steps,
            lr=s.lr,
            batch_size=min(s.batch_size, len(self.demos)),
            seed=cfg.trainer.seed,
            device=self.device,
        )
        save_model(model, self.tok, self.sft_dir, name="")
        self.result["sft_final_loss"] = losses[-1]
        print(f"sft: {len(losses)} steps, final loss {losses[-1]:.4f}; saved to {self.sft_dir}")

    # ------------------------------------------------------------------ 3. pairs

    def pairs(self) -> None:
        """Sample, score with the gold and label the pairs of the training and held-out
        prompts: pairs/train.jsonl, pairs/heldout.jsonl."""
        cfg = self.cfg
        policy = load_causal_lm(self.sft_dir, device=self.device, trainable=False)
        torch.manual_seed(cfg.trainer.seed)
        folder = self.run_dir / "pairs"
        folder.mkdir()
        sides = {}
        pairings = {"train": cfg.pipeline.pairing, "heldout": "consecutive"}
        for name, items in (("train", self.prompts), ("heldout", self.heldout)):
            sides[name] = self._sample_pairs(policy, items, pairings[name])
        # every response once (in `all` pairing each is in 2 x pairs - 1 pairs)
        scale = float(torch.cat([s["gold"] for s in sides.values()]).std())
        if not scale > 0:
            raise ValueError(
                f"the gold scorer {cfg.pipeline.gold} gave every sampled response the same "
                "score: there is no preference to learn. Check the scorer, or sample more "
                "varied responses (rollout.temperature, rollout.max_response_length)."
            )
        stats = {"gold_scale": scale}
        for i, (name, s) in enumerate(sides.items()):
            rows, st = self._label(s, scale, _generator(cfg, 10 + i))
            (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            stats[name] = st
        self.result["pairs"] = stats
        for name in sides:
            st = stats[name]
            print(
                f"{name}: {st['pairs']} labelled pairs ({st['tied']} tied pairs left out), "
                f"{st['agree_with_gold']:.1%} of labels prefer the higher gold score"
            )
        sizes = {"rm.batch_size": cfg.rm.batch_size}
        if cfg.pipeline.dpo:
            sizes["dpo.batch_size"] = cfg.dpo.batch_size
        for key, size in sizes.items():
            if stats["train"]["pairs"] < size:
                raise ValueError(
                    f"only {stats['train']['pairs']} training pairs have a preference, fewer "
                    f"than {key}={size}: raise pipeline.pairs or add prompts."
                )

    def _sample_pairs(self, policy, items: list, pairing: str) -> dict:
        """2 x pipeline.pairs sampled responses per prompt, paired as `pairing` says
        (consecutive: 1-2, 3-4, ...; all: every two of them), with their gold scores and
        whether each ended (stopped before the token limit)."""
        k = 2 * self.cfg.pipeline.pairs
        per_call = max(1, self.cfg.eval.batch_size // k)
        prompts, responses, gold, ended = [], [], [], []
        for i in progress(range(0, len(items), per_call), desc="sampling pairs"):
            ro = generate_rollout(
                policy, self.tok, items[i : i + per_call], self.cfg.rollout, self.device, n=k
            )
            prompts += ro.prompts
            responses += ro.responses
            gold.append(score_rollout(ro, self.gold))
            ended += ro.gen.stopped.tolist()
        g = torch.cat(gold).double()
        if pairing == "all":
            within = list(itertools.combinations(range(k), 2))
        else:
            within = [(j, j + 1) for j in range(0, k, 2)]
        pairs = [(p + i, p + j) for p in range(0, len(responses), k) for i, j in within]
        a, b = [i for i, _ in pairs], [j for _, j in pairs]
        return {
            "prompts": [prompts[i] for i in a],
            "a": [responses[i] for i in a],
            "b": [responses[j] for j in b],
            "gold_a": g[a],
            "gold_b": g[b],
            "ended_a": [ended[i] for i in a],
            "ended_b": [ended[j] for j in b],
            "gold": g,
        }

    def _label(self, s: dict, scale: float, generator: torch.Generator) -> tuple[list, dict]:
        """Bradley-Terry labels of the sampled pairs (ties left out): the rows of a pairs
        file and their statistics."""
        p, r = self.cfg.pipeline, self.cfg.rm
        a_wins, kept = sample_preferences(
            s["gold_a"], s["gold_b"], p.label_temperature, p.label_noise, scale, generator
        )
        rows, agree = [], 0
        for i in kept.nonzero().flatten().tolist():
            win, lose = ("a", "b") if a_wins[i] else ("b", "a")
            g_win, g_lose = float(s[f"gold_{win}"][i]), float(s[f"gold_{lose}"][i])
            agree += g_win > g_lose
            rows.append(
                {
                    self.cfg.data.prompt_key: s["prompts"][i],
                    r.chosen_key: s[win][i],
                    r.rejected_key: s[lose][i],
                    r.chosen_key + ENDED_SUFFIX: s[f"ended_{win}"][i],
                    r.rejected_key + ENDED_SUFFIX: s[f"ended_{lose}"][i],
                    "gold_chosen": g_win,
                    "gold_rejected": g_lose,
                }
            )
        stats = {
            "pairs": len(rows),
            "tied": int((~kept).sum()),
            "agree_with_gold": agree / max(1, len(rows)),
        }
        return rows, stats

    # ------------------------------------------------------------------ 4. rm

    def rm(self) -> None:
        """`proxima rm` on the pairs, started from the SFT policy; its score normalisation is
        fitted on the training pairs' responses, the SFT policy's samples."""
        folder = self.run_dir / "pairs"
        rm_cfg = self.cfg.replace(
            {
                "model.actor_path": str(self.sft_dir),
                "rm.train_path": str(folder / "train.jsonl"),
                "rm.eval_path": str(folder / "heldout.jsonl"),
                "rm.out": str(self.rm_dir),
                "rm.margin_key": "",
                "rm.normalize": True,
            }
        )
        summary = reward_model(rm_cfg)
        self.result["rm_heldout_accuracy"] = summary["eval_after"]["accuracy"]
        self.result["rm_heldout_accuracy_before"] = summary["eval_before"]["accuracy"]
        self.result["rm_normalization"] = summary["normalization"]

    # ------------------------------------------------------------------ 5. ppo

    def ppo_config(self) -> Config:
        """The PPO run's config: the SFT policy against the reward model, the gold logged as
        a source of weight 0, a checkpoint at every evaluation point, all kept."""
        cfg = self.cfg
        iterations = cfg.trainer.iterations
        every = max(1, iterations // cfg.pipeline.eval_points)
        proxy = {"name": PROXY, "model_path": str(self.rm_dir), "batch_size": cfg.reward.batch_size}
        changes = {
            "task.name": "",
            "model.actor_path": str(self.sft_dir),
            "data.train_path": str(self.prompt_files["train"]),
            "data.eval_path": "",
            "reward.function": "",
            "reward.model_path": "",
            "reward.sources": [proxy, {"name": GOLD, "function": cfg.pipeline.gold, "weight": 0.0}],
            "trainer.save_every": every,
            "trainer.save_every_minutes": 0,
            "trainer.keep_checkpoints": 0,
            "trainer.resume_from": "",
        }
        ppo_cfg = cfg.replace(changes)
        if role_plan(ppo_cfg).critic_model and cfg.pipeline.critic_from_rm:
            critic = {"model.critic_init": "reward_model", "model.critic_path": str(self.rm_dir)}
            ppo_cfg = ppo_cfg.replace(critic)
        validate(ppo_cfg)
        return ppo_cfg

    @property
    def rm_dir(self) -> Path:
        return self.run_dir / "rm"

    @property
    def ppo_dir(self) -> Path:
        return self.run_dir / "ppo"

    @property
    def dpo_dir(self) -> Path:
        return self.run_dir / "dpo"

    def ppo(self) -> None:
        folder = self.ppo_dir
        folder.mkdir()
        summary = PPORecipe(self.ppo_config(), run_dir=folder).run()
        if "stopped" in summary:
            raise Interrupted(
                f"stopped during PPO ({summary['stopped'].get('signal', 'a signal')}); its "
                f"checkpoints are in {folder / 'checkpoints'}",
                summary["stopped"]["exit_status"] - 128,
            )
        if "diverged" in summary:
            self.result["ppo_diverged"] = summary["diverged"]

    # ------------------------------------------------------------------ 6. dpo

    def dpo(self) -> None:
        """`proxima dpo` on the pairs the reward model learned from, started from the SFT
        policy, so that its policy and PPO's answer the same question from the same start."""
        folder = self.run_dir / "pairs"
        dpo_cfg = self.cfg.replace(
            {
                "model.actor_path": str(self.sft_dir),
                "dpo.train_path": str(folder / "train.jsonl"),
                "dpo.eval_path": str(folder / "heldout.jsonl"),
                "dpo.out": str(self.dpo_dir),
            }
        )
        summary = train_dpo(dpo_cfg)
        self.result["dpo_heldout_accuracy"] = summary["eval_after"]["rewards/accuracies"]
        self.result["dpo_heldout_margin"] = summary["eval_after"]["rewards/margins"]

    # ------------------------------------------------------------------ 7. evaluate

    def evaluate(self) -> None:
        """The SFT policy and each PPO checkpoint on the held-out prompts (the same sampling
        seed for each): gold, proxy, KL to the SFT policy; the best checkpoint within the KL
        budget; the reward model's agreement with the gold order on the held-out pairs."""
        cfg = self.cfg
        reference = load_causal_lm(self.sft_dir, device=self.device, trainable=False)
        rm = load_reward_model(self.rm_dir, device=self.device)
        proxy = ModelReward(
            rm,
            self.tok,
            self.tok,
            reward_model_scores,
            device=self.device,
            batch_size=cfg.reward.batch_size,
            normalization=score_normalization(self.rm_dir),
        )
        self.result["rm_gold_accuracy"] = self._gold_order_accuracy(rm)
        points = [("sft", 0, None)] + [
            (ckpt.name, checkpoint_iteration(ckpt), ckpt)
            for ckpt in list_checkpoints(self.ppo_dir / "checkpoints")
        ]
        rows = []
        for name, iteration, ckpt in progress(points, desc="evaluating policies"):
            actor = reference
            if ckpt is not None:
                actor = load_causal_lm(ckpt / "actor", device=self.device, trainable=False)
            rows.append(
                {"name": name, "iteration": iteration, **self._scores(actor, reference, proxy)}
            )
            if ckpt is not None:
                rows[-1]["checkpoint"] = str(ckpt)
        if self.cfg.pipeline.dpo:
            actor = load_causal_lm(self.dpo_dir / "actor", device=self.device, trainable=False)
            rows.append({"name": "dpo", "iteration": None, **self._scores(actor, reference, proxy)})
        with (self.run_dir / "pipeline_eval.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        self.dpo_row = rows.pop() if self.cfg.pipeline.dpo else None
        self.rows = rows

    def _scores(self, actor, reference, proxy) -> dict[str, float]:
        """Gold, proxy and KL to the SFT policy of `actor`'s samples on the held-out prompts,
        drawn with the same noise for every policy."""
        cfg = self.cfg
        torch.manual_seed(cfg.trainer.seed + 1)
        res = scores_and_kl(
            actor,
            reference,
            self.tok,
            self.heldout,
            {GOLD: self.gold, PROXY: proxy},
            cfg.rollout,
            self.device,
            n=cfg.pipeline.eval_samples,
            batch_size=cfg.eval.batch_size,
        )
        return _moments(res)

    def _gold_order_accuracy(self, rm) -> float:
        """Share of the held-out pairs the reward model orders as the gold does (the labels
        it was scored against in `rm` are the noisy ones)."""
        path = self.run_dir / "pairs" / "heldout.jsonl"
        records = load_records(path)
        pairs = PreferenceDataset(
            records,
            self.tok,
            prompt_key=self.cfg.data.prompt_key,
            chosen_key=self.cfg.rm.chosen_key,
            rejected_key=self.cfg.rm.rejected_key,
            max_length=self.cfg.rm.max_length,
        )
        chosen, rejected, _ = all_pair_scores(rm, pairs, self.tok.pad_token_id, device=self.device)
        gold_diff = torch.tensor([r["gold_chosen"] - r["gold_rejected"] for r in records])
        return float(((chosen - rejected) * gold_diff > 0).float().mean())

    # ------------------------------------------------------------------ the end

    def _finish(self) -> dict:
        cfg, rows = self.cfg, self.rows
        sft, final = rows[0], rows[-1]
        budget = cfg.pipeline.kl_budget
        best = max((r for r in rows if r["kl"] <= budget), key=lambda r: r["gold_mean"])
        pruned = self._prune_checkpoints(best)
        out = {
            "rm_heldout_accuracy": self.result["rm_heldout_accuracy"],
            "rm_gold_accuracy": self.result["rm_gold_accuracy"],
            "gold_sft_mean": sft["gold_mean"],
            "gold_sft_std": sft["gold_std"],
            "gold_ppo_mean": final["gold_mean"],
            "proxy_sft_mean": sft["proxy_mean"],
            "proxy_ppo_mean": final["proxy_mean"],
            "kl_final": final["kl"],
            "gold_gain_sft_std": (final["gold_mean"] - sft["gold_mean"])
            / max(sft["gold_std"], 1e-8),
            "kl_budget": budget,
            "best_checkpoint": best.get("checkpoint", str(self.sft_dir)),
            "best": {k: best[k] for k in ("name", "iteration", "gold_mean", "proxy_mean", "kl")},
        }
        if self.dpo_row is not None:
            d = self.dpo_row
            out.update(
                dpo_heldout_accuracy=self.result["dpo_heldout_accuracy"],
                gold_dpo_mean=d["gold_mean"],
                proxy_dpo_mean=d["proxy_mean"],
                kl_dpo=d["kl"],
                gold_gain_dpo_sft_std=(d["gold_mean"] - sft["gold_mean"])
                / max(sft["gold_std"], 1e-8),
            )
        figure = plot_overoptimization(
            read_metrics(self.ppo_dir / "metrics.jsonl"),
            rows,
            self.run_dir / "overoptimization.png",
        )
        summary = {
            "pipeline": out,
            "details": {k: v for k, v in self.result.items() if k not in out},
            "evaluations": rows,
            "stage_seconds": self.seconds,
            "wall_seconds": round(time.perf_counter() - self.start, 2),  # this process's
            "stages_seconds": round(sum(self.seconds.values()), 2),  # with a resumed run's
            "checkpoints_removed": pruned,
            "figure": str(figure),
            "config": cfg.to_dict(),
        }
        write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        self._report(out, summary)
        return summary

    def _prune_checkpoints(self, best: dict) -> list[str]:
        """Every PPO checkpoint but the best one and the newest (to resume from) is deleted
        once evaluated: with a real model each holds weights and optimizer state."""
        keep = {best.get("checkpoint"), self.rows[-1].get("checkpoint")}
        removed = []
        for row in self.rows[1:]:
            if row["checkpoint"] not in keep:
                shutil.rmtree(row["checkpoint"], ignore_errors=True)
                removed.append(row["checkpoint"])
        return removed

    def _report(self, out: dict, summary: dict) -> None:
        b = out["best"]
        print(
            f"\nreward model: held-out pairwise accuracy {out['rm_heldout_accuracy']:.1%} "
            f"against the labels, {out['rm_gold_accuracy']:.1%} against the gold order\n"
            f"gold  (held-out): SFT {out['gold_sft_mean']:.4f} (std {out['gold_sft_std']:.4f}) "
            f"-> PPO {out['gold_ppo_mean']:.4f}: {out['gold_gain_sft_std']:+.2f} SFT std\n"
            f"proxy (held-out): SFT {out['proxy_sft_mean']:.4f} -> PPO "
            f"{out['proxy_ppo_mean']:.4f}; KL to the SFT policy {out['kl_final']:.3f} nats "
            "per response\n"
            f"best within KL <= {out['kl_budget']:g}: {b['name']} (iteration {b['iteration']}: "
            f"gold {b['gold_mean']:.4f}, KL {b['kl']:.3f}) at {out['best_checkpoint']}\n"
            f"figure: {summary['figure']}; wall time {summary['wall_seconds']:.0f} s"
            + (
                f" (resumed: the stages took {summary['stages_seconds']:.0f} s in all)"
                if self.cfg.trainer.resume_from
                else ""
            )
        )
        if "gold_dpo_mean" in out:
            print(
                f"DPO on the same pairs: held-out implicit-reward accuracy "
                f"{out['dpo_heldout_accuracy']:.1%}; gold {out['gold_dpo_mean']:.4f} "
                f"({out['gold_gain_dpo_sft_std']:+.2f} SFT std), proxy "
                f"{out['proxy_dpo_mean']:.4f}, KL to the SFT policy {out['kl_dpo']:.3f} nats "
                "per response"
            )


def read_status(folder: Path) -> dict:
    """The pipeline.json of a pipeline run folder, checked to be one `resume` can go on from."""
    path = Path(folder) / STATUS
    if not path.is_file():
        raise ValueError(
            f"`trainer.resume_from`: {folder} is not a `proxima pipeline` run folder (no "
            f"{STATUS}). Point it at the folder the pipeline printed as its run folder."
        )
    state = json.loads(path.read_text())
    if "config" not in state:
        raise ValueError(
            f"`trainer.resume_from`: {path} was written by a proxima that did not record the "
            "run's config, so the pipeline cannot go on from it; start a new run."
        )
    return state


def saved_pipeline_config(folder: str | Path) -> dict:
    """The config a pipeline run folder's stages ran with (after its task resolved it)."""
    return read_status(Path(folder))["config"]


def _free_name(path: Path) -> Path:
    """`path`, or `path.2`, `path.3`, ... the first that does not exist."""
    n, free = 1, path
    while free.exists():
        n += 1
        free = path.with_name(f"{path.name}.{n}")
    return free


def _moments(res: dict[str, torch.Tensor]) -> dict[str, float]:
    gold, proxy = res[GOLD].double(), res[PROXY].double()
    return {
        "gold_mean": float(gold.mean()),
        "gold_std": float(gold.std(unbiased=False)),
        "proxy_mean": float(proxy.mean()),
        "proxy_std": float(proxy.std(unbiased=False)),
        "kl": float(res["kl"].double().mean()),
        "samples": gold.numel(),
    }


def _generator(cfg: Config, stream: int) -> torch.Generator:
    """A generator of its own for each random choice of the pipeline (by seed and stream)."""
    return torch.Generator().manual_seed(cfg.trainer.seed * 1000 + stream)
