"""Calibration: what verifying and drafting really cost on this machine.

Measured once per (hardware, model file, head, threads) and cached as JSON, so a second
start is instant; ``recalibrate=True`` measures again. The planner reads the result.

- ``verify_s[n]``: one target decode of ``n`` tokens (the root plus ``n - 1`` drafts) at
  the calibration context, on each device the target may use.
- ``head_level_s[device]``: one drafting level of the head (a forward pass for the
  nodes of the level and their top-k) on each candidate device; ``head_update_s`` the
  head's pass over a step's accepted tokens; ``transfer_s`` moving a step's features to
  the device (zero on the CPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.decoding.budget import MAX_MEMORY_DRAFT, VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.drafters import DrafterSpec, build_drafter, make_drafter
from engine.drafters.kinds import DrafterKind
from engine.drafters.native_head import HeadChainConfig, NativeHeadDrafter
from engine.errors import TandemError
from engine.planning.machine_load import LoadMeter
from engine.planning.measure_progress import MeasureSteps
from engine.runtime.draft_tree import DraftTree
from engine.runtime.target import Target, TargetConfig

if TYPE_CHECKING:
    from models.head_config import TargetFingerprint

CACHE_FILE = "calibration.json"
# How the verification curve is measured; a cached curve measured otherwise is measured
# again.
CURVE_METHOD = "interleaved rounds, monotone"
# Up to a long repeat drafted from memory, verified whole with its root.
VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, MAX_MEMORY_DRAFT + 1)
# What a spot check between answers measures (engine.planning.plan_check).
SPOT_SIZES = (1, 2, 4, 8)
# Repeats of one measurement further apart than this (interquartile range relative to the
# median) are not trusted: a quiet machine stays well under it, one shared with another
# decode well over (docs/benchmarks.md: figures behind the code's rules, "Measuring on a
# busy machine").
SPREAD_LIMIT = 0.2
# Each step's rough share of a measurement's time, for its progress bar (a 2-core CPU,
# the bundled model: the verification curves 4 s, the draft head 5.5 s with its loading,
# the EAGLE-3 head 0.3 s).
VERIFY_WEIGHT, HEAD_WEIGHT, DRAFT_MODEL_WEIGHT, NATIVE_HEAD_WEIGHT = 4.0, 5.0, 2.0, 0.5
# A neutral filler for the calibration context: the cost of a decode depends on how
# many tokens are cached, not on which.
_FILLER = ("The engine measures how long the model takes to check a batch of tokens. "
           "Each measurement is repeated and the median is kept. ")


@dataclass
class CostProfile:
    context: int = 256  # cached tokens during the measurements
    verify_s: dict[str, dict[int, float]] = field(default_factory=dict)  # device -> n -> s
    head_level_s: dict[str, float] = field(default_factory=dict)  # device -> s per level
    head_update_s: dict[str, float] = field(default_factory=dict)  # device -> s per step
    transfer_s: dict[str, float] = field(default_factory=dict)  # device -> s per step
    # A draft model ("cpu" or "gpu"): one token's decode, and a step's extra for catching
    # up on the target's tokens (a 2-token decode less a 1-token one).
    draft_token_s: dict[str, float] = field(default_factory=dict)
    draft_sync_s: dict[str, float] = field(default_factory=dict)
    # The model's own MTP block (where the target runs): a drafted level, and a step's
    # update (the committed tokens through the block, the first draft token's scores).
    mtp_level_s: dict[str, float] = field(default_factory=dict)
    mtp_update_s: dict[str, float] = field(default_factory=dict)
    # An EAGLE-3 head llama.cpp runs beside the target (where the target runs): the same
    # two figures.
    eagle3_level_s: dict[str, float] = field(default_factory=dict)
    eagle3_update_s: dict[str, float] = field(default_factory=dict)
    lookup_step_s: float = 0.0002
    features_overhead: float = 0.0  # extra verify time with features on, relative
    measured_s: float = 0.0  # how long the calibration took
    # The conditions of the measurement (engine.planning.machine_load): when, how many
    # cores other programs used meanwhile, whether that was more than the target left
    # free, and how much the verification repeats disagreed (repeat_spread).
    measured_at: float = 0.0  # seconds since the epoch; 0: before conditions were kept
    others_cores: float = 0.0
    busy: bool = False
    spread: float = 0.0

    @property
    def provisional(self) -> bool:
        """Measured on a busy machine or with repeats too unstable to trust: kept for now,
        measured again when the machine is quiet."""
        return self.busy or self.spread > SPREAD_LIMIT

    def conditions(self) -> str:
        """When and how the costs were measured, in words."""
        when = (time.strftime("%Y-%m-%d %H:%M", time.localtime(self.measured_at))
                if self.measured_at else "at an unrecorded time")
        load = (f"while the machine was busy (other programs used {self.others_cores:.1f} "
                "cores)" if self.busy else
                f"on a quiet machine (other programs used {self.others_cores:.2f} cores)")
        steady = f"repeats within {self.spread:.0%} of each other"
        if self.spread > SPREAD_LIMIT:
            steady = f"repeats unstable ({self.spread:.0%} apart)"
        text = f"measured {when} {load}, {steady}"
        if self.provisional:
            text += "; provisional: measured again when the machine is quiet"
        return text

    def verify(self, device: str, n: int) -> float:
        """Seconds to verify ``n`` tokens on ``device``: on the line through the measured
        sizes around ``n`` (a sparse curve: 1, 2, 4, 8, 16), or through the last two
        beyond them."""
        curve = self.verify_s[device]
        if n in curve:
            return curve[n]
        sizes = sorted(curve)
        if len(sizes) == 1:
            return curve[sizes[0]]
        above = [m for m in sizes if m > n]
        below = [m for m in sizes if m < n]
        if above and below:
            lo, hi = below[-1], above[0]
        elif above:
            lo, hi = sizes[0], sizes[1]
        else:
            lo, hi = sizes[-2], sizes[-1]
        slope = (curve[hi] - curve[lo]) / (hi - lo)
        return curve[lo] + slope * (n - lo)

    def to_json(self) -> dict:
        d = asdict(self)
        d["verify_s"] = {dev: {str(n): t for n, t in c.items()} for dev, c in self.verify_s.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> CostProfile:
        d = dict(d)
        d["verify_s"] = {dev: {int(n): float(t) for n, t in c.items()}
                         for dev, c in d.get("verify_s", {}).items()}
        return cls(**d)


def file_key(path: Path | None) -> str:
    if path is None:
        return "-"
    path = Path(path)
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    parts = []
    for f in files:
        st = f.stat()
        parts.append(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def cache_key(hardware_fingerprint: str, model_path: Path, head_dir: Path | None,
              n_threads: int, target_placements: tuple[str, ...] = ("cpu",),
              head_devices: tuple[str, ...] = (), draft_model: Path | None = None,
              mtp: bool = False, eagle3: Path | None = None,
              kernels: str | None = None) -> str:
    """Changes when the machine, the model file (path, size, modification time), the
    head's files, the draft model's file, the thread count, where the target and head
    were measured, whether the model's MTP block is priced, or the kernels the target
    runs with (``kernels``: None for repacked weights and any batch) change."""
    parts = [hardware_fingerprint, file_key(model_path), file_key(head_dir),
             str(n_threads), ",".join(target_placements), ",".join(head_devices),
             ",".join(map(str, VERIFY_SIZES)),  # a curve of other sizes is measured again
             CURVE_METHOD]
    if draft_model is not None:  # keys without one stay as they were
        parts.append(file_key(draft_model))
    if mtp:
        parts.append("mtp")  # a fixed word of the hashed key, not a drafter's name
    if eagle3 is not None:
        parts.append("eagle3=" + file_key(eagle3))
    if kernels is not None:
        parts.append("kernels=" + kernels)
    text = "\n".join(parts)
    return hashlib.sha256(text.encode()).hexdigest()


class CalibrationCache:
    """Cost profiles by cache key, in one JSON file (written atomically)."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / CACHE_FILE

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def get_entry(self, key: str) -> dict | None:
        """A raw entry (the exactness probe's verdict keeps beside the costs)."""
        entry = self._read().get(key)
        return entry if isinstance(entry, dict) else None

    def put_entry(self, key: str, entry: dict) -> None:
        data = self._read()
        data[key] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.path)

    def get(self, key: str) -> CostProfile | None:
        entry = self._read().get(key)
        if entry is None:
            return None
        try:
            return CostProfile.from_json(entry)
        except (TypeError, ValueError, KeyError):
            return None  # an older format: measure again

    def put(self, key: str, profile: CostProfile) -> None:
        self.put_entry(key, profile.to_json())


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def repeat_spread(samples: Iterable[list[float]]) -> float:
    """The median, over measured quantities, of their repeats' interquartile range
    relative to their median: 0.05 means repeats mostly within 5% of each other."""
    spreads = []
    for times in samples:
        if len(times) >= 3 and statistics.median(times) > 0:
            q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
            spreads.append((q3 - q1) / statistics.median(times))
    return statistics.median(spreads) if spreads else 0.0


