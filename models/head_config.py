"""Configuration of a draft head, saved beside its weights so a checkpoint describes itself."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TargetFingerprint:
    """What a head must match in its target: a head trained for one model is refused by
    another, with both values named."""

    vocab_size: int
    hidden_size: int
    tokenizer_sha256: str  # hash of the target's token pieces, in id order

    def differences(self, other: TargetFingerprint) -> list[tuple[str, object, object]]:
        """(field, this value, the other's value) for each field that differs."""
        return [(name, getattr(self, name), getattr(other, name))
                for name in ("vocab_size", "hidden_size", "tokenizer_sha256")
                if getattr(self, name) != getattr(other, name)]


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    n_layers: int = 1  # Dovetail's m: decoder blocks after the fusion
    fusion: str = "dgf"  # "dgf" (Dynamic Gating Fusion) or "fc" (EAGLE-1)
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    draft_vocab_size: int = 0  # 0: the target's full vocabulary
    target: TargetFingerprint | None = field(default=None)
    # EAGLE-1 checkpoints differ here: Llama-3 heads have no fc bias ("bias": false),
    # Qwen2 heads have q/k/v biases ("qkv_bias"). The defaults are Tandem's own heads.
    fc_bias: bool = True
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        if self.fusion not in ("dgf", "fc"):
            raise ValueError(f"fusion must be 'dgf' or 'fc', got {self.fusion!r}")
        if self.hidden_size % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError("hidden_size must split into n_heads, n_heads into n_kv_heads")
        if self.n_layers < 1:
            raise ValueError("a head needs at least one decoder block")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> HeadConfig:
        data = json.loads(text)
        target = data.pop("target", None)
        return cls(**data, target=TargetFingerprint(**target) if target else None)

    def save(self, path: Path) -> None:
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> HeadConfig:
        return cls.from_json(path.read_text())
