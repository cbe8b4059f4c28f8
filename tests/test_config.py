"""Config: YAML + overrides, validation messages that name the key and the fix."""

import pytest

from proxima.cli.args import default_config_path
from proxima.config import Config, ConfigError, batch_plan, describe_fields, load_config
from proxima.config.roles import trained_sections

BASE = ["model.actor_path=m", "data.train_path=p.jsonl", "reward.function=f.py:fn"]


def test_defaults_are_the_seeds():
    c = Config()
    assert c.algorithm.kl_ctrl.kl_coef == 0.1
    assert c.actor.clip_ratio == 0.2
    assert c.critic.cliprange_value == 0.2
    assert c.algorithm.clip_reward_value == 5.0
    assert c.algorithm.gamma == 1.0 and c.algorithm.lam == 0.95
    assert c.actor.clip_ratio_c == 3.0
    assert c.actor.optim.lr == 5e-7 and c.critic.optim.lr == 9e-6


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("actor:\n  clip_ratio: 0.1\nrollout:\n  n: 2\n")
    c = load_config(f, BASE + ["rollout.n=4", "actor.optim.lr=1e-5", "algorithm.lam=1"])
    assert c.actor.clip_ratio == 0.1 and c.rollout.n == 4
    assert c.actor.optim.lr == 1e-5 and c.algorithm.lam == 1.0
    assert isinstance(c.algorithm.lam, float)
    assert c.rollout_batch_size == 64 * 4


def test_yes_no_on_off_are_strings_as_in_yaml_1_2(tmp_path):
    """`model.mixed_precision=no` (its default, written out) was YAML 1.1's False."""
    c = load_config(None, BASE + ["model.mixed_precision=no", "trainer.output_dir=off"])
    assert c.model.mixed_precision == "no" and c.trainer.output_dir == "off"
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  mixed_precision: no\nactor:\n  shuffle: False\n")
    c = load_config(f, BASE)
    assert c.model.mixed_precision == "no" and c.actor.shuffle is False
    with pytest.raises(ConfigError, match="`actor.shuffle` must be true or false, got 'yes'"):
        load_config(None, BASE + ["actor.shuffle=yes"])


