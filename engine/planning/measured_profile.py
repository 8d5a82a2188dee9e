"""Measured costs of a big model's shape on one machine, and the plan they lead to.

A profile records, for a target shape (``engine.gguf.model_shapes``) on the machine it was
measured on: the verification curve at several context lengths, the time to the first
token for prompts of those lengths, the per-token cost of draft models of the family,
and a draft head level of that width. ``tandem profile`` measures one (writing synthetic
GGUFs of the real shapes: nothing that large can be downloaded or shipped);
``tandem plan --profile FILE`` shows what the planner would choose with it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.gguf.model_shapes import ModelShape, shape_named
from engine.planning.calibration import CostProfile, measure_draft_model, measure_verify_curve
from engine.planning.planner import (
    DRAFT_MODEL_ACCEPTANCE,
    DraftModelFacts,
    HeadFacts,
    Overrides,
    Plan,
    choose_plan,
)
from engine.runtime.hardware import HardwareProfile
from engine.runtime.model_info import ModelFacts

if TYPE_CHECKING:
    from engine.runtime.target import Target

PLAN_CONTEXT = 256  # the context the planner's curve is taken at (as calibration's)
VERIFY_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass
class DraftCost:
    shape: str
    size_bytes: int
    token_s: float  # one token's decode at PLAN_CONTEXT
    sync_s: float  # a step's catching up (2 tokens less 1)


@dataclass
class HeadCost:
    width: int
    vocab: int  # rows of the LM head the level multiplies
    level_s: float
    update_s: float


@dataclass
class MeasuredProfile:
    target_shape: str
    quant: str
    size_bytes: int  # the synthetic file (its vocabulary is the bundled tokenizer's)
    n_layers: int
    kv_bytes_per_token: int
    machine: dict  # HardwareProfile.to_json() of where it was measured
    n_threads: int
    verify_s: dict[int, dict[int, float]] = field(default_factory=dict)  # ctx -> n -> s
    prefill_s: dict[int, float] = field(default_factory=dict)  # ctx -> s
    # The same with every layer on the GPU (``tandem profile --gpu``), where one is.
    gpu_verify_s: dict[int, dict[int, float]] = field(default_factory=dict)
    gpu_prefill_s: dict[int, float] = field(default_factory=dict)
    # Whether the GPU's verified batches gave one-token decoding's logits (the exactness
    # probe); None: not probed. Where they did not, nothing is verified there.
    gpu_exact: bool | None = None
    drafts: list[DraftCost] = field(default_factory=list)
    heads: dict[str, HeadCost] = field(default_factory=dict)  # device -> cost
    # An EAGLE-3 head GGUF of the target's width run by llama.cpp on the CPU (random
    # weights: the cost does not depend on them), with a public head's 32k draft vocabulary.
    eagle3: HeadCost | None = None
    notes: list[str] = field(default_factory=list)

    # --- what the planner reads -------------------------------------------------------
    def costs(self) -> CostProfile:
        """The calibration the planner would have on that machine, for the first draft."""
        ctx = min(self.verify_s, key=lambda c: abs(c - PLAN_CONTEXT))
        profile = CostProfile(context=ctx, verify_s={"cpu": dict(self.verify_s[ctx])})
        if ctx in self.gpu_verify_s:
            profile.verify_s["gpu"] = dict(self.gpu_verify_s[ctx])
        for device, head in self.heads.items():
            profile.head_level_s[device] = head.level_s
            profile.head_update_s[device] = head.update_s
            profile.transfer_s[device] = 0.0
        if self.drafts:
            profile.draft_token_s["cpu"] = self.drafts[0].token_s
            profile.draft_sync_s["cpu"] = self.drafts[0].sync_s
        return profile

    def plan(self, acceptance: tuple[float, ...] = DRAFT_MODEL_ACCEPTANCE,
             head_acceptance: tuple[float, ...] | None = None, n_ctx: int = 4096,
             overrides: Overrides | None = None) -> Plan:
        """The plan on the recorded machine with the first draft model (and a head of
        that width when one was measured and ``head_acceptance`` is given)."""
        hw = HardwareProfile.from_json(self.machine)
        model = ModelFacts(self.size_bytes, self.n_layers, self.kv_bytes_per_token * n_ctx,
                           exact_on_gpu=self.gpu_exact is not False)
        draft = None
        if self.drafts:
            d = self.drafts[0]
            draft = DraftModelFacts(d.shape, d.size_bytes, acceptance=acceptance,
                                    acceptance_source="assumed (the prior)")
        head = None
        if head_acceptance is not None and self.heads:
            measured = next(iter(self.heads.values()))
            # The embedding and LM head it reads, in float32.
            head = HeadFacts(2 * measured.vocab * measured.width * 4, head_acceptance)
        return choose_plan(hw, self.costs(), model, head, overrides, draft)

    # --- files ------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        for name in ("verify_s", "gpu_verify_s"):
            d[name] = {str(c): {str(n): t for n, t in curve.items()}
                       for c, curve in getattr(self, name).items()}
        for name in ("prefill_s", "gpu_prefill_s"):
            d[name] = {str(c): t for c, t in getattr(self, name).items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> MeasuredProfile:
        d = dict(d)
        if d.get("eagle3"):
            d["eagle3"] = HeadCost(**d["eagle3"])
        for name in ("verify_s", "gpu_verify_s"):
            d[name] = {int(c): {int(n): float(t) for n, t in curve.items()}
                       for c, curve in d.get(name, {}).items()}
        for name in ("prefill_s", "gpu_prefill_s"):
            d[name] = {int(c): float(t) for c, t in d.get(name, {}).items()}
        d["drafts"] = [DraftCost(**x) for x in d.get("drafts", [])]
        d["heads"] = {k: HeadCost(**v) for k, v in d.get("heads", {}).items()}
        return cls(**d)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))


def load_measured_profile(path: Path) -> MeasuredProfile:
    """Raises ValueError naming the file when it is not a measured profile."""
    try:
        return MeasuredProfile.from_json(json.loads(Path(path).read_text()))
    except OSError as exc:
        raise ValueError(f"cannot read the profile {path}: {exc.strerror or exc}") from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"{path} is not a measured profile (tandem profile writes one): "
                         f"{exc}") from None


def measure_head_level(width: int, n_heads: int, n_kv_heads: int, ffn: int, vocab: int,
                       context: int = PLAN_CONTEXT, repeats: int = 7,
                       device: str = "cpu") -> tuple[float, float]:
    """(one drafting level: the head on one token with ``context`` cached entries, its
    LM head over ``vocab`` rows and the top 4; a step's update over 3 accepted tokens)
    of an EAGLE-1 head of that width on ``device``, with the weights the head drafter
    uses there (int8 on a CPU that has the kernels, float32 elsewhere)."""
    import statistics

    import torch

    from models.draft_head import DraftHead
    from models.head_config import HeadConfig
    from models.int8_linear import int8_available

    torch.manual_seed(0)
    cfg = HeadConfig(hidden_size=width, n_heads=n_heads, n_kv_heads=n_kv_heads,
                     intermediate_size=ffn, fusion="fc")
    embed = torch.randn(vocab, width) * 0.02
    head = DraftHead(cfg, embed, embed).eval()
    if device == "cpu" and int8_available():  # as the head drafter runs on a CPU
        head.to_int8()
    head = head.to(device)
    feats = torch.randn(1, context, width, device=device)
    cache = head.new_cache()
    with torch.inference_mode():
        head(feats, torch.zeros(1, context, dtype=torch.long, device=device),
             torch.arange(context, device=device)[None], cache)

        def run(n: int) -> float:
            # The features arrive from the target (host memory), as in the drafter.
            step = torch.randn(1, n, width)
            t0 = time.perf_counter()
            out, _ = head(step.to(device), torch.ones(1, n, dtype=torch.long, device=device),
                          torch.arange(context, context + n, device=device)[None], cache)
            top = torch.softmax(head.logits(out[0, -1:]), dim=-1).topk(4)
            top.indices.cpu()  # the drafter reads the tokens back: the GPU has finished
            took = time.perf_counter() - t0
            for buffer in cache:
                buffer.truncate(context)
            return took

        run(1), run(3)
        level = statistics.median(run(1) for _ in range(repeats))
        update = statistics.median(run(3) for _ in range(repeats))
    return level, update


EAGLE3_DRAFT_VOCAB = 32000  # public EAGLE-3 heads' reduced vocabulary


def _measure_eagle3_level(target: Target, target_path: Path, workdir: Path,
                          tokenizer_from: Path) -> HeadCost:
    """A random EAGLE-3 head (Q8_0, 32k draft vocabulary) for ``target``, timed."""
    from dataclasses import replace

    from engine.gguf.eagle3 import shape_for_target, write_eagle3_head
    from engine.planning.calibration import measure_eagle3

    head_path = workdir / "eagle3-head.gguf"
    shape = shape_for_target(target_path)
    vocab = min(EAGLE3_DRAFT_VOCAB, target.n_vocab)
    shape = replace(shape, draft_vocab=vocab)
    try:
        write_eagle3_head(head_path, target_path, shape, matrices="q8_0",
                          tokenizer_from=tokenizer_from)
        level, update = measure_eagle3(target, head_path)
    finally:
        head_path.unlink(missing_ok=True)
    return HeadCost(shape.hidden, vocab, level, update)


def measure_profile(target: ModelShape, drafts: list[ModelShape], workdir: Path,
                    tokenizer_from: Path, hardware: HardwareProfile, n_threads: int,
                    contexts: tuple[int, ...] = (256, 1024), head: bool = True,
                    say: Callable[[str], None] | None = None, gpu: bool = False,
                    head_devices: tuple[str, ...] = ("cpu",)) -> MeasuredProfile:
    """Write the shapes as synthetic GGUFs in ``workdir`` (removed afterwards) and
    measure them on this machine: the target on the CPU, and with ``gpu`` wholly on the
    GPU too; the draft head on each of ``head_devices``."""
    from engine.gguf.synthetic import write_synthetic_gguf
    from engine.runtime.exactness import probe_exactness
    from engine.runtime.model_info import read_model_info
    from engine.runtime.target import Target, TargetConfig

    note = say or (lambda _m: None)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{target.name}.gguf"
    note(f"writing {path.name}")
    write_synthetic_gguf(target, path, tokenizer_from)
    info = read_model_info(path)
    profile = MeasuredProfile(
        target_shape=target.name, quant="Q4_0", size_bytes=info.size_bytes,
        n_layers=target.n_layers, kv_bytes_per_token=info.kv_bytes(1),
        machine=hardware.to_json(), n_threads=n_threads,
        notes=["synthetic weights of the real shape (Q4_0, LM head Q8_0)"])
    if info.n_vocab != target.vocab_size:
        profile.notes.append(f"the vocabulary (embedding and LM head) is the bundled "
                             f"tokenizer's {info.n_vocab} tokens, not {target.vocab_size}: "
                             "the real model reads more per token")
    try:
        with Target(path, TargetConfig(n_ctx=max(contexts) + 64, n_threads=n_threads)) as t:
            _measure_curves(t, contexts, profile.verify_s, profile.prefill_s,
                            lambda ctx: f"{target.name}: verification at {ctx} tokens of "
                                        "context", note)
            if head and t.arch.layer_inputs:
                note(f"an EAGLE-3 head of width {target.hidden_size} (llama.cpp)")
                profile.eagle3 = _measure_eagle3_level(t, path, workdir, tokenizer_from)
            elif head:
                profile.notes.append(f"no EAGLE-3 level: llama.cpp's {t.arch.name} graph "
                                     "cannot export layer inputs")
        if gpu:
            config = TargetConfig(n_ctx=max(contexts) + 64, n_threads=n_threads,
                                  n_gpu_layers=-1)
            with Target(path, config) as t:
                _measure_curves(t, contexts, profile.gpu_verify_s, profile.gpu_prefill_s,
                                lambda ctx: f"{target.name} on the GPU: verification at "
                                            f"{ctx} tokens", note)
                note(f"{target.name} on the GPU: do verified batches match one token's?")
                probe = probe_exactness(t)
                profile.gpu_exact = probe.exact
                profile.notes.append(f"on the GPU, {probe.describe()}")
    finally:
        path.unlink(missing_ok=True)
    for shape in drafts:
        dpath = workdir / f"{shape.name}.gguf"
        note(f"draft model {shape.name}")
        write_synthetic_gguf(shape, dpath, tokenizer_from)
        try:
            token_s, sync_s = measure_draft_model(dpath, n_threads, PLAN_CONTEXT)
            profile.drafts.append(DraftCost(shape.name, dpath.stat().st_size, token_s, sync_s))
        finally:
            dpath.unlink(missing_ok=True)
    for device in head_devices if head else ():
        note(f"a draft head of width {target.hidden_size} on {device}")
        level, update = measure_head_level(target.hidden_size, target.n_heads,
                                           target.n_kv_heads, target.ffn_size,
                                           target.vocab_size, device=device)
        profile.heads[device] = HeadCost(target.hidden_size, target.vocab_size, level, update)
    return profile


def _measure_curves(target: Target, contexts: tuple[int, ...],
                    verify_s: dict[int, dict[int, float]], prefill_s: dict[int, float],
                    saying: Callable[[int], str], note: Callable[[str], None]) -> None:
    """The verification curve and the prefill at each context, into the two tables."""
    for ctx in contexts:
        note(saying(ctx))
        timings: dict[str, float] = {}
        verify_s[ctx] = measure_verify_curve(target, ctx, VERIFY_SIZES, repeats=3,
                                             timings=timings)
        prefill_s[ctx] = timings["prefill_s"]


def shapes(names: list[str]) -> list[ModelShape]:
    return [shape_named(n) for n in names]
