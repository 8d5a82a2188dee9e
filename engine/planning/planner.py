"""The planner: where the target and the draft run, and how much to draft.

It predicts tokens per second for every layout the machine allows, from measured costs
(``engine.planning.calibration``) and the draft's acceptance by depth, and picks the fastest:

- ``dovetail``: target on the CPU (VRAM left over takes target layers when llama.cpp
  can offload), draft head on the GPU; they take turns, the GPU drafts cheaply.
- ``duodecoding``: target offloaded to the GPU, draft head on the CPU, drafting the next
  block while the GPU verifies (in a worker thread; that draft is used when the target
  takes the whole block, so its time is saved in proportion).
- ``cpu``: both on the CPU, in turn, each with all cores.
- A draft language model (a small GGUF of the target's family) is priced the same way:
  its one-token decode is a "level", catching up on what the target committed is the
  per-step cost; it runs on the CPU beside the target (``cpu``), on the GPU with the
  target on the CPU (``dovetail``), or on the CPU with the target on the GPU
  (``duodecoding``, drafting the next chain while the GPU verifies).
- ``plain``: no draft model when none is predicted to gain 5%. Drafts from memory stay
  on (the prompt, the conversation and earlier answers): they cost microseconds when
  nothing matches, and the per-step budget verifies only what pays.

A chain of depth d is worth E(d) = 1 + sum_k prod_{j<=k} a_j tokens per step, where a_j
is the acceptance at depth j; its step costs the draft (update + d levels + feature
transfer) and the verification of 1 + d tokens. Costs not measured on this machine
(a GPU layout llama.cpp cannot run here) are estimated and the plan says so.
Everything here is pure: recorded profiles and cost curves give the same plan anywhere.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.decoding.budget import MAX_DRAFT, MAX_DRAFT_LIMIT, MAX_MEMORY_DRAFT
from engine.drafters.kinds import DrafterKind
from engine.errors import InvalidSettingError
from engine.planning.calibration import CostProfile
from engine.runtime.hardware import HardwareProfile
from engine.runtime.memory_fit import (
    draft_need,
    fits_gpu,
    head_need,
    layers_that_fit,
    target_need,
)
from engine.runtime.model_info import ModelFacts

LAYOUTS = ("dovetail", "duodecoding", "cpu", "plain")
MIN_GAIN = 0.05  # below this predicted gain, drafting is not worth its risk
# Estimates used only when a cost could not be measured here (no such device):
GPU_VERIFY_SHARE = 0.15  # a GPU-resident small model decodes ~7x faster than 2-4 cores
GPU_LEVEL_S = 0.0006  # one head level on a GPU: a few kernel launches
DEFAULT_ACCEPTANCE = (0.45, 0.4, 0.38, 0.36, 0.35, 0.34, 0.33, 0.32)
# A same-family draft model, before this pair has been measured: acceptance of a 0.5-1B
# draft for a 7-8B target at greedy is 0.6-0.8 per token in llama.cpp and vLLM reports
# (drafts-for-real-models.md); the prior sits at the cautious end and a pair's own
# record replaces it (engine.planning.draft_record).
DRAFT_MODEL_ACCEPTANCE = (0.65, 0.62, 0.6, 0.58, 0.56, 0.55, 0.54, 0.53)
# A model's own MTP block, before its answers are measured: trained with the model on its
# own hidden states, it guesses the next token better than a separate draft model (Qwen
# and DeepSeek report 0.8-0.9 for the first), but fed its own output deeper down it
# drifts. A cautious prior; the model's record replaces it (engine.planning.draft_record).
MTP_ACCEPTANCE = (0.7, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.3)
# An EAGLE-3 head, before its answers are measured: public heads reach 3-4 tokens per
# verification on chat (0.7-0.8 per token, drafts-for-real-models.md), fed their own
# guesses they drift; a head that ships its measured acceptance uses that instead.
EAGLE3_ACCEPTANCE = (0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.3, 0.3)

# What runs beside the target, by the plan's drafter (for ``Plan.layout_text``).
BESIDE = {DrafterKind.HEAD: "draft head on {device}",
          DrafterKind.DRAFT: "draft model on {device}",
          DrafterKind.MTP: "drafting with its own MTP block",
          DrafterKind.EAGLE3: "EAGLE-3 head beside it (llama.cpp)"}


@dataclass(frozen=True)
class Budget:
    mode: str = "chain"  # "chain", "tree" (EAGLE-2), "multi" (DuoDecoding) or "memory"
    depth: int = 4  # draft levels
    max_draft: int = MAX_DRAFT  # draft tokens verified per step at most
    top_k: int = 4

    def describe(self) -> str:
        if self.max_draft == 0:
            return "no drafting"
        if self.mode == "memory":
            return (f"drafts from memory: up to {self.max_draft} tokens per step when the "
                    "text repeats the prompt or an earlier answer")
        shape = {"chain": "a chain", "tree": "a tree", "multi": "a chain plus likely "
                 "alternatives"}[self.mode]
        return f"{shape} of depth up to {self.depth}, at most {self.max_draft} tokens per step"


@dataclass(frozen=True)
class HeadFacts:
    size_bytes: int  # weights on disk plus the target matrices it reads
    acceptance: tuple[float, ...] = DEFAULT_ACCEPTANCE  # a_j: accepted at depth j, given j-1

    @classmethod
    def from_dir(cls, head_dir: Path, target_matrices_bytes: int) -> HeadFacts:
        """Size from the files; acceptance from ``acceptance.json`` (measured on real
        chats with the target) when the head ships one."""
        # Tandem's heads and EAGLE-1 checkpoints (safetensors or a torch .bin).
        size = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin")
                   for f in Path(head_dir).glob(pattern))
        acc = DEFAULT_ACCEPTANCE
        path = Path(head_dir) / "acceptance.json"
        if path.is_file():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                acc = tuple(float(a) for a in json.loads(path.read_text())["by_depth"])
        return cls(size + target_matrices_bytes, acc)


@dataclass(frozen=True)
class DraftModelFacts:
    """A draft language model the planner may run: its size and its acceptance by depth
    (the prior, or what this pair reached in earlier conversations)."""

    name: str
    size_bytes: int
    kv_bytes: int = 0
    acceptance: tuple[float, ...] = DRAFT_MODEL_ACCEPTANCE
    acceptance_source: str = "prior"  # or "measured over N drafted steps"


@dataclass(frozen=True)
class MtpFacts:
    """The target's own next-token block: its acceptance by depth (prior or recorded)."""

    acceptance: tuple[float, ...] = MTP_ACCEPTANCE
    acceptance_source: str = "prior"


