"""Every drafter Tandem has, once: ``DrafterKind``, the one vocabulary the CLI, the
settings, the plan, the engine and the window speak.

A kind's value is the name users type and files hold (``--drafter head``, the window's
saved setting, a plan's JSON): a ``StrEnum``, so it prints, compares and serialises as
that name, and ``DrafterKind.parse`` reads a name back (a kind, or an error naming the
choices). Each kind carries what the rest of the code asks about it: the label a user
reads, what it needs, whether llama.cpp runs it beside the target, whether it is a
variant of Tandem's torch head, whether it drafts from the model's memory of earlier
answers, whether drafting costs real time, whether the planner may choose it, and the
record its answers correct. How a kind is built: ``engine.drafters.factory``; how the
planner prices the kinds it chooses from: ``engine.planning.planner`` (costs measured by
``engine.planning.calibration``).

``AUTO`` is no drafter: it is the choice of letting the planner pick one (the engine's
``--drafter auto``); a ``DrafterSpec`` refuses it.

Plans and specs always used these names (there are no old names to map); a name that
is not a kind is refused when it is parsed, naming the kinds.

May import: nothing of Tandem (every room reads it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, StrEnum


class Need(Enum):
    """What a drafter needs besides the tokens (its value says it in words)."""

    TARGET = "the target model loaded (its features, vocabulary or weights)"
    TORCH = "torch installed"
    HEAD_DIR = "a draft head folder that fits the target (head.json and its weights)"
    DRAFT_GGUF = "a draft model GGUF that shares the target's vocabulary (--draft-model)"
    EAGLE3_GGUF = "an EAGLE-3 head GGUF that fits the target (imported or bundled)"
    MTP_BLOCK = "the target's own MTP block (nextn layers in its GGUF)"
    TARGET_LM_HEAD = "the target's LM head on this machine (not on workers)"
    MEMORY = "the model's memory of earlier answers (one file per model)"


class Record(Enum):
    """Whose acceptance record a drafter's answers correct (engine.planning.draft_record)."""

    PAIR = "the target with the drafter's file"
    OWN = "the target alone (its own block)"


@dataclass(frozen=True)
class _Traits:
    label: str  # what a user reads (the window's selector, tandem models drafters)
    drafting: str = ""  # the plan in words: "Drafting with ..." ("" for no drafting)
    needs: frozenset[Need] = frozenset()
    native: str = ""  # what llama.cpp runs beside the target, in words; "" if Tandem's own
    head: bool = False  # a variant of Tandem's torch draft head (device, then CPU, fallback)
    uses_memory: bool = False  # drafts from the model's memory (long drafts pay)
    costly: bool = False  # drafting costs real time (a head or a draft model)
    planned: bool = False  # the planner may choose it (Plan.drafter, Overrides.drafter)
    record: Record | None = None
    # A head variant's options: defaults the asked options override, and options that
    # override the asked ones (engine.drafters.head.HeadDrafterConfig's fields).
    head_defaults: tuple[tuple[str, object], ...] = ()
    head_forced: tuple[tuple[str, object], ...] = ()


_HEAD = frozenset({Need.TARGET, Need.TORCH, Need.HEAD_DIR})


