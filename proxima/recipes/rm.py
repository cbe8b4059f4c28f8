"""`proxima rm`: a reward model trained on preference pairs (`rm.train_path`), started from
`model.actor_path`, evaluated on held-out pairs before and after, saved at `rm.out` with an
`rm_summary.json`."""

from __future__ import annotations

import json

from proxima.config import Config
from proxima.data import load_records
from proxima.data.preferences import PreferenceDataset
from proxima.launch import Interrupted, signum_of
from proxima.logging import write_atomic
from proxima.models import init_reward_model, load_tokenizer
from proxima.models.loading import SCORE_NORMALIZATION
from proxima.recipes.common import fresh_out, process_setup, save_model
from proxima.trainer.checks import check_model_folders, with_key
from proxima.trainer.rm import CURVES, rm_train, score_normalization


def _pairs(cfg: Config, tok, key: str, path: str) -> PreferenceDataset:
    r = cfg.rm
    opts = {
        "prompt_key": cfg.data.prompt_key,
        "chosen_key": r.chosen_key,
        "rejected_key": r.rejected_key,
        "margin_key": r.margin_key or None,
        "max_length": r.max_length,
        "overlong": r.overlong,
    }
    return with_key(key, lambda: PreferenceDataset(load_records(path), tok, **opts))


def reward_model(cfg: Config) -> dict:
    """Train and save the reward model; returns the summary written to rm_summary.json."""
    r = cfg.rm
    out = fresh_out(r.out, "`rm.out`")
    check_model_folders(cfg, "rm")
    device = process_setup(cfg)
    tok = load_tokenizer(cfg.model.actor_path)
    train = _pairs(cfg, tok, "rm.train_path", r.train_path)
    held = _pairs(cfg, tok, "rm.eval_path", r.eval_path) if r.eval_path else None
    model = init_reward_model(
        cfg.model.actor_path, device=device, seed=cfg.trainer.seed, pad_token_id=tok.pad_token_id
    )
    try:
        res = rm_train(
            model,
            tok,
            train,
            steps=r.steps,
            lr=r.lr,
            batch_size=r.batch_size,
            seed=cfg.trainer.seed,
            eval_dataset=held,
            device=device,
            train_probe_size=r.probe_size,
            group_by_prompt=r.group_by_prompt,
        )
    except KeyboardInterrupt as err:
        raise Interrupted(
            f"reward-model training interrupted ({str(err) or 'Ctrl-C'}): nothing was "
            f"written to {out}, the model is saved only at the end",
            signum_of(err),
        ) from None
    if r.normalize:
        norm = score_normalization(model, train, tok.pad_token_id, device)
        setattr(model.config, SCORE_NORMALIZATION, norm)
        res["normalization"] = norm
    save_model(model, tok, out, "`rm.out`")
    evals = {k: v for k, v in res.items() if k not in CURVES}
    summary = {"config": cfg.to_dict(), "pairs": len(train)}
    summary.update(dropped=train.num_dropped, eval_pairs=len(held) if held else 0, **evals)
    summary["curves"] = {k: res[k] for k in CURVES}
    write_atomic(out / "rm_summary.json", json.dumps(summary, indent=2))
    for name in ("train", "eval"):
        if f"{name}_before" in res:
            before, after = res[f"{name}_before"], res[f"{name}_after"]
            print(
                f"{name} preference accuracy: before {before['accuracy']:.4f} -> after "
                f"{after['accuracy']:.4f} (mean margin {after['margin']:.4f}, {after['n']} pairs)"
            )
    if r.normalize:
        print(
            f"score normalisation (stored in {out}/config.json): mean {norm['mean']:.4f}, "
            f"std {norm['std']:.4f} over the {norm['n']} training responses"
        )
    print(f"rm: {r.steps} steps, final loss {res['loss'][-1]:.4f}; saved to {out}")
    return summary