@dataclass(frozen=True)
class Eagle3Facts:
    """An EAGLE-3 head GGUF that fits the target: its name and acceptance by depth (what
    it ships, the prior, or what this pair reached in earlier answers)."""

    name: str
    acceptance: tuple[float, ...] = EAGLE3_ACCEPTANCE
    acceptance_source: str = "prior"


@dataclass(frozen=True)
class Overrides:
    layout: str | None = None
    max_draft: int | None = None
    depth: int | None = None
    drafter: DrafterKind | None = None  # a kind the planner may choose (or its name)

    def __post_init__(self) -> None:
        if self.drafter is not None:
            try:
                kind = DrafterKind.parse(self.drafter, auto=False, planned=True)
            except ValueError:
                raise InvalidSettingError("drafter", "must be one of " + ", ".join(
                    k for k in DrafterKind if k.planned), self.drafter) from None
            object.__setattr__(self, "drafter", kind)
        if self.layout is not None and self.layout not in LAYOUTS:
            raise InvalidSettingError("layout", f"must be one of {', '.join(LAYOUTS)}",
                                      self.layout)
        if self.max_draft is not None and not 0 <= self.max_draft <= MAX_DRAFT_LIMIT:
            raise InvalidSettingError("max_draft", f"must be between 0 and {MAX_DRAFT_LIMIT} "
                                      "draft tokens", self.max_draft)