def _verifiable_sizes(target: Target, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The sizes the target ever verifies: a hybrid's state snapshots take back so many
    drafts (measuring a bigger batch would evaluate the whole context again), and kernels
    exact only in short batches verify no more."""
    if target.max_draft is None:
        return sizes
    return tuple(n for n in sizes if n - 1 <= target.max_draft) or sizes[:1]


def measure_verify_curve(target: Target, context: int = 256,
                         sizes: tuple[int, ...] = VERIFY_SIZES, repeats: int = 5,
                         timings: dict[str, float] | None = None,
                         on_round: Callable[[float], None] | None = None
                         ) -> dict[int, float]:
    """Median seconds of a verification decode of each size, ``context`` tokens cached.
    The target's cache is left empty. With ``timings`` given, ``timings["prefill_s"]``
    gets the time the context took to prefill (a first token's wait) and
    ``timings["spread"]`` how much the repeats of a size disagreed (the median over sizes
    of their interquartile range relative to their median). ``on_round`` gets the share
    of the rounds done after each."""
    sizes = _verifiable_sizes(target, sizes)
    filler = target.tokenize(_FILLER * (1 + context // 16), special=False)[:context]
    target.reset()
    t0 = time.perf_counter()
    target.prefill(filler)
    if timings is not None:
        timings["prefill_s"] = time.perf_counter() - t0
    times = _time_batches(target, filler[-1], filler[:max(sizes)], sizes, repeats,
                          restore=False, on_round=on_round)
    target.reset()
    if timings is not None:
        timings["spread"] = repeat_spread(times.values())
    return _monotone(times)


def spot_check(target: Target, root: int, tokens: list[int],
               sizes: tuple[int, ...] = SPOT_SIZES, repeats: int = 3) -> dict[int, float]:
    """Median seconds of a verification of each size at the target's present context,
    which is left as it was: ``root`` (not yet cached) and chains of ``tokens``. A few
    hundred milliseconds; the engine runs it when an answer's costs disagreed with the
    calibration, to see the curve's shape (the answer shows only the sizes it drafted)."""
    return _monotone(_time_batches(target, root, tokens, _verifiable_sizes(target, sizes), repeats))


def _time_batches(target: Target, root: int, tokens: list[int], sizes: tuple[int, ...],
                  repeats: int, restore: bool = True,
                  on_round: Callable[[float], None] | None = None
                  ) -> dict[int, list[float]]:
    """Seconds of each repeat of each size: ``root`` and a chain of ``tokens``, verified,
    committed and rolled back to the cache as it was (``restore``; else the caller
    resets it). ``on_round`` gets the share of the rounds done after each."""
    n_keep = target.n_past
    tokens = (tokens * (1 + max(sizes) // max(1, len(tokens))))[:max(sizes)]
    # Recurrent state takes back the drafts of the last batch, never its root: each
    # repeat keeps its root (the context grows by a token), as a rejected draft's step
    # does; going back further would evaluate the whole context again every time.
    keep_roots = target.arch.has_state

    def once(n: int) -> None:
        ver = target.verify(root, DraftTree.chain(tokens[:n - 1]))
        target.commit(ver, [0], [root])
        if not keep_roots:
            target.rollback(n_keep)

    once(max(sizes))  # warm-up (allocations, repacking)
    # Sizes interleaved round by round: on a shared machine a burst of load then slows
    # every size alike instead of bending the curve where it fell (a size measured in a
    # quiet moment looked almost free next to its neighbour, and the budget drafted
    # exactly that many tokens every step).
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for i in range(repeats):
        for n in sizes:
            t0 = time.perf_counter()
            once(n)
            times[n].append(time.perf_counter() - t0)
        if on_round is not None:
            on_round((i + 1) / repeats)
    if keep_roots and restore:
        target.rollback(n_keep)
    return times


def _monotone(times: dict[int, list[float]]) -> dict[int, float]:
    """Medians by size, where a bigger batch never costs less than a smaller one."""
    curve, slowest = {}, 0.0
    for n in sorted(times):
        slowest = max(slowest, statistics.median(times[n]))
        curve[n] = slowest
    return curve


def measure_head(target: Target, head_dir: Path | None, device: str, repeats: int = 5,
                 fingerprint: TargetFingerprint | None = None
                 ) -> tuple[float, float, float]:
    """(seconds per drafting level, per step's update, per feature transfer) of the head
    on ``device``, with the weights the drafter uses there. A level is what each drafted
    token beyond the first adds (a forward pass and the LM head's top-k); the update is
    what every step pays (the pass over 3 accepted tokens and the first token's top-k)."""
    import dataclasses

    import torch

    from engine.drafters.head import HeadDrafter

    # A chain of fixed depth: dynamic depth would stop early on unlikely tokens.
    spec = DrafterSpec(DrafterKind.HEAD_CHAIN, head_dir, device,
                       {"depth": 2, "dynamic_depth": False})
    drafter = build_drafter(spec, target, fingerprint)
    assert isinstance(drafter, HeadDrafter)
    prompt = target.tokenize(_FILLER * 4, special=False)[:64]
    target.reset()
    target.set_features(True)
    try:
        pre = target.prefill(prompt, drafter.prompt_features)
    finally:
        target.set_features(False)
        target.reset()
    drafter.begin(prompt + [prompt[0]], pre.features)
    d = target.n_embd
    step_feats = np.zeros((3, d), np.float32)
    one_level = drafter.config
    root_only = dataclasses.replace(one_level, depth=1)

    def draft(config: object) -> None:
        drafter.config = config  # type: ignore[assignment]
        drafter.draft(1, 0.01)
        sync()

    def update() -> None:
        drafter.accept(prompt[:3], step_feats)
        draft(root_only)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def transfer() -> None:
        torch.from_numpy(step_feats).to(device)
        sync()

    draft(one_level)
    t_root = _median_time(lambda: draft(root_only), repeats)
    t_level = max(0.0, _median_time(lambda: draft(one_level), repeats) - t_root)
    t_update = _median_time(update, repeats)
    t_transfer = 0.0 if device == "cpu" else _median_time(transfer, repeats)
    return t_level, t_update, t_transfer


def measure_draft_model(path: Path, n_threads: int, context: int = 256,
                        n_gpu_layers: int = 0, repeats: int = 5) -> tuple[float, float]:
    """(one token's decode, a step's catching up) of a draft model, ``context`` tokens
    cached, with the K/V types the draft-model drafter uses."""
    config = TargetConfig(n_ctx=context + 64, n_threads=n_threads, n_seq_max=4,
                          type_k="f16", type_v="f16", n_gpu_layers=n_gpu_layers)
    with Target(Path(path), config) as draft:
        curve = measure_verify_curve(draft, context, sizes=(1, 2), repeats=repeats)
    return curve[1], max(0.0, curve[2] - curve[1])


def measure_native_head(drafter: NativeHeadDrafter, target: Target, repeats: int = 5
                        ) -> tuple[float, float]:
    """(seconds per drafted level, per step's update) of a head llama.cpp runs (an EAGLE-3
    head or the model's MTP block), built with a fixed depth of 2. A level is one token
    through the head and its LM head; the update is what every step pays: dropping the
    draft's rows, three committed tokens through the head, the first token's scores."""
    prompt = target.tokenize(_FILLER * 4, special=False)[:64]
    features = np.zeros((drafter.prompt_features, target.feature_width), np.float32)
    drafter.begin(prompt + [prompt[0]], features)
    step_feats = features[:3]

    def draft(depth: int) -> None:
        drafter.drop_draft()  # as accept would (a head with M-RoPE takes no position twice)
        drafter.draft(depth, 0.0)

    draft(2)
    t_root = _median_time(lambda: draft(1), repeats)
    t_level = max(0.0, _median_time(lambda: draft(2), repeats) - t_root)
    t_update = _median_time(lambda: drafter.accept(prompt[:3], step_feats), repeats)
    return t_level, t_update


# A chain of fixed depth: p_min and dynamic depth would stop early on unlikely tokens.
FIXED_CHAIN = HeadChainConfig(depth=2, p_min=0.0, dynamic_depth=False, first_candidates=1)


def measure_mtp(target: Target, repeats: int = 5) -> tuple[float, float]:
    """``measure_native_head`` of the target's MTP block. Raises DrafterUnavailableError
    where the model has no usable block."""
    from engine.drafters.mtp import MtpDrafter

    drafter = MtpDrafter(target, FIXED_CHAIN)
    try:
        return measure_native_head(drafter, target, repeats)
    finally:
        drafter.close()


def measure_eagle3(target: Target, head: Path, repeats: int = 5) -> tuple[float, float]:
    """``measure_native_head`` of an EAGLE-3 head GGUF beside ``target``."""
    from engine.drafters.eagle3 import Eagle3Drafter

    drafter = Eagle3Drafter(head, target, FIXED_CHAIN)
    try:
        return measure_native_head(drafter, target, repeats)
    finally:
        drafter.close()


def calibrate(target: Target, head_dir: Path | None, head_devices: list[str],
              context: int = 256, progress: Callable[[str], None] | None = None,
              fingerprint: TargetFingerprint | None = None,
              draft_model: Path | None = None, draft_on_gpu: bool = False,
              mtp: bool = False, eagle3: Path | None = None,
              then: Sequence[tuple[str, Callable[[CostProfile], None]]] = ()
              ) -> CostProfile:
    """Measure everything the planner needs for ``target`` as it is loaded (and for the
    draft model, on the CPU and, with ``draft_on_gpu``, offloaded; with ``mtp``, the
    model's own MTP block; with ``eagle3``, that EAGLE-3 head), and the conditions of the
    measurement: how busy the machine was, how stable the repeats. ``then``: what the
    caller measures after (what, a function filling the profile), outside the
    conditions. ``progress`` gets a ``Measuring`` value (engine.planning.measure_progress)
    as each step begins and as the verification rounds go, and a last one at 1.0."""
    t0 = time.perf_counter()
    profile = CostProfile(context=context, measured_at=time.time())
    devices = head_devices if head_dir is not None else []
    n_drafts = (2 if draft_on_gpu else 1) if draft_model is not None else 0
    steps = MeasureSteps(progress or (lambda _m: None),
                         [VERIFY_WEIGHT] + [HEAD_WEIGHT] * len(devices)
                         + [DRAFT_MODEL_WEIGHT] * n_drafts
                         + [NATIVE_HEAD_WEIGHT] * (mtp + (eagle3 is not None))
                         + [VERIFY_WEIGHT] * len(then))
    with LoadMeter(target.n_threads) as meter:
        _measure_all(profile, target, head_dir, devices, steps, fingerprint, draft_model,
                     draft_on_gpu)
        # Heads llama.cpp runs beside the target are timed where the target runs.
        device = "gpu" if getattr(target, "n_gpu_layers", 0) else "cpu"
        if mtp:
            steps.begin("the model's MTP block")
            profile.mtp_level_s[device], profile.mtp_update_s[device] = measure_mtp(target)
        if eagle3 is not None:
            steps.begin("the EAGLE-3 head")
            try:
                level, update = measure_eagle3(target, eagle3)
            except TandemError:  # a head this target cannot run is left out
                pass
            else:
                profile.eagle3_level_s[device], profile.eagle3_update_s[device] = level, update
    assert meter.reading is not None
    profile.others_cores, profile.busy = meter.reading.others_cores, meter.reading.busy
    profile.measured_s = time.perf_counter() - t0
    for what, measure in then:
        steps.begin(what)
        measure(profile)
    steps.finish()
    return profile


def _measure_all(profile: CostProfile, target: Target, head_dir: Path | None,
                 head_devices: list[str], steps: MeasureSteps,
                 fingerprint: TargetFingerprint | None, draft_model: Path | None,
                 draft_on_gpu: bool) -> None:
    context = profile.context
    device = "gpu" if getattr(target, "n_gpu_layers", 0) else "cpu"
    steps.begin("target verification cost")
    timings: dict[str, float] = {}
    profile.verify_s[device] = measure_verify_curve(target, context, repeats=7,
                                                    timings=timings, on_round=steps.part)
    profile.spread = timings["spread"]
    target.set_features(True)
    try:
        with_features = measure_verify_curve(target, context, sizes=(1, 4), repeats=5)
    finally:
        target.set_features(False)
    base = profile.verify_s[device]
    # Sizes both curves hold (a target whose kernels verify 3 tokens at most has no 4).
    profile.features_overhead = max(0.0, statistics.fmean(
        with_features[n] / base[n] for n in with_features if n in base) - 1.0)
    if head_dir is not None:
        for dev in head_devices:
            steps.begin(f"draft head on {dev}")
            try:
                lvl, upd, tr = measure_head(target, head_dir, dev, fingerprint=fingerprint)
            except Exception:  # noqa: BLE001 - a device that cannot run the head is skipped
                continue
            profile.head_level_s[dev] = lvl
            profile.head_update_s[dev] = upd
            profile.transfer_s[dev] = tr
    if draft_model is not None:
        for key, layers in (("cpu", 0), ("gpu", -1))[:2 if draft_on_gpu else 1]:
            steps.begin(f"draft model on the {key.upper()}")
            try:
                token_s, sync_s = measure_draft_model(draft_model, target.n_threads,
                                                      context, layers)
            except Exception:  # noqa: BLE001 - a device that cannot take it is left out
                continue
            profile.draft_token_s[key] = token_s
            profile.draft_sync_s[key] = sync_s


def measure_acceptance(target: Target, head_dir: Path | None, prompts: list[list[int]],
                       max_tokens: int = 96, depth: int = 6) -> list[float]:
    """The head's acceptance by depth on real prompts: a_j = P(depth j accepted | depth
    j-1 accepted), from full chains (nothing trimmed) in greedy generations."""
    drafter = make_drafter(DrafterKind.HEAD_CHAIN, target=target, head_dir=head_dir, depth=depth,
                           dynamic_depth=False)  # full chains: every depth measured
    reached = [0] * depth
    accepted = [0] * depth
    for prompt in prompts:
        target.reset()
        out = generate(target, prompt, drafter, GenerationConfig(max_tokens, max_draft=depth),
                       cost=VerifyCostModel(slope=0.0, learn=False))
        for step in out.stats.steps:
            for j in range(min(step.n_proposed, depth)):
                if step.n_accepted >= j:
                    reached[j] += 1
                    accepted[j] += step.n_accepted > j
    target.reset()
    return [a / r if r else 0.0 for a, r in zip(accepted, reached, strict=True)]
