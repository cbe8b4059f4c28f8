"""A run's inputs, every one checked before a model loads (`prepare_inputs`): the models'
folders and vocabularies, the scoring plan, the environment or agent, the data, the reward
function."""

from __future__ import annotations

from dataclasses import dataclass

from proxima.config import Config
from proxima.data import PromptDataset, SFTDataset
from proxima.data.mixing import all_items
from proxima.models.loading import generation_config
from proxima.rewards import load_reward_function
from proxima.rollout.agent import check_agent
from proxima.rollout.engines import engine_spec
from proxima.rollout.environments import check_env
from proxima.rollout.plan import ScoringPlan, plan_scoring
from proxima.trainer.checks import check_lengths, check_models, with_key
from proxima.trainer.datasets import load_data
from proxima.trainer.device import check_rollout_devices


@dataclass
class RunInputs:
    """What a PPO run reads besides its models, checked and loaded before a run folder is
    created or any model is loaded (a failed start leaves nothing behind)."""

    tokenizer: object
    prompts: PromptDataset
    eval_items: list
    sft: SFTDataset | None
    reward_fn: object | None  # the imported reward.function, or None for a reward model
    plan: ScoringPlan


def prepare_inputs(cfg: Config) -> RunInputs:
    """Everything a PPO run is checked for before a model loads: the models' folders and
    vocabularies, the scoring plan, the environment of multi-turn episodes, the data, the
    reward function."""
    tok = check_models(cfg)
    check_rollout_devices(cfg)
    check_env(cfg)
    check_agent(cfg)
    engine = engine_spec(cfg.rollout.name)
    plan = plan_scoring(cfg, engine, generation_config(cfg.model.actor_path))
    prompts, eval_items, sft = load_data(cfg, tok)
    check_lengths(cfg, all_items(prompts), eval_items)
    fn = None
    if cfg.reward.function:
        fn = with_key("reward.function", load_reward_function, cfg.reward.function)
    return RunInputs(tok, prompts, eval_items, sft, fn, plan)