class DrafterKind(StrEnum):
    """One drafter (or ``AUTO``, the planner's choice), named as users name it."""

    label: str
    drafting: str
    needs: frozenset[Need]
    native: str
    head: bool
    uses_memory: bool
    costly: bool
    planned: bool
    record: Record | None
    _traits: _Traits

    def __new__(cls, name: str, traits: _Traits) -> DrafterKind:
        kind = str.__new__(cls, name)
        kind._value_ = name
        kind._traits = traits
        for field in ("label", "drafting", "needs", "native", "head", "uses_memory",
                      "costly", "planned", "record"):
            setattr(kind, field, getattr(traits, field))
        return kind

    AUTO = "auto", _Traits("Auto (the planner decides)")
    NONE = "none", _Traits("None (plain decoding)", planned=True)
    MEMORY = "memory", _Traits("Drafts from memory", "Drafting from earlier answers",
                               frozenset({Need.MEMORY}), uses_memory=True, planned=True)
    LOOKUP = "lookup", _Traits("Prompt lookup", "Drafting from the conversation's own text")
    HEAD = "head", _Traits("Draft head (torch)", "Drafting with the draft head", _HEAD,
                           head=True, costly=True, planned=True)
    HEAD_CHAIN = "head-chain", _Traits(
        "Draft head, one chain (torch)", "Drafting with the draft head", _HEAD, head=True,
        costly=True, head_forced=(("mode", "chain"),))
    HEAD_MULTI = "head-multi", _Traits(
        "Draft head, a chain and likely alternatives (torch)", "Drafting with the draft head",
        _HEAD, head=True, costly=True, head_forced=(("mode", "multi"),))
    HEAD_AHEAD = "head-ahead", _Traits(
        "Draft head, drafting ahead (torch)",
        "Drafting with the draft head, ahead of the model", _HEAD, head=True, costly=True,
        head_defaults=(("mode", "chain"), ("draft_ahead", True)))
    # The head's tree and the memory's as one draft (engine.drafters.merged).
    HEAD_MEMORY = "head+memory", _Traits(
        "Draft head and drafts from memory (torch)",
        "Drafting with the draft head and earlier answers", _HEAD | {Need.MEMORY},
        head=True, uses_memory=True, costly=True)
    DRAFT = "draft", _Traits("Draft model", "Drafting with a small draft model",
                             frozenset({Need.TARGET, Need.DRAFT_GGUF}), native="draft model",
                             costly=True, planned=True, record=Record.PAIR)
    # An EAGLE-3 head GGUF run by llama.cpp (engine.drafters.eagle3); it reads the
    # target's LM head, so that stays here when workers hold the layers.
    EAGLE3 = "eagle3", _Traits("EAGLE-3 head (llama.cpp)", "Drafting with an EAGLE-3 head",
                               frozenset({Need.TARGET, Need.EAGLE3_GGUF, Need.TARGET_LM_HEAD}),
                               native="EAGLE-3 head", costly=True, planned=True,
                               record=Record.PAIR)
    # The target GGUF's own next-token block (engine.drafters.mtp).
    MTP = "mtp", _Traits("MTP block (in the model)",
                         "Drafting with the model's own next-token layers",
                         frozenset({Need.TARGET, Need.MTP_BLOCK}), native="MTP block",
                         costly=True, planned=True, record=Record.OWN)

    # --- reading names -----------------------------------------------------------------
    @classmethod
    def parse(cls, value: str, *, auto: bool = True, planned: bool = False) -> DrafterKind:
        """The kind named ``value`` (a kind passes through). Raises ValueError naming the
        choices for any other name; for ``auto`` when ``auto`` is False; for a kind the
        planner does not choose when ``planned``."""
        kind = cls.of(value)
        choices = [k for k in cls if (auto or k is not cls.AUTO) and (k.planned or not planned)]
        if kind not in choices:
            what = "unknown drafter" if kind is None else "not a drafter to choose here:"
            raise ValueError(f"{what} {str(value)!r}; choose from {', '.join(choices)}")
        return kind  # type: ignore[return-value]

    @classmethod
    def of(cls, value: object) -> DrafterKind | None:
        """The kind named ``value``, or None (a name from elsewhere: a test's drafter)."""
        try:
            return cls(value)
        except ValueError:
            return None

    # --- what follows from the traits --------------------------------------------------
    @property
    def drafts(self) -> bool:
        """Whether it drafts at all (not plain decoding; ``AUTO`` may)."""
        return self is not DrafterKind.NONE

    @property
    def opens_memory(self) -> bool:
        """Whether the engine opens the model's memory for it: it drafts from it, or
        falls back to drafts from it (a head or a llama.cpp drafter that cannot run)."""
        return self.uses_memory or self.head or bool(self.native)

    def head_options(self, asked: Mapping[str, object]) -> dict[str, object]:
        """A head variant's options: its defaults, the ``asked`` ones, its own."""
        traits = self._traits
        return {**dict(traits.head_defaults), **asked, **dict(traits.head_forced)}


# Every drafter's name (a DrafterSpec's), in the CLI's order; with "auto" first, what
# --drafter and the engine accept.
DRAFTER_NAMES: tuple[str, ...] = tuple(k.value for k in DrafterKind if k is not DrafterKind.AUTO)
CHOICES: tuple[str, ...] = (DrafterKind.AUTO.value, *DRAFTER_NAMES)
HEAD_DRAFTERS: tuple[str, ...] = tuple(k.value for k in DrafterKind if k.head)
# What the app's selector offers, in its order (``tandem models drafters`` and the
# selector's tooltips use the same labels).
OFFERED: tuple[DrafterKind, ...] = (
    DrafterKind.AUTO, DrafterKind.HEAD, DrafterKind.DRAFT, DrafterKind.EAGLE3,
    DrafterKind.MTP, DrafterKind.MEMORY, DrafterKind.LOOKUP, DrafterKind.NONE)
OFFERED_DRAFTERS: tuple[str, ...] = tuple(k.value for k in OFFERED)
DRAFTER_LABELS: dict[str, str] = {k.value: k.label for k in OFFERED}


def is_plain(name: str) -> bool:
    """Whether a drafter's name (an engine's ``drafter_name``, an answer's stats) means
    plain decoding."""
    return DrafterKind.of(name) is DrafterKind.NONE


__all__ = ["CHOICES", "DRAFTER_LABELS", "DRAFTER_NAMES", "HEAD_DRAFTERS", "OFFERED",
           "OFFERED_DRAFTERS", "DrafterKind", "Need", "Record", "is_plain"]