@dataclass(frozen=True)
class Candidate:
    layout: str
    drafter: DrafterKind  # a kind the planner may choose (its name is read as it)
    head_device: str  # where the head or the draft model runs
    target_gpu_layers: int
    budget: Budget
    tok_per_s: float
    estimated: bool  # some cost was estimated, not measured

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafter",
                           DrafterKind.parse(self.drafter, auto=False, planned=True))


@dataclass(frozen=True)
class Plan:
    layout: str
    drafter: DrafterKind  # a kind the planner may choose (its name is read as it)
    head_device: str  # where the head or draft model runs: "cpu", "cuda:0", "mps"; "" without
    target_gpu_layers: int
    budget: Budget
    plain_tok_per_s: float
    predicted_tok_per_s: float
    reason: str
    hardware: str
    candidates: tuple[Candidate, ...] = field(default_factory=tuple)
    # Where the target's layers run when workers hold them (HOST:PORT, comma-separated):
    # its costs were measured through them, so the layout's arithmetic is the same.
    target_workers: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafter",
                           DrafterKind.parse(self.drafter, auto=False, planned=True))

    @property
    def runs(self) -> DrafterKind:
        """The drafter the engine runs for this plan: a head is joined by drafts from memory
        (they cost microseconds), except in DuoDecoding, whose drafts ahead are the head's."""
        if self.drafter is DrafterKind.HEAD and self.layout != "duodecoding":
            return DrafterKind.HEAD_MEMORY
        return self.drafter

    @property
    def predicted_speedup(self) -> float:
        return self.predicted_tok_per_s / self.plain_tok_per_s if self.plain_tok_per_s else 1.0

    def layout_text(self) -> str:
        target = ("target on the CPU" if self.target_gpu_layers == 0 else
                  "target on the GPU" if self.target_gpu_layers < 0 else
                  f"target on the CPU with {self.target_gpu_layers} layers on the GPU")
        if self.target_workers:
            target = f"target on workers {self.target_workers}"
        if self.drafter in BESIDE:
            beside = BESIDE[self.drafter].format(device=self.head_device)
            return f"{self.layout}: {target}, {beside}"
        extra = ""
        if self.drafter is DrafterKind.MEMORY:
            extra = " with drafts from memory" if self.budget.max_draft else ", nothing drafted"
        return f"{self.layout}: {target}{extra}"

    def to_json(self) -> dict:
        d = asdict(self)
        d["predicted_speedup"] = self.predicted_speedup
        d["runs"] = self.runs
        d["layout_text"] = self.layout_text()
        return d

    def describe(self) -> str:
        lines = [f"Hardware: {self.hardware}",
                 f"Layout:   {self.layout_text()}",
                 f"Budget:   {self.budget.describe()}",
                 f"Expected: {self.predicted_tok_per_s:.0f} tok/s vs "
                 f"{self.plain_tok_per_s:.0f} plain ({self.predicted_speedup:.2f}x)",
                 f"Why:      {self.reason}"]
        return "\n".join(lines)


def expected_tokens(acceptance: tuple[float, ...], depth: int) -> float:
    """Tokens per verification of a chain of ``depth`` (the target's own token included)."""
    total, p = 1.0, 1.0
    for j in range(depth):
        p *= acceptance[min(j, len(acceptance) - 1)]
        total += p
    return total


def _verify_time(costs: CostProfile, on_gpu: float, n: int) -> tuple[float, bool]:
    """Verification seconds with a share ``on_gpu`` of the target's layers on the GPU."""
    cpu = costs.verify("cpu", n) if "cpu" in costs.verify_s else None
    if on_gpu >= 1.0 and "gpu" in costs.verify_s:
        return costs.verify("gpu", n), False
    if cpu is None:
        raise ValueError("no measured verification cost on the CPU")
    if on_gpu <= 0:
        return cpu, False
    # Offloaded layers run at GPU speed (measured with the whole target on the GPU when
    # calibration could), the rest at CPU speed.
    if "gpu" in costs.verify_s:
        return (1 - on_gpu) * cpu + on_gpu * costs.verify("gpu", n), False
    gpu_part = costs.verify("cpu", 1) * GPU_VERIFY_SHARE
    return (1 - on_gpu) * cpu + on_gpu * gpu_part, True