def test_unknown_key_names_key_and_suggests():
    with pytest.raises(
        ConfigError, match=r"`actor.ppo_mini_batc_size`.*`actor.ppo_mini_batch_size`"
    ):
        load_config(None, BASE + ["actor.ppo_mini_batc_size=8"])
    with pytest.raises(ConfigError, match=r"`algorithm.gama`.*`algorithm.gamma`"):
        load_config(None, BASE + ["algorithm.gama=0.9"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match="`trainer.iterations` must be an integer"):
        load_config(None, BASE + ["trainer.iterations=many"])
    with pytest.raises(ConfigError, match="`actor.shuffle` must be true or false"):
        load_config(None, BASE + ["actor.shuffle=3"])


def test_inconsistent_batch_sizes():
    with pytest.raises(ConfigError, match=r"`actor.ppo_mini_batch_size`=48 does not divide the 64"):
        load_config(None, BASE + ["actor.ppo_mini_batch_size=48"])
    with pytest.raises(ConfigError, match=r"`critic.ppo_micro_batch_size`=5 does not divide"):
        load_config(None, BASE + ["critic.ppo_micro_batch_size=5"])
    with pytest.raises(ConfigError, match="must be positive"):
        load_config(None, BASE + ["actor.ppo_mini_batch_size=0"])


def test_choices_and_missing_paths():
    with pytest.raises(
        ConfigError, match="`algorithm.kl_ctrl.type` must be one of fixed, adaptive"
    ):
        load_config(None, BASE + ["algorithm.kl_ctrl.type=pid"])
    with pytest.raises(ConfigError, match="model.actor_path"):
        load_config(None, ["data.train_path=p.jsonl"])
    with pytest.raises(ConfigError, match="exactly one of `reward.function`"):
        load_config(None, BASE[:2])
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        load_config(None, BASE + ["actor.clip_ratio_c=0.5"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("does/not/exist.yaml")


def test_batch_plan_counts():
    c_args = BASE + [
        "data.train_batch_size=8",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=16",
        "actor.ppo_micro_batch_size=4",
        "actor.ppo_epochs=2",
        "trainer.iterations=3",
        "critic.ppo_mini_batch_size=32",
    ]
    c = load_config(None, c_args)
    plan = batch_plan(c)
    assert "8 prompts x 4 samples = 32 sequences per iteration" in plan
    assert "actor : 2 epoch(s) x 2 mini-batch(es) of 16 = 4 optimizer step(s)" in plan
    assert "4 micro-batch(es) of 4, packed, sorted by length" in plan  # the default, -1
    fixed = load_config(None, [*c_args, "actor.ppo_max_tokens_per_micro=0"])
    assert "4 micro-batch(es) of 4, packed\n" in batch_plan(fixed)
    assert "3 iterations, 96 sequences" in plan
    budget = ["actor.ppo_max_tokens_per_micro=512", "model.packing=false"]
    assert (
        "actor : 2 epoch(s) x 2 mini-batch(es) of 16 = 4 optimizer step(s) per iteration; "
        "micro-batches of at most 512 padded tokens"
        in batch_plan(load_config(None, c_args + budget))
    )


def test_the_batch_plan_says_how_the_passes_lay_out_their_sequences():
    base = [*BASE, "data.train_batch_size=8", "rollout.n=2", "actor.ppo_mini_batch_size=16"]
    base += ["critic.ppo_mini_batch_size=16"]
    padded = batch_plan(load_config(None, [*base, "model.packing=false"]))
    assert "layout: padded rows in every forward pass (model.packing=false)" in padded
    assert "1 micro-batch(es) of 16, sorted by length" in padded
    unset = batch_plan(load_config(None, [*base, "actor.ppo_micro_batch_size=4"]))
    assert "layout: packed rows where every model takes them (tried at start-up): " in unset
    assert "4 micro-batch(es) of 4, packed" in unset
    packed = load_config(None, [*base, "model.packing=true", "actor.ppo_micro_batch_size=4"])
    plan = batch_plan(packed)
    assert "layout: packed rows: the scoring passes" in plan
    assert "4 micro-batch(es) of 4, packed" in plan
    budget = load_config(None, [*base, "model.packing=true", "actor.ppo_max_tokens_per_micro=512"])
    assert "micro-batches of at most 512 tokens in packed rows" in batch_plan(budget)


@pytest.mark.parametrize("key", ["actor.ppo_max_tokens_per_micro", "rollout.max_tokens_per_micro"])
def test_a_token_budget_below_one_row_is_refused(key):
    with pytest.raises(ConfigError, match=rf"`{key}` \(2\) is below one whole row: "):
        load_config(
            None, [*BASE, "data.max_prompt_length=16", "rollout.max_response_length=4", f"{key}=2"]
        )
    with pytest.raises(ConfigError, match=rf"`{key}` must be -1 \(micro-batches sorted by "):
        load_config(None, [*BASE, f"{key}=-2"])


def test_every_field_documented_and_default_example_valid():
    rows = describe_fields()
    assert all(help_text for _, _, help_text in rows), [k for k, _, h in rows if not h]
    assert ("critic.optim.lr", 9e-6) in [(k, d) for k, d, _ in rows]
    cfg = load_config(default_config_path())
    assert cfg.task.name == "arithmetic"


def test_config_reference_page_is_the_generated_one():
    """docs/config.md is `python -m proxima.config`: every key, default and help, in sync."""
    from pathlib import Path

    from proxima.config.reference import reference_markdown

    page = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    assert page == reference_markdown(), (
        "regenerate the page: python -m proxima.config > docs/config.md"
    )
    for _, _, help_text in describe_fields():  # keys are explained in docs/, not the README
        assert "README" not in help_text, help_text


@pytest.mark.parametrize(
    "override, key",
    [
        ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator"),
        ("algorithm.kl_penalty=k4", "algorithm.kl_penalty"),
        ("actor.kl_loss_type=k5", "actor.kl_loss_type"),
        ("actor.loss_agg_mode=sum", "actor.loss_agg_mode"),
    ],
)
def test_algorithm_names_checked_before_anything_loads(override, key):
    with pytest.raises(ConfigError, match=f"`{key}` must be one of"):
        load_config(None, BASE + ([override] if isinstance(override, str) else list(override)))


def test_config_is_frozen_and_replace_returns_a_new_one():
    import dataclasses

    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.actor_path = "x"
    new = cfg.replace({"model.actor_path": "m", "algorithm.kl_ctrl.kl_coef": 0.5, "rm.lr": 1.0})
    assert (new.model.actor_path, new.algorithm.kl_ctrl.kl_coef, new.rm.lr) == ("m", 0.5, 1.0)
    assert cfg.model.actor_path == "" and cfg.algorithm.kl_ctrl.kl_coef == 0.1  # untouched
    assert new.actor is cfg.actor  # sections that did not change are shared, not copied


@pytest.mark.parametrize(
    ("command", "overrides", "key"),
    [
        ("sft", [], "model.actor_path"),
        ("sft", ["model.actor_path=m"], "data.sft_path"),
        ("sft", ["model.actor_path=m", "data.sft_path=d"], "sft.out"),
        ("rm", ["model.actor_path=m"], "rm.train_path"),
        ("rm", ["model.actor_path=m", "rm.train_path=p"], "rm.out"),
        ("dpo", [], "model.actor_path"),
        ("dpo", ["model.actor_path=m"], "dpo.train_path"),
        ("dpo", ["model.actor_path=m", "dpo.train_path=p"], "dpo.out"),
        ("eval", ["model.actor_path=m"], "data.eval_path"),
        ("eval", ["model.actor_path=m", "data.eval_path=e"], "reward.function"),
    ],
)
def test_each_command_names_the_keys_it_needs(command, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides, command=command)
    # what one command needs, another does not: train's sources are not asked of sft
    if command == "sft" and len(overrides) == 2:
        load_config(None, [*overrides, "sft.out=o"], command="sft")


def test_kl_loss_turns_the_in_reward_kl_off_unless_both_are_asked_for():
    """verl's docs on actor.use_kl_loss, "When used, we are not applying KL in the reward
    function". Unset, algorithm.use_kl_in_reward follows that; set, it is obeyed."""
    plain = load_config(None, BASE)
    assert plain.algorithm.use_kl_in_reward is None and plain.kl_in_reward
    assert "KL" not in batch_plan(plain)  # no KL loss: nothing to choose, nothing printed

    loss_only = load_config(None, BASE + ["actor.use_kl_loss=true"])
    assert not loss_only.kl_in_reward
    assert "in the actor loss only" in batch_plan(loss_only)
    assert "set algorithm.use_kl_in_reward=true to have both" in batch_plan(loss_only)

    both = load_config(None, BASE + ["actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"])
    assert both.kl_in_reward and "counted twice, as set" in batch_plan(both)

    neither = load_config(None, BASE + ["algorithm.use_kl_in_reward=false"])
    assert not neither.kl_in_reward
    unset = load_config(None, BASE + ["algorithm.use_kl_in_reward=null"])
    assert unset.algorithm.use_kl_in_reward is None
    with pytest.raises(ConfigError, match="`algorithm.use_kl_in_reward` must be true or false"):
        load_config(None, BASE + ["algorithm.use_kl_in_reward=3"])


def test_policy_loss_section_and_its_options():
    assert load_config(None, BASE).actor.policy_loss.loss_mode == "vanilla"
    assert load_config(None, BASE + ["actor.policy_loss=gspo"]).actor.policy_loss.loss_mode == (
        "gspo"
    )
    mode = "actor.policy_loss.loss_mode="
    c = load_config(None, BASE + [mode + "clip_cov", "actor.policy_loss.clip_cov_ub=3"])
    assert c.actor.policy_loss.clip_cov_ub == 3
    ok = load_config(None, BASE + [mode + "dro", "actor.policy_loss.dro_beta=0.05"])
    assert ok.actor.policy_loss.dro_beta == 0.05
    with pytest.raises(ConfigError, match=r"`actor.policy_loss.clip_cov_ub` is set but .*vanilla"):
        load_config(None, BASE + ["actor.policy_loss.clip_cov_ub=3"])
    with pytest.raises(ConfigError, match="`actor.policy_loss.loss_mode` must be one of"):
        load_config(None, BASE + ["actor.policy_loss=ppo2"])
    for overrides, message in [
        (["actor.policy_loss=dro"], r"`actor.policy_loss.dro_beta` must be > 0 \(e.g. 0.05\)"),
        ([mode + "sapo", "actor.policy_loss.tau_neg=0"], "tau_neg` must be > 0"),
        ([mode + "kl_cov", "actor.policy_loss.kl_cov_ratio=2"], r"in \(0, 1\]"),
        ([mode + "clip_cov", "actor.policy_loss.clip_cov_ratio=0"], "must be > 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, BASE + overrides)


def test_target_kl_must_not_be_negative():
    assert load_config(None, BASE).actor.target_kl == 0.0  # off by default
    with pytest.raises(ConfigError, match=r"`actor.target_kl` must be >= 0 \(0 = no early"):
        load_config(None, BASE + ["actor.target_kl=-0.1"])


def test_yaml_errors_name_the_file_and_the_line(tmp_path):
    """Invalid YAML, a YAML list at the top level and a bad YAML value in an override stop
    with a ConfigError naming the file (or the override), not a traceback."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  seed: [1,\n")
    with pytest.raises(ConfigError, match=rf"Config file {bad} is not valid YAML \(.*line 3"):
        load_config(bad)
    nested = tmp_path / "indent.yaml"
    nested.write_text("trainer:\n  seed: 1\n iterations: 3\n")
    with pytest.raises(ConfigError, match=r"indent.yaml is not valid YAML .* at line 3, column 2"):
        load_config(nested)
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"list.yaml holds a list at the top level; a config"):
        load_config(listed)
    with pytest.raises(ConfigError, match=r"Override `trainer.seed=\[1,`: the value '\[1,' is not"):
        load_config(None, BASE + ["trainer.seed=[1,"])
    with pytest.raises(ConfigError, match="Override `=3` has no key"):
        load_config(None, BASE + ["=3"])
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")
    assert load_config(empty, BASE) == load_config(None, BASE)  # an empty file is no change


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.iterations=0", "`trainer.iterations` must be >= 1, got 0"),
        ("actor.optim.betas=[0.9]", r"`actor.optim.betas` must be two numbers in \[0, 1\)"),
        ("critic.optim.betas=[0.9, 1.5]", r"`critic.optim.betas` must be two numbers"),
        ("actor.optim.betas=[a, b]", r"`actor.optim.betas` must be two numbers"),
        ("rollout.stop_token_ids=[1, x]", r"`rollout.stop_token_ids` must be a list of token ids"),
        ("model.lora_target_modules=[1]", r"`model.lora_target_modules` must be a list of module"),
        ("algorithm.gdpo_reward_weights=[1, x]", r"`algorithm.gdpo_reward_weights` must be a"),
        ("actor.optim.eps=0", r"`actor.optim.eps` must be > 0"),
        ("critic.optim.lr=-1", r"`critic.optim.lr` must be >= 0"),
        ("actor.optim.grad_clip=-1", r"`actor.optim.grad_clip` must be >= 0"),
        ("trainer.threads=-1", r"`trainer.threads` must be >= 0 \(0 = torch's default, N = N"),
        ("data.train_path=[a.jsonl, 3]", r"`data.train_path` must be a prompt file or a list"),
        ("data.eval_path=[a.jsonl, a.jsonl]", r"`data.eval_path` names a file twice"),
        ("data.train_weights=[1, 2]", r"mixes several prompt files, but `data.train_path` names 1"),
        (
            ("data.train_path=[a.jsonl, b.jsonl]", "data.train_weights=[1]"),
            r"has 1 weights for the 2 files of `data.train_path`; give one weight per file",
        ),
        (
            ("data.train_path=[a.jsonl, b.jsonl]", "data.train_weights=[1, -1]"),
            r"`data.train_weights` must be a list of numbers >= 0",
        ),
        (
            ("data.train_path=[a.jsonl, b.jsonl]", "data.train_weights=[0, 0]"),
            r"`data.train_weights` are all 0: no prompt set would be sampled",
        ),
        ("model.offload=always", r"`model.offload` must be one of none, auto, trained"),
        ("critic.head_init=ones", r"`critic.head_init` must be one of random, zero"),
        (
            ("model.offload=trained", "model.device=cpu"),
            r"`model.offload=trained` moves state between the GPU and CPU memory, and "
            r"`model.device=cpu` has no GPU: set model.offload=none \(or auto\)",
        ),
        (
            ("model.offload=trained", "trainer.strategy=fsdp2"),
            r"`model.offload=trained` does not combine with trainer.strategy=fsdp2 .*"
            r"CPUOffloadPolicy.*: set model.offload=none \(or auto\)",
        ),
        (
            ("model.offload=trained", "rollout.max_staleness=1"),
            r"does not combine with rollout.max_staleness > 0 .* the phases overlap",
        ),
    ],
)
def test_values_checked_before_anything_loads(override, message):
    """Values that would otherwise fail later, mid-run (an IndexError for one beta, "No such
    file or directory: metrics.jsonl" for zero iterations), stop at load time."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, BASE + ([override] if isinstance(override, str) else list(override)))


def test_weights_in_exponent_form_are_numbers(tmp_path):
    """YAML 1.1 reads 1e-1 (no dot) as a string, on the command line and in a file alike."""
    files = "data.train_path=[a.jsonl, b.jsonl]"
    c = load_config(None, [*BASE, files, "data.train_weights=[1e-1, 1]"])
    assert c.data.train_weights == [0.1, 1.0]
    yaml_file = tmp_path / "w.yaml"
    yaml_file.write_text("data:\n  train_weights: [1e-1, 1]\n")
    assert load_config(yaml_file, [*BASE, files]).data.train_weights == [0.1, 1.0]
    with pytest.raises(ConfigError, match=r"`data.train_weights\[1\]` must be a number, got 'x'"):
        load_config(None, [*BASE, files, "data.train_weights=[1, x]"])


def test_rollout_engine_keys():
    c = load_config(
        None,
        BASE
        + ["rollout.name=vllm", "rollout.vllm.dtype=bfloat16", "rollout.vllm.enforce_eager=false"],
    )
    assert c.rollout.name == "vllm" and c.rollout.vllm.dtype == "bfloat16"
    assert not c.rollout.vllm.enforce_eager and c.rollout.vllm.enable_sleep_mode
    assert load_config(None, BASE).rollout.name == "hf"  # the default works everywhere
    for override, message in [
        ("rollout.name=sglang", "`rollout.name` must be one of hf, vllm"),
        ("rollout.vllm.dtype=fp8", "`rollout.vllm.dtype` must be one of auto, float32"),
        ("rollout.vllm.gpu_memory_utilization=1.5", "gpu_memory_utilization` must be in"),
        ("rollout.vllm.tensor_model_parallel_size=0", "tensor_model_parallel_size` must be pos"),
        ("rollout.vllm.tp=2", "Unknown config key `rollout.vllm.tp`"),
        ("rollout.logprob_diff_warn=-1", "logprob_diff_warn` must be >= 0"),
        ("algorithm.rollout_correction=geo", "must be token, sequence or empty"),
        ("algorithm.rollout_correction_cap=0.5", "rollout_correction_cap` must be >= 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, BASE + ([override] if isinstance(override, str) else list(override)))


def test_rollout_rejection_is_a_level_and_a_band_that_keeps_the_ratio_one():
    assert not load_config(None, BASE).algorithm.corrects_rollout  # off by default
    c = load_config(None, [*BASE, "algorithm.rollout_rejection=geometric"])
    assert c.algorithm.corrects_rollout and c.algorithm.rollout_correction == ""
    icepop = ["algorithm.rollout_rejection=token", "algorithm.rollout_rejection_threshold=5",
              "algorithm.rollout_rejection_threshold_lower=0.5"]  # fmt: skip
    assert load_config(None, [*BASE, *icepop]).algorithm.rollout_rejection_threshold == 5
    for override, message in [
        ("algorithm.rollout_rejection=seq", "must be token, sequence, geometric or empty"),
        ("algorithm.rollout_rejection_threshold=0.9", "threshold` must be > 1 .the on-policy"),
        ("algorithm.rollout_rejection_threshold=1", "threshold` must be > 1"),
        ("algorithm.rollout_rejection_threshold=-2", "threshold` must be > 1"),
        ("algorithm.rollout_rejection_threshold_lower=1", "lower` must be in .0, 1."),
        ("algorithm.rollout_rejection_threshold_lower=-0.5", "lower` must be in .0, 1."),
        (["algorithm.rollout_rejection=geometric", "algorithm.rollout_rejection_threshold=2.5"],
         "geometric mean of the ratios stays near 1"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            load_config(None, BASE + ([override] if isinstance(override, str) else override))


def test_dotted_keys_in_a_yaml_file_are_shown_nested(tmp_path):
    """`actor.optim.lr: 1e-5` at the top of a YAML file is the command line's spelling: the
    message shows the nested form to write instead (also for a key dotted further down)."""
    flat = tmp_path / "flat.yaml"
    flat.write_text("actor.optim.lr: 1e-5\n")
    nested = "Write it as:\n  actor:\n    optim:\n      lr: 1e-5"
    with pytest.raises(ConfigError, match="in a YAML file the sections nest") as err:
        load_config(flat, BASE)
    assert str(err.value).startswith("Config key `actor.optim.lr` is written with dots;")
    assert str(err.value).endswith(nested)
    half = tmp_path / "half.yaml"
    half.write_text("actor:\n  optim.lr: 1e-5\n")
    with pytest.raises(ConfigError) as err:
        load_config(half, BASE)
    assert str(err.value).endswith(nested)
    (tmp_path / "fixed.yaml").write_text("actor:\n  optim:\n    lr: 1e-5\n")  # as shown
    assert load_config(tmp_path / "fixed.yaml", BASE).actor.optim.lr == 1e-5
    typo = tmp_path / "typo.yaml"
    typo.write_text("actr.optim.lr: 1e-5\n")  # no such section: the unknown key, as before
    with pytest.raises(ConfigError, match=r"Unknown config key `actr.optim.lr`. Did you mean"):
        load_config(typo, BASE)


def test_policy_loss_shorthand_then_its_options(tmp_path):
    """`actor.policy_loss=NAME` is short for `.loss_mode=NAME`, also with options after it,
    on the command line and over a YAML file that uses the shorthand."""
    base = ["task.name=arithmetic"]
    cfg = load_config(None, [*base, "actor.policy_loss=dro", "actor.policy_loss.dro_beta=0.05"])
    assert (cfg.actor.policy_loss.loss_mode, cfg.actor.policy_loss.dro_beta) == ("dro", 0.05)
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("task: {name: arithmetic}\nactor:\n  policy_loss: sapo\n")
    cfg = load_config(yaml_file, ["actor.policy_loss.tau_neg=2.0"])
    assert (cfg.actor.policy_loss.loss_mode, cfg.actor.policy_loss.tau_neg) == ("sapo", 2.0)
    with pytest.raises(ConfigError, match="is a section"):
        load_config(None, [*base, "actor.optim=adam", "actor.optim.lr=1e-4"])


def test_a_critic_free_run_does_not_check_the_critics_batch_sizes():
    """grpo trains no critic: its critic.* batch sizes are not read, so not checked."""
    base = ["task.name=arithmetic", "data.train_batch_size=4", "rollout.n=2"]
    sizes = ["actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=4"]
    cfg = load_config(None, [*base, *sizes, "algorithm.adv_estimator=grpo"])
    assert list(trained_sections(cfg)) == ["actor"]
    with pytest.raises(ConfigError, match="critic.ppo_mini_batch_size"):
        load_config(None, [*base, *sizes, "algorithm.adv_estimator=gae"])


def test_the_batch_plan_says_how_the_batches_are_sampled_ahead():
    assert "ahead" not in batch_plan(load_config(None, BASE))  # synchronous: nothing ahead
    two = batch_plan(load_config(None, [*BASE, "rollout.max_staleness=2"]))
    assert "batch i is sampled from the weights of iteration i - 2; up to 2 batch(es)" in two
    assert "2 rollout worker process(es)" in two and "max(update, sampling / 2)" in two
    beyond = load_config(None, [*BASE, "rollout.max_staleness=100000", "trainer.iterations=3"])
    said = batch_plan(beyond)
    assert "up to 3 batch(es)" in said and "every batch from the first weights" in said
    assert "3 rollout worker process(es)" in said
    here = batch_plan(load_config(None, [*BASE, "rollout.max_staleness=2", "rollout.name=vllm"]))
    assert "trainer's process (rollout.workers=0; workers do not go with rollout.name=vllm" in here
    assert "nothing overlaps" in here


def test_shipped_dapo_config_is_found_by_name():
    from proxima.cli.args import builtin_config
    from proxima.config import load_config

    cfg = load_config(builtin_config("dapo"))
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.filter_groups
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.2, 0.28)
    assert cfg.reward.overlong_buffer_len == 2 and not cfg.kl_in_reward
