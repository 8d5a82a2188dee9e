"""Reading a public EAGLE-1 head's ``config.json`` (SafeAILab's layout) as a HeadConfig.

An EAGLE-1 directory holds ``config.json`` (a Hugging Face LlamaConfig with
``num_hidden_layers`` decoder layers, usually 1, plus EAGLE's ``bias`` and ``qkv_bias``)
and its weights in ``model.safetensors`` or ``pytorch_model.bin``. It names no
tokenizer: only its width and vocabulary size can be checked against a target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from models.head_config import HeadConfig

CONFIG = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TANDEM_CONFIG = "head.json"  # a Tandem head's config: that layout wins when both exist


@dataclass(frozen=True)
class Eagle1Config:
    head: HeadConfig  # the head's shape (no target fingerprint: EAGLE-1 names none)
    vocab_size: int  # the target vocabulary the head was trained against
    path: Path  # the config.json read


def is_eagle1_dir(directory: Path) -> bool:
    """Whether ``directory`` is laid out as an EAGLE-1 head (config.json, no head.json)."""
    d = Path(directory)
    return (d / CONFIG).is_file() and not (d / TANDEM_CONFIG).is_file()


def weights_file(directory: Path) -> Path:
    """The checkpoint's weights file. Raises FileNotFoundError naming both names."""
    for name in WEIGHT_FILES:
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    raise FileNotFoundError(f"{directory} has {CONFIG} but neither "
                            f"{' nor '.join(WEIGHT_FILES)}")


def read_eagle1_config(directory: Path) -> Eagle1Config:
    """The head's config. Raises FileNotFoundError when there is no config.json and
    ValueError naming the file and the field when it cannot describe an EAGLE-1 head."""
    path = Path(directory) / CONFIG
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a JSON config ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")

    def need(name: str, kinds: tuple[type, ...], default: object = None) -> object:
        value = data.get(name)
        value = default if value is None else value  # null means LlamaConfig's default
        # bool is an int to Python; a width of true is still wrong.
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            raise ValueError(f"{path}: {name} must be {kinds[-1].__name__}, got {value!r}")
        return value

    def integer(name: str, default: int | None = None) -> int:
        return int(need(name, (int,), default))  # type: ignore[call-overload]

    def number(name: str, default: float) -> float:
        return float(need(name, (int, float), default))  # type: ignore[arg-type]

    def flag(name: str, default: bool) -> bool:
        return bool(need(name, (bool,), default))

    # Only what EAGLE's own code runs and Tandem's head can: a SiLU MLP and plain RoPE
    # (EAGLE's cnets1 also knows linear and dynamic scaling): refused, not ignored.
    if data.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {data['hidden_act']!r} is not supported "
                         "(only silu)")
    if data.get("rope_scaling") is not None:
        raise ValueError(f"{path}: rope_scaling {data['rope_scaling']!r} is not supported")
    n_heads = integer("num_attention_heads")
    try:
        head = HeadConfig(
            hidden_size=integer("hidden_size"), n_heads=n_heads,
            # LlamaConfig's defaults where a key is absent (old Vicuna heads have no
            # num_key_value_heads or rope_theta).
            n_kv_heads=integer("num_key_value_heads", n_heads),
            intermediate_size=integer("intermediate_size"),
            n_layers=integer("num_hidden_layers", 1),
            fusion="fc",
            rms_eps=number("rms_norm_eps", 1e-6),
            rope_theta=number("rope_theta", 10000.0),
            fc_bias=flag("bias", True),  # EAGLE's ea_model: true when the key is absent
            qkv_bias=flag("qkv_bias", False),
        )
    except ValueError as exc:
        if str(path) in str(exc):
            raise
        raise ValueError(f"{path}: {exc}") from exc
    return Eagle1Config(head, integer("vocab_size"), path)
