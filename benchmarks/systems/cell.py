"""One cell in its own process: one system's trainer built, 1 warm-up + `repeats` timed
iterations, summarised as one JSON-able dict."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common.flops import model_flops
from benchmarks.common.timing import maxrss_gb, median, vmhwm_gb
from benchmarks.common.workloads import WORKLOADS
from benchmarks.systems.floor import floor_cell
from benchmarks.systems.proxima_ppo import proxima_cell
from benchmarks.systems.trl_ppo import trl_cell

RUNNERS = {"trl": trl_cell, "proxima": proxima_cell, "floor": floor_cell}
PARTS = ("gen", "score", "train", "gc")  # phases that split an iteration; the rest is "other"


def run_cell(spec: dict) -> dict:
    """Build one system's trainer, run 1 warm-up + `repeats` timed iterations, summarise."""
    import warnings

    import torch

    torch.set_num_threads(spec["threads"])
    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    w = WORKLOADS[spec["workload"]]
    rss_before = maxrss_gb()
    cuda = spec["device"].startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        records = RUNNERS[spec["system"]](spec, w, spec["assets"], 1 + spec["repeats"], Path(tmp))
    wall = time.perf_counter() - start
    out = summarise(spec, records[1:])  # the first iteration is a warm-up
    out.update(
        peak_rss_gb=round(maxrss_gb(), 3),
        peak_gpu_gb=round(torch.cuda.max_memory_allocated() / 1e9, 3) if cuda else None,
        vmhwm_gb=round(vmhwm_gb() or float("nan"), 3),
        rss_before_build_gb=round(rss_before, 3),
        threads=torch.get_num_threads(),
        wall_s=round(wall, 1),
    )
    return out


def summarise(spec: dict, timed: list[dict]) -> dict:
    """Medians over the timed iterations: seconds, phases, tokens, and the model math each
    phase did per second where the system reported the lengths."""
    w = WORKLOADS[spec["workload"]]
    iters = []
    for r in timed:
        ph = dict(r["phases"])
        ph["other"] = r["seconds"] - sum(ph.get(k, 0.0) for k in PARTS)
        iters.append({"s": round(r["seconds"], 4), **{k: round(v, 4) for k, v in ph.items()}})
    seconds = [r["seconds"] for r in timed]
    out = {
        "s_median": round(median(seconds), 4),
        "s_min": round(min(seconds), 4),
        "s_max": round(max(seconds), 4),
        "phases": {k: round(median([i[k] for i in iters]), 4) for k in iters[0] if k != "s"},
        "tokens_per_iter": median([r["tokens"] for r in timed]),
        "expected_tokens": w.sequences * w.response,
        "optimizer_steps_per_iter": timed[0]["steps"],
        "iters": iters,
    }
    if all(r.get("lengths") for r in timed):  # the model math of each phase, per iteration
        shared = "critic.shared_backbone=true" in spec.get("overrides", [])
        work = [model_flops(w, r["lengths"], spec["epochs"], shared) for r in timed]
        out["model_math"] = {k: median([x[k] for x in work]) for k in ("score", "train", "prefill")}
        out["model_math"]["decode"] = work[len(work) // 2]["decode"]  # one iteration's steps
        out["gflops_per_s"] = {
            ph: round(median([x[ph] / i[ph] / 1e9 for x, i in zip(work, iters, strict=True)]), 2)
            for ph in ("score", "train")
        }
        out["decode_steps"] = median([r["lengths"]["width"] for r in timed])
        out["sequence_tokens"] = median(
            [sum(r["lengths"]["prompt"]) + sum(r["lengths"]["response"]) for r in timed]
        )
    if "detail" in timed[0]:  # proxima's own phase timer
        keys = timed[0]["detail"]
        out["proxima_timer"] = {k: round(median([r["detail"][k] for r in timed]), 4) for k in keys}
    diffs = [r["logprob_diff_mean"] for r in timed if r.get("logprob_diff_mean") is not None]
    if diffs:  # proxima: mean |rollout log-prob - trainer log-prob|
        out["logprob_diff_mean"] = median(diffs)
    if "mixed_precision" in timed[0]:
        out["trl_mixed_precision"] = timed[0]["mixed_precision"]
    return out
