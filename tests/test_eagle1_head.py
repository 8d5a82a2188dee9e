"""Public EAGLE-1 heads (SafeAILab's layout: config.json + model.safetensors or
pytorch_model.bin) load wherever a head directory is accepted, on the real bundled model.

No real EAGLE head can be downloaded here, so the checkpoints are written in exactly the
published layout for the bundled model's shape, with EAGLE's tensor names spelled out
below (not taken from the loader's mapping). What is proved: the logits equal both the
equivalent DraftHead and an independent transcription of EAGLE's cnets1 forward (concat
order, fc and q/k/v biases, no input or final norm); greedy output through the engine's
drafter factory equals plain decoding; bad checkpoints are refused naming the field,
file and tensor, and the engine falls back with a note.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.drafters import DEFAULT_HEAD_DIR, DrafterSpec, open_drafter, target_fingerprint
from engine.drafters.head import (
    HeadDrafter,
    cached_target_for_head,
    check_head_fits,
    load_head_drafter,
)
from engine.drafters.memory import MemoryDrafter
from engine.errors import IncompatibleDraftError
from models.draft_head import DraftHead
from models.eagle1_io import load_eagle1
from models.gguf_weights import read_facts
from models.head_config import HeadConfig
from models.head_io import load_head
from tests.conftest import drafted_equals_plain, pick_per_category, plain_answers

MAX_TOKENS = 40


# --- writing a checkpoint as SafeAILab publishes it ------------------------------------
def eagle1_config(cfg: HeadConfig, vocab_size: int, bias: bool | None,
                  qkv_bias: bool | None) -> dict:
    """config.json of an EAGLE-1 head: a LlamaConfig plus "bias"/"qkv_bias" (absent
    keys as in the published files: no "bias" means an fc bias)."""
    data = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_act": "silu", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_eps,
            "rope_theta": cfg.rope_theta, "vocab_size": vocab_size,
            "max_position_embeddings": 2048, "torch_dtype": "float16",
            "tie_word_embeddings": False}
    if bias is not None:
        data["bias"] = bias
    if qkv_bias is not None:
        data["qkv_bias"] = qkv_bias
    return data


def eagle1_tensors(head: DraftHead) -> dict[str, torch.Tensor]:
    """The head's weights under EAGLE-1's names (cnets1.Model's state dict)."""
    fc, blk = head.fusion.fc, head.blocks[0]
    out = {"fc.weight": fc.weight,
           "layers.0.self_attn.q_proj.weight": blk.q.weight,
           "layers.0.self_attn.k_proj.weight": blk.k.weight,
           "layers.0.self_attn.v_proj.weight": blk.v.weight,
           "layers.0.self_attn.o_proj.weight": blk.o.weight,
           "layers.0.mlp.gate_proj.weight": blk.gate.weight,
           "layers.0.mlp.up_proj.weight": blk.up.weight,
           "layers.0.mlp.down_proj.weight": blk.down.weight,
           "layers.0.post_attention_layernorm.weight": blk.post_norm.weight}
    if fc.bias is not None:
        out["fc.bias"] = fc.bias
    if blk.q.bias is not None:
        out.update({"layers.0.self_attn.q_proj.bias": blk.q.bias,
                    "layers.0.self_attn.k_proj.bias": blk.k.bias,
                    "layers.0.self_attn.v_proj.bias": blk.v.bias})
    return {k: v.detach().half().contiguous() for k, v in out.items()}  # shipped in fp16


def write_eagle1(directory: Path, tensors: dict[str, torch.Tensor], config: dict,
                 fmt: str = "safetensors") -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if fmt == "safetensors":
        save_file(tensors, str(directory / "model.safetensors"))
    else:
        torch.save(tensors, directory / "pytorch_model.bin")
    return directory


def fp16_rounded(head: DraftHead) -> DraftHead:
    """The head with its weights as they come back from an fp16 checkpoint."""
    head.load_state_dict({k: v.half().float() if v.is_floating_point() else v
                          for k, v in head.state_dict().items()})
    return head


# --- an independent transcription of EAGLE-1's forward (cnets1.py) --------------------
def eagle1_reference_logits(t: dict[str, torch.Tensor], cfg: dict, feats: torch.Tensor,
                            tokens: torch.Tensor, embed: torch.Tensor,
                            lm_head: torch.Tensor) -> torch.Tensor:
    """Model.forward of cnets1 for one sequence at positions 0..T-1, then the target's
    lm_head on its output (ea_model passes base_model.lm_head as the head)."""
    t = {k: v.double() for k, v in t.items()}
    d, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, n = d // nh, len(tokens)

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        b = t.get(f"{name}.bias")
        return x @ t[f"{name}.weight"].T + (0 if b is None else b)

    x = linear(torch.cat([embed[tokens].double(), feats.double()], -1), "fc")
    # layer 0: no input_layernorm
    a = "layers.0.self_attn."
    q = linear(x, a + "q_proj").view(n, nh, hd).transpose(0, 1)
    k = linear(x, a + "k_proj").view(n, nkv, hd).transpose(0, 1)
    v = linear(x, a + "v_proj").view(n, nkv, hd).transpose(0, 1)
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    freqs = torch.arange(n, dtype=torch.float64)[:, None] * inv
    emb = torch.cat([freqs, freqs], -1)

    def rotate(z: torch.Tensor) -> torch.Tensor:
        half = torch.cat([-z[..., hd // 2:], z[..., :hd // 2]], -1)
        return z * emb.cos() + half * emb.sin()

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, d)
    x = x + linear(att, a + "o_proj")
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"])
    h = h * t["layers.0.post_attention_layernorm.weight"]
    m = "layers.0.mlp."
    x = x + linear(F.silu(linear(h, m + "gate_proj")) * linear(h, m + "up_proj"),
                   m + "down_proj")
    return x @ lm_head.double().T  # no final norm


# --- fixtures ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf(model_path):
    weights = cached_target_for_head(model_path)  # the engine's copy: read once
    facts = read_facts(model_path)
    # The published layout for the bundled model's shape (as the brief names it).
    assert (facts.hidden_size, facts.n_heads, facts.n_kv_heads, facts.intermediate_size,
            facts.vocab_size) == (576, 9, 3, 1536, 49152)
    return facts, torch.from_numpy(weights.embed), torch.from_numpy(weights.lm_head)


def random_head(facts, embed, lm_head, fc_bias: bool, qkv_bias: bool) -> DraftHead:  # noqa: ANN001
    torch.manual_seed(0)
    cfg = HeadConfig(hidden_size=facts.hidden_size, n_heads=facts.n_heads,
                     n_kv_heads=facts.n_kv_heads, intermediate_size=facts.intermediate_size,
                     fusion="fc", rms_eps=facts.rms_eps, rope_theta=facts.rope_theta,
                     fc_bias=fc_bias, qkv_bias=qkv_bias)
    head = DraftHead(cfg, embed, lm_head).eval()
    with torch.no_grad():  # nonzero biases and norm weights, so each one shows
        for name, p in head.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
    return fp16_rounded(head)


# (config "bias", config "qkv_bias", file): a Vicuna-style head (no key: fc bias), a
# Llama-3 head (bias false), a Qwen2 head (qkv_bias), the .bin format.
VARIANTS = [(None, None, "safetensors"), (False, None, "bin"), (True, True, "safetensors")]


@pytest.mark.parametrize(("bias", "qkv_bias", "fmt"), VARIANTS,
                         ids=["vicuna-style", "llama3-bin", "qwen2-qkv-bias"])
def test_eagle1_logits_equal_draft_head_and_eagle_forward(gguf, tmp_path, bias, qkv_bias, fmt):
    facts, embed, lm_head = gguf
    head = random_head(facts, embed, lm_head, fc_bias=bias is not False,
                       qkv_bias=bool(qkv_bias))
    tensors = eagle1_tensors(head)
    config = eagle1_config(head.cfg, facts.vocab_size, bias, qkv_bias)
    loaded = load_eagle1(write_eagle1(tmp_path, tensors, config, fmt), embed, lm_head)
    assert (loaded.cfg.fc_bias, loaded.cfg.qkv_bias) == (bias is not False, bool(qkv_bias))
    torch.manual_seed(1)
    feats = 3 * torch.randn(1, 7, facts.hidden_size)
    tokens = torch.randint(0, facts.vocab_size, (1, 7))
    pos = torch.arange(7)[None]
    with torch.inference_mode():
        got = loaded.logits(loaded(feats, tokens, pos)[0])[0]
        want = head.logits(head(feats, tokens, pos)[0])[0]
        ref = eagle1_reference_logits(tensors, config, feats[0], tokens[0], embed, lm_head)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.double(), ref, atol=2e-3, rtol=1e-3)
    # The drafted token is EAGLE's at every position.
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_a_draft_vocabulary_keeps_those_rows_of_the_target_lm_head(gguf, tmp_path):
    facts, embed, lm_head = gguf
    head = random_head(facts, embed, lm_head, fc_bias=False, qkv_bias=False)
    path = write_eagle1(tmp_path, eagle1_tensors(head),
                        eagle1_config(head.cfg, facts.vocab_size, False, None))
    small = load_eagle1(path, embed, lm_head, draft_vocab_size=4096, keep_ids={49000})
    assert small.cfg.draft_vocab_size == 4097
    assert small.d2t.tolist() == [*range(4096), 49000]
    x = torch.randn(3, facts.hidden_size)
    torch.testing.assert_close(small.logits(x), head.logits(x)[:, small.d2t])


# --- through the engine: lossless greedy output --------------------------------------
@pytest.fixture(scope="module")
def prompts_and_plain(target, dev_prompts):
    rows = pick_per_category(dev_prompts, 1)[:6]
    return rows, plain_answers(target, rows, MAX_TOKENS)


@pytest.fixture(scope="module")
def fitted_eagle1_dir(target, gguf, prompts_and_plain, tmp_path_factory):
    """An EAGLE-1 checkpoint that drafts well enough to be accepted: the bundled head's
    decoder layer (EAGLE-1's: no input norm, no final norm) behind an fc fusion fitted
    by ridge regression to the bundled head's gating fusion on the target's features of
    the prompts and plain answers below."""
    facts, embed, lm_head = gguf
    dgf = load_head(DEFAULT_HEAD_DIR, embed, lm_head)
    rows, plain = prompts_and_plain
    inputs, outputs = [], []
    target.set_features(True)
    for row in rows:
        prompt, answer = plain[row["question_id"]]
        seq = prompt + answer
        target.reset()
        feats = torch.from_numpy(target.prefill(seq).features[:-1])
        nxt = torch.tensor(seq[1:])  # entry j pairs feature j with token j+1
        with torch.no_grad():
            outputs.append(dgf.fusion(feats, embed[nxt]).double())
        inputs.append(torch.cat([embed[nxt], feats, torch.ones(len(nxt), 1)], -1).double())
    target.set_features(False)
    x, y = torch.cat(inputs), torch.cat(outputs)
    w = torch.linalg.solve(x.T @ x + 1e-3 * (x ** 2).mean() * torch.eye(x.shape[1]), x.T @ y)
    cfg = dataclasses.replace(dgf.cfg, fusion="fc", draft_vocab_size=0, target=None)
    head = DraftHead(cfg, embed, lm_head)
    head.blocks.load_state_dict(dgf.blocks.state_dict())
    with torch.no_grad():
        head.fusion.fc.weight.copy_(w[:-1].T)
        head.fusion.fc.bias.copy_(w[-1])
    directory = tmp_path_factory.mktemp("eagle1")
    return write_eagle1(directory, eagle1_tensors(head),
                        eagle1_config(cfg, facts.vocab_size, None, None))


def test_eagle1_head_through_the_engine_equals_plain(target, prompts_and_plain,
                                                     fitted_eagle1_dir):
    rows, plain = prompts_and_plain
    drafter, notes = open_drafter(DrafterSpec("head-chain", fitted_eagle1_dir), target)
    assert isinstance(drafter, HeadDrafter)
    assert drafter.head.cfg.fusion == "fc" and drafter.head.cfg.fc_bias
    assert any("EAGLE-1" in n and "tokenizer" in n for n in notes), notes
    outs = drafted_equals_plain(target, drafter, rows, plain, MAX_TOKENS)
    n_accepted = sum(s.n_accepted for out in outs for s in out.stats.steps)
    n_steps = sum(out.stats.n_steps for out in outs)
    # The head reads the target's real features: its drafts are taken (a head wired
    # wrongly, e.g. the concat swapped, stays near 0).
    assert n_accepted > 0.15 * n_steps, (n_accepted, n_steps)


# --- refusals -------------------------------------------------------------------------
@pytest.fixture()
def small_checkpoint(gguf, tmp_path):
    """A published-layout checkpoint's parts, to be spoiled by each test."""
    facts, embed, lm_head = gguf
    head = random_head(facts, embed, lm_head, fc_bias=False, qkv_bias=False)
    return eagle1_tensors(head), eagle1_config(head.cfg, facts.vocab_size, False, None)


def test_wrong_hidden_size_is_refused_naming_the_field(target, small_checkpoint, tmp_path):
    tensors, config = small_checkpoint
    config["hidden_size"] = 512
    path = write_eagle1(tmp_path / "head", tensors, {**config, "num_attention_heads": 8,
                                                     "num_key_value_heads": 4})
    fingerprint = target_fingerprint(target)
    with pytest.raises(IncompatibleDraftError) as err:
        check_head_fits(path, fingerprint)
    message = str(err.value)
    assert "hidden_size: the draft has 512, the target 576" in message
    assert "tokenizer" in message and "vocab_size:" not in message
    drafter, notes = open_drafter(DrafterSpec("head", path), target, fingerprint)
    assert isinstance(drafter, MemoryDrafter)
    assert "hidden_size: the draft has 512" in notes[0] and "tokenizer" in notes[0]
    assert notes[-1] == "using drafts from memory instead"


@pytest.mark.parametrize(("spoil", "expected"), [
    ("drop", "lacks tensor layers.0.mlp.up_proj.weight"),
    ("shape", "tensor fc.weight has shape [576, 576], its config.json implies [576, 1152]"),
    ("bias", "lacks tensor fc.bias"),  # config says an fc bias (no "bias" key), file has none
])
def test_a_bad_checkpoint_names_the_file_and_tensor(target, small_checkpoint, tmp_path,
                                                    model_path, spoil, expected):
    tensors, config = small_checkpoint
    if spoil == "drop":
        del tensors["layers.0.mlp.up_proj.weight"]
    elif spoil == "shape":
        tensors["fc.weight"] = tensors["fc.weight"][:, :576].contiguous()
    else:
        del config["bias"]
    path = write_eagle1(tmp_path / "head", tensors, config, "bin")
    fingerprint = target_fingerprint(target)
    weights = str(path / "pytorch_model.bin")
    with pytest.raises(ValueError) as err:
        load_head_drafter(path, model_path, fingerprint)
    assert weights in str(err.value) and expected in str(err.value)
    drafter, notes = open_drafter(DrafterSpec("head", path), target, fingerprint)
    assert isinstance(drafter, MemoryDrafter)
    assert weights in notes[0] and expected in notes[0]
    assert notes[-1] == "using drafts from memory instead"


def test_config_without_weights_or_with_bad_fields_is_a_clear_error(target, tmp_path):
    fingerprint = target_fingerprint(target)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 576}))
    with pytest.raises(ValueError, match=r"config\.json: num_attention_heads must be int"):
        check_head_fits(tmp_path, fingerprint)
    head = HeadConfig(hidden_size=576, n_heads=9, n_kv_heads=3, intermediate_size=1536)
    (tmp_path / "config.json").write_text(json.dumps(eagle1_config(head, 49152, False, None)))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor pytorch_model"):
        load_head_drafter(tmp_path, target.path, fingerprint)


def test_tandem_head_json_without_the_new_fields_still_loads():
    cfg = HeadConfig.load(DEFAULT_HEAD_DIR / "head.json")
    assert "fc_bias" not in (DEFAULT_HEAD_DIR / "head.json").read_text()
    assert (cfg.fc_bias, cfg.qkv_bias) == (True, False)