def _head_costs(costs: CostProfile, device: str) -> tuple[float, float, bool]:
    """(per level, per step: update + transfer, estimated?) for the head on ``device``."""
    key = "cpu" if device == "cpu" else device.split(":")[0] if device != "mps" else "mps"
    for k in (device, key):
        if k in costs.head_level_s:
            return costs.head_level_s[k], costs.head_update_s[k] + costs.transfer_s.get(k, 0), False
    if device == "cpu":
        raise KeyError("cpu")
    return GPU_LEVEL_S, 2 * GPU_LEVEL_S, True


def _best_chain(acceptance: tuple[float, ...], level_s: float, per_step_s: float,
                verify: callable, overlap: bool, max_draft: int, depth_cap: int
                ) -> tuple[int, float]:
    """(depth, tok/s) of the best chain depth under the costs.

    With ``overlap`` (DuoDecoding) the head drafts the next chain during verification,
    guessing that the target takes the whole chain and which token it adds; that draft
    replaces the next step's when the guess holds (probability ``hit``). The step then
    costs the slower of verification and drafting ahead, plus the ordinary draft of
    the steps where the guess failed."""
    best = (0, 0.0)
    for d in range(1, min(max_draft, depth_cap) + 1):
        t_draft = per_step_s + d * level_s
        t_verify = verify(1 + d)
        if overlap:
            hit = math.prod(acceptance[min(j, len(acceptance) - 1)] for j in range(d + 1))
            step = max(t_verify, (d + 1) * level_s) + (1 - hit) * t_draft
        else:
            step = t_draft + t_verify
        rate = expected_tokens(acceptance, d) / step
        if rate > best[1]:
            best = (d, rate)
    return best


def _layout_placements(hw: HardwareProfile, model: ModelFacts, head: HeadFacts | None
                       ) -> list[tuple[str, str, int, float]]:
    """(layout, head device, target GPU layers (-1: all), share of layers on GPU) the
    machine allows."""
    out: list[tuple[str, str, int, float]] = [("cpu", "cpu", 0, 0.0)]
    gpu = hw.best_gpu
    if gpu is None:
        return out
    target_fits = fits_gpu(target_need(model.size_bytes, model.kv_bytes), gpu.free_bytes)
    head_bytes = head_need(head.size_bytes) if head else 0
    if head_bytes and fits_gpu(head_bytes, gpu.free_bytes):
        layers, share = 0, 0.0
        if hw.llama_gpu_offload and model.exact_on_gpu:
            layers = layers_that_fit(model.size_bytes, model.kv_bytes, model.n_layers,
                                     gpu.free_bytes - head_bytes)
            share = layers / max(1, model.n_layers)
            layers = -1 if layers >= model.n_layers else layers
        out.append(("dovetail", gpu.device, layers, share))
    if hw.llama_gpu_offload and model.exact_on_gpu and target_fits:
        out.append(("duodecoding", "cpu", -1, 1.0))
    return out


