"""``tandem synth``: a GGUF of any supported architecture with random weights, tiny or of a
real model's shape, in any weight type llama.cpp makes: what the architecture benchmarks
and tests run on where the real model cannot be downloaded."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from engine.gguf.architectures import (
    ARCHITECTURES,
    PLAIN_ONLY_ARCHITECTURES,
    REAL_SHAPES,
    TinyShape,
    write_architecture_gguf,
)
from engine.hub.convert import quantize_as
from engine.hub.model_store import default_model_path


def cmd_synth(args: argparse.Namespace) -> int:
    arch, shape = args.arch, TinyShape()
    if args.shape:
        arch, shape = REAL_SHAPES[args.shape]
    if arch is None:
        raise ValueError("name an architecture (--arch) or a real shape (--shape)")
    if args.mtp:
        shape = replace(shape, mtp_layers=1)
    name = args.name
    if args.layers:  # a real shape's first layers: the same per-layer work, less memory
        if not args.shape or not 0 < args.layers <= shape.n_layers:
            raise ValueError(f"--layers takes 1 to {shape.n_layers} layers of a --shape")
        shape = replace(shape, n_layers=args.layers)
        name = name or f"{args.shape} shape, first {args.layers} layers (random weights)"
    if args.direct and args.type != "q4_k":
        raise ValueError("--direct writes Q4_K-like blocks: use it with --type q4_k")
    out = Path(args.out)
    f32 = out if args.type == "f32" or args.direct else out.with_suffix(".f32.tmp")
    desc = f"{arch} {'Q4_K (direct)' if args.direct else 'F32'}"
    with tqdm(total=1, unit="tensor", desc=desc) as bar:
        def moved(done: int, total: int) -> None:
            bar.total, bar.n = total, done
            bar.refresh()
        write_architecture_gguf(arch, f32, args.tokenizer or default_model_path(),
                                shape, chat_template=not args.no_template,
                                name=name, progress=moved, n_vocab=args.vocab,
                                direct=args.direct)
    if f32 != out:
        try:
            print(f"quantizing to {args.type.upper()}…", flush=True)
            quantize_as(f32, out, args.type, args.threads)
        finally:
            f32.unlink(missing_ok=True)
    print(f"{out} ({out.stat().st_size / 1e6:.0f} MB)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``synth`` to the ``tandem`` command's sub-parsers."""
    p = subparsers.add_parser("synth", help="write a GGUF of an architecture with random "
                                            "weights (for benchmarks and tests)")
    p.add_argument("out", type=Path, help="the GGUF to write")
    p.add_argument("--arch", choices=ARCHITECTURES + PLAIN_ONLY_ARCHITECTURES, default=None,
                   help="a tiny model of this architecture")
    p.add_argument("--shape", choices=sorted(REAL_SHAPES), default=None,
                   help="a real model's shape (and its architecture) instead")
    p.add_argument("--type", default="f32", help="weight type: f32 or any llama.cpp "
                                                 "quantize makes (q4_k_m, q4_0, iq4_xs...)")
    p.add_argument("--vocab", type=int, default=None, metavar="N",
                   help="pad the vocabulary to N tokens (Gemma 3 has 262144)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="copy the tokenizer of this GGUF (default: the bundled model's)")
    p.add_argument("--no-template", action="store_true",
                   help="write no chat template (as many base models' files)")
    p.add_argument("--name", default=None, help="general.name (says base or instruct)")
    p.add_argument("--mtp", action="store_true",
                   help="add a next-token (MTP) block, as Qwen3.5, GLM-4.5 and DeepSeek "
                        "files carry (qwen35, glm4moe, deepseek2)")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="keep a real shape's first N layers (an MoE of 30B does not fit "
                        "here at full depth; each layer's work is the real one's)")
    p.add_argument("--direct", action="store_true",
                   help="write random quantized blocks directly, no F32 pass (with --type "
                        "q4_k: Q4_K, Q8_0 where rows are not 256-wide, gpt-oss's experts "
                        "MXFP4): for shapes whose F32 file would not fit")
    p.add_argument("--threads", type=int, default=2, help="threads for quantizing")
    p.set_defaults(func=cmd_synth)
