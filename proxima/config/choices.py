"""Every set of allowed values of the config, defined once.

The config checks a key against its set before anything heavy happens (`validation`), and
the code that acts on a value imports the same tuple: `proxima.models.load_critic`
(CRITIC_INIT), `proxima.models.DTYPES` (DTYPE_NAMES), the data loaders (OVERLONG_MODES,
PREFERENCE_OVERLONG). The names the math accepts (advantage estimators, KL estimators, loss
aggregation modes, rollout-correction levels) are defined in `proxima.algos`, next to the
math; the validation reads them from there. Nothing here imports anything.
"""

CRITIC_INIT = ("actor", "reward_model", "critic")  # model.critic_init
HEAD_INITS = ("random", "zero")  # critic.head_init
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # model.dtype, fsdp.param_dtype / reduce_dtype
VLLM_DTYPES = ("auto", *DTYPE_NAMES)  # rollout.vllm.dtype: auto = model.dtype
MIXED_PRECISION = ("no", "bf16")  # model.mixed_precision
OFFLOADS = ("none", "auto", "trained")  # model.offload
ENGINES = ("hf", "vllm")  # rollout.name (rollout.engines has a class for each)
ENGINES_SERVING_ACTOR = ("hf",)  # those that generate with the trainer's actor module itself
OLD_LOGPROBS = ("auto", "engine", "recompute")  # rollout.old_logprobs
OVERLONG_MODES = ("error", "drop", "truncate")  # data.overlong_prompts
# rm.overlong: no truncate, which would cut the EOS the score is read at
PREFERENCE_OVERLONG = ("error", "drop")
PAIRINGS = ("consecutive", "all")  # pipeline.pairing
KL_CONTROLLERS = ("fixed", "adaptive")  # algorithm.kl_ctrl.type
SCHEDULES = ("constant", "cosine")  # actor.optim.schedule, critic.optim.schedule
STRATEGIES = ("auto", "none", "ddp", "fsdp2")  # trainer.strategy
MEMORY_CHECKS = ("error", "warn", "off")  # trainer.memory_check
WORKER_STARTS = ("auto", "fork", "spawn")  # rollout.worker_start (trainer.workers)
LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")  # trainer.loggers (proxima.trackers)
PIPELINE_TASKS = ("preferences", "chat")  # pipeline.task (proxima.tasks.preference_task)