def _draft_placements(hw: HardwareProfile, model: ModelFacts, draft: DraftModelFacts
                      ) -> list[tuple[str, str, int, float]]:
    """(layout, draft device, target GPU layers (-1: all), share of layers on GPU) for a
    draft model: llama.cpp runs it, so a GPU place needs a build that offloads."""
    out: list[tuple[str, str, int, float]] = [("cpu", "cpu", 0, 0.0)]
    gpu = hw.best_gpu
    if gpu is None or not hw.llama_gpu_offload:
        return out
    need_draft = draft_need(draft.size_bytes, draft.kv_bytes)
    if fits_gpu(need_draft, gpu.free_bytes):
        layers = layers_that_fit(model.size_bytes, model.kv_bytes, model.n_layers,
                                 gpu.free_bytes - need_draft)
        if not model.exact_on_gpu:  # verification stays on the CPU
            layers = 0
        share = layers / max(1, model.n_layers)
        out.append(("dovetail", gpu.device, -1 if layers >= model.n_layers else layers,
                    share))
    if model.exact_on_gpu and fits_gpu(target_need(model.size_bytes, model.kv_bytes),
                                       gpu.free_bytes):
        out.append(("duodecoding", "cpu", -1, 1.0))
    return out


def _draft_model_costs(costs: CostProfile, device: str) -> tuple[float, float, bool]:
    """(one draft token, per step: catching up on the committed tokens, estimated?) of
    the draft model on ``device``. Raises KeyError when nothing was measured for it."""
    key = "cpu" if device == "cpu" else "gpu"
    if key in costs.draft_token_s:
        return costs.draft_token_s[key], costs.draft_sync_s.get(key, 0.0), False
    if key == "cpu":
        raise KeyError("cpu")
    cpu = costs.draft_token_s["cpu"]
    return cpu * GPU_VERIFY_SHARE, costs.draft_sync_s.get("cpu", 0.0) * GPU_VERIFY_SHARE, True


def _draft_candidates(hw: HardwareProfile, costs: CostProfile, model: ModelFacts,
                      draft: DraftModelFacts, max_draft: int, depth_cap: int
                      ) -> list[Candidate]:
    """The best chain of the draft model in every place it can run. Each step costs
    catching up (a decode of the tokens the target added) and one decode per drafted
    token after the first; the draft model's multi-sequence drafting adds side
    sequences within the same decodes, so the chain's price is the step's price."""
    out = []
    for layout, device, layers, share in _draft_placements(hw, model, draft):
        try:
            token_s, sync_s, est = _draft_model_costs(costs, device)
        except KeyError:
            continue
        est_v = _verify_time(costs, share, 1)[1]

        def verify(n: int, share: float = share) -> float:
            return _verify_time(costs, share, n)[0]

        # On the CPU beside a GPU target, it drafts the next chain during verification.
        depth, rate = _best_chain(draft.acceptance, token_s, sync_s, verify,
                                  layout == "duodecoding", max_draft, depth_cap)
        if depth:
            out.append(Candidate(layout, DrafterKind.DRAFT, device, layers,
                                 Budget(mode="multi", depth=depth,
                                        max_draft=min(max_draft, depth + 3)),
                                 rate, est or est_v))
    return out


def _native_chain_candidate(costs: CostProfile, drafter: DrafterKind, level_s: dict[str, float],
                            update_s: dict[str, float], acceptance: tuple[float, ...],
                            max_draft: int, depth_cap: int) -> Candidate | None:
    """A head llama.cpp runs beside the target, where the target was measured (on the
    CPU): the model's MTP block or an EAGLE-3 head. It takes turns with the target, each
    step paying its update, its levels and a verification with features exported."""
    if "cpu" not in level_s or "cpu" not in costs.verify_s:
        return None
    overhead = 1 + costs.features_overhead  # the target exports its hidden states

    def verify(n: int) -> float:
        return costs.verify("cpu", n) * overhead

    depth, rate = _best_chain(acceptance, level_s["cpu"], update_s.get("cpu", 0.0), verify,
                              False, max_draft, depth_cap)
    if not depth:
        return None
    return Candidate("cpu", drafter, "cpu", 0,
                     Budget(mode="chain", depth=depth, max_draft=min(max_draft, depth + 2)),
                     rate, False)


