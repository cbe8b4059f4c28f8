"""`proxima sft`: supervised fine-tuning of `model.actor_path` on prompt/response records
(`data.sft_path`), saved as a Hugging Face folder at `sft.out`."""

from __future__ import annotations

from proxima.config import Config
from proxima.launch import Interrupted, signum_of
from proxima.models import load_causal_lm, load_tokenizer
from proxima.recipes.common import fresh_out, process_setup, save_model
from proxima.trainer.checks import check_enough, check_model_folders, with_key
from proxima.trainer.datasets import load_sft
from proxima.trainer.sft import sft_train


def sft(cfg: Config) -> dict:
    """Fine-tune and save; returns {"out", "steps", "final_loss"}."""
    out = fresh_out(cfg.sft.out, "`sft.out`")
    check_model_folders(cfg, "sft")
    device = process_setup(cfg)
    tok = load_tokenizer(cfg.model.actor_path)
    data = with_key("data.sft_path", load_sft, cfg, cfg.data.sft_path, tok, cfg.sft.max_length)
    check_enough(data, cfg.sft.batch_size, "sft.batch_size", "data.sft_path")
    model = load_causal_lm(cfg.model.actor_path, device=device)
    s = cfg.sft
    try:
        losses = sft_train(
            model,
            tok,
            data,
            steps=s.steps,
            lr=s.lr,
            batch_size=s.batch_size,
            seed=cfg.trainer.seed,
            device=device,
        )
    except KeyboardInterrupt as err:
        raise Interrupted(
            f"SFT interrupted ({str(err) or 'Ctrl-C'}): nothing was written to {out}, the "
            "model is saved only at the end",
            signum_of(err),
        ) from None
    save_model(model, tok, out, "`sft.out`")
    print(f"sft: {s.steps} steps, final loss {losses[-1]:.4f}; saved to {out}")
    return {"out": str(out), "steps": len(losses), "final_loss": losses[-1]}