def choose_plan(hw: HardwareProfile, costs: CostProfile, model: ModelFacts,
                head: HeadFacts | None, overrides: Overrides | None = None,
                draft: DraftModelFacts | None = None, mtp: MtpFacts | None = None,
                eagle3: Eagle3Facts | None = None) -> Plan:
    """The fastest predicted layout and drafter (draft head, draft model, the model's own
    MTP block, an EAGLE-3 head, or plain decoding with drafts from memory) and its budget,
    honouring ``overrides``."""
    ov = overrides or Overrides()
    max_draft = MAX_DRAFT if ov.max_draft is None else ov.max_draft
    if model.max_draft is not None:  # a hybrid's state takes back so many at most
        max_draft = min(max_draft, model.max_draft)
    depth_cap = ov.depth or MAX_DRAFT
    placements = _layout_placements(hw, model, head)
    # Plain decoding on the best placement of the target alone.
    plain_options = [(0, 0.0)]
    if hw.best_gpu and hw.llama_gpu_offload and fits_gpu(
            target_need(model.size_bytes, model.kv_bytes), hw.best_gpu.free_bytes):
        plain_options.append((-1, 1.0))
    plain_layers, plain_share = min(
        plain_options, key=lambda o: _verify_time(costs, o[1], 1)[0])
    t1, plain_est = _verify_time(costs, plain_share, 1)
    plain_rate = 1.0 / t1
    memory_draft = MAX_MEMORY_DRAFT if ov.max_draft is None else ov.max_draft
    if model.max_draft is not None:
        memory_draft = min(memory_draft, model.max_draft)
    if plain_layers != 0 and not model.exact_on_gpu:
        memory_draft = 0  # its drafts would be verified on the GPU: plain decoding there
    candidates = [Candidate("plain", DrafterKind.MEMORY, "", plain_layers,
                            Budget(mode="memory", max_draft=memory_draft),
                            plain_rate, plain_est)]
    if head is not None and max_draft > 0 and ov.drafter in (None, DrafterKind.HEAD):
        for layout, device, layers, share in placements:
            try:
                level_s, per_step_s, est_head = _head_costs(costs, device)
            except KeyError:
                continue
            overhead = 1 + costs.features_overhead
            est_v = _verify_time(costs, share, 1)[1]

            def verify(n: int, share: float = share, overhead: float = overhead) -> float:
                return _verify_time(costs, share, n)[0] * overhead

            overlap = layout == "duodecoding"
            depth, rate = _best_chain(head.acceptance, level_s, per_step_s, verify, overlap,
                                      max_draft, depth_cap)
            if depth == 0:
                continue
            mode = "multi" if overlap else "chain"
            candidates.append(Candidate(layout, DrafterKind.HEAD, device, layers,
                                        Budget(mode=mode, depth=depth,
                                               max_draft=min(max_draft, depth + 3)),
                                        rate, est_head or est_v))
    if draft is not None and max_draft > 0 and ov.drafter in (None, DrafterKind.DRAFT):
        candidates += _draft_candidates(hw, costs, model, draft, max_draft, depth_cap)
    if mtp is not None and max_draft > 0 and ov.drafter in (None, DrafterKind.MTP):
        candidates += [c for c in [_native_chain_candidate(
            costs, DrafterKind.MTP, costs.mtp_level_s, costs.mtp_update_s, mtp.acceptance,
            max_draft, depth_cap)] if c]
    if eagle3 is not None and max_draft > 0 and ov.drafter in (None, DrafterKind.EAGLE3):
        candidates += [c for c in [_native_chain_candidate(
            costs, DrafterKind.EAGLE3, costs.eagle3_level_s, costs.eagle3_update_s,
            eagle3.acceptance, max_draft, depth_cap)] if c]
    allowed = [c for c in candidates if ov.layout in (None, c.layout)]
    if ov.drafter is DrafterKind.NONE:
        allowed = [c for c in allowed if c.layout == "plain"]
    if not allowed:
        raise ValueError(f"the layout {ov.layout!r} is not possible here: "
                         + _why_not(ov.layout, hw, head, draft))
    best = max(allowed, key=lambda c: c.tok_per_s)
    speculative = [c for c in candidates if c.drafter.costly]
    if ov.layout is None and best.drafter is not DrafterKind.MEMORY and (
            best.tok_per_s < (1 + MIN_GAIN) * plain_rate):
        best = candidates[0]
    plain_what = " with drafts from memory"
    if memory_draft == 0 and plain_layers != 0:
        plain_what = (", nothing drafted (on this GPU a verified batch's logits differ from "
                      "one-token decoding's: drafts checked there could change the answer)")
    reason = _reason(best, plain_rate, speculative, ov, head, draft, mtp, eagle3, plain_what)
    drafter = ov.drafter if ov.drafter in (DrafterKind.NONE, DrafterKind.MEMORY) \
        else best.drafter
    return Plan(layout=best.layout, drafter=drafter, head_device=best.head_device,
                target_gpu_layers=best.target_gpu_layers,
                budget=best.budget if drafter.drafts else Budget(max_draft=0),
                plain_tok_per_s=plain_rate, predicted_tok_per_s=best.tok_per_s,
                reason=reason, hardware=hw.describe(), candidates=tuple(candidates))


def _why_not(layout: str | None, hw: HardwareProfile, head: HeadFacts | None,
             draft: DraftModelFacts | None = None) -> str:
    if head is None and draft is None:
        return "there is no draft head or draft model for this model"
    if not hw.has_gpu:
        return "this machine has no GPU that torch can use"
    if layout == "duodecoding" and not hw.llama_gpu_offload:
        return "the installed llama.cpp cannot offload to a GPU"
    return "the model does not fit in the GPU's free memory"


def _reason(best: Candidate, plain_rate: float, speculative: list[Candidate],
            ov: Overrides, head: HeadFacts | None, draft: DraftModelFacts | None,
            mtp: MtpFacts | None = None, eagle3: Eagle3Facts | None = None,
            plain_what: str = " with drafts from memory") -> str:
    if ov.layout or ov.drafter:
        chosen = ", ".join(f"{k}={v}" for k, v in asdict(ov).items() if v is not None)
        return f"as you asked ({chosen})."
    est = " (GPU costs estimated: not measurable here)" if best.estimated else ""
    if best.drafter.costly:
        what = {DrafterKind.HEAD: "the draft head", DrafterKind.MTP: "the model's MTP block",
                DrafterKind.EAGLE3: f"the EAGLE-3 head {eagle3.name if eagle3 else ''}",
                DrafterKind.DRAFT: f"the draft model {draft.name if draft else ''}"
                }[best.drafter]
        assumed = ""
        told = {DrafterKind.DRAFT: draft, DrafterKind.MTP: mtp,
                DrafterKind.EAGLE3: eagle3}.get(best.drafter)
        if told is not None:
            assumed = (f"; acceptance {told.acceptance[0]:.2f} at the first token, "
                       f"{told.acceptance_source}")
        return (f"{best.layout} with {what} is predicted {best.tok_per_s / plain_rate:.2f}x "
                f"plain decoding with a chain of depth {best.budget.depth}, the best of "
                f"{len(speculative)} option(s){assumed}{est}.")
    if head is None and draft is None and mtp is None and eagle3 is None:
        return f"no draft head or draft model matches this model: plain decoding{plain_what}."
    if not speculative:
        return "the draft cannot run on any device here: plain decoding."
    top = max(speculative, key=lambda c: c.tok_per_s)
    what = {DrafterKind.HEAD: "draft-head", DrafterKind.DRAFT: "draft-model",
            DrafterKind.MTP: "MTP", DrafterKind.EAGLE3: "EAGLE-3"}[top.drafter]
    return (f"the best {what} layout ({top.layout}, depth {top.budget.depth}) is "
            f"predicted {top.tok_per_s / plain_rate:.2f}x plain decoding, under the "
            f"{1 + MIN_GAIN:.2f}x it takes to pay: drafting costs more than it saves on "
            f"this machine. Plain decoding{plain_what}{est}.")
