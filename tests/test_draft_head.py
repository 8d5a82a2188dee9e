"""The draft head's module contracts: shapes, cache consistency, save/load, fingerprint."""

from __future__ import annotations

import pytest
import torch

from engine.drafters.head import check_head_fits
from engine.errors import IncompatibleDraftError
from models.draft_head import DraftHead, rope
from models.head_config import HeadConfig, TargetFingerprint
from models.head_io import load_head, save_head

FP = TargetFingerprint(vocab_size=50, hidden_size=32, tokenizer_sha256="abc")


def _head(fusion: str = "dgf", n_layers: int = 2, draft_vocab: int = 0) -> DraftHead:
    torch.manual_seed(0)
    cfg = HeadConfig(hidden_size=32, n_heads=4, n_kv_heads=2, intermediate_size=64,
                     n_layers=n_layers, fusion=fusion, draft_vocab_size=draft_vocab,
                     target=FP)
    embed = torch.randn(50, 32)
    d2t = torch.arange(0, 50, 2) if draft_vocab else None
    return DraftHead(cfg, embed, embed.clone(), d2t).eval()


@pytest.mark.parametrize("fusion", ["dgf", "fc"])
def test_incremental_decoding_with_cache_equals_one_pass(fusion):
    head = _head(fusion)
    feats = torch.randn(1, 6, 32)
    toks = torch.randint(0, 50, (1, 6))
    pos = torch.arange(6)[None]
    with torch.inference_mode():
        full, _ = head(feats, toks, pos)
        first, cache = head(feats[:, :4], toks[:, :4], pos[:, :4])
        rest, _ = head(feats[:, 4:], toks[:, 4:], pos[:, 4:], cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, atol=1e-5, rtol=1e-5)
    assert head.logits(full).shape == (1, 6, 50)


@pytest.mark.parametrize("fusion", ["dgf", "fc"])
def test_preallocated_cache_gives_the_functional_cache_outputs(fusion):
    """The drafter's KV buffers (written in place, draft entries truncated away) give
    exactly what the training path's concatenated cache gives, tree mask included."""
    head = _head(fusion)
    feats, toks = torch.randn(1, 9, 32), torch.randint(0, 50, (1, 9))
    pos = torch.arange(9)[None]
    buffers = head.new_cache()
    with torch.inference_mode():
        _, cache = head(feats[:, :5], toks[:, :5], pos[:, :5])
        head(feats[:, :5], toks[:, :5], pos[:, :5], buffers)
        # Two draft nodes at the same position (siblings): each sees the past and itself.
        mask = torch.tensor([[True] * 5 + [True, False], [True] * 5 + [False, True]])
        tree = (feats[:, 5:7], toks[:, 5:7], torch.tensor([[5, 5]]))
        want, _ = head(*tree, cache, mask)
        got, _ = head(*tree, buffers, mask)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        for buffer in buffers:  # drop the draft, commit the real continuation
            buffer.truncate(5)
        want, _ = head(feats[:, 5:], toks[:, 5:], pos[:, 5:], cache)
        got, _ = head(feats[:, 5:], toks[:, 5:], pos[:, 5:], buffers)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert buffers[0].length == 9


def test_rope_from_the_table_equals_the_direct_angles():
    x = torch.randn(2, 4, 3, 16)
    positions = torch.tensor([[0, 7, 3000], [5, 5, 1]])  # beyond the first table's size
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    ang = positions.float()[:, None, :, None] * inv
    x1, x2 = x[..., :8], x[..., 8:]
    direct = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)
    torch.testing.assert_close(rope(x, positions, 10000.0), direct, atol=0, rtol=0)


def test_int8_head_stays_close_to_the_float_head():
    """Int8 weights change the drafts a little, not the head: its predicted features and
    top draft token stay close to the float head's."""
    head = _head(n_layers=1)
    feats, toks, pos = torch.randn(1, 64, 32), torch.randint(0, 50, (1, 64)), torch.arange(64)[None]
    with torch.inference_mode():
        want, _ = head(feats, toks, pos)
        want_logits = head.logits(want)
        head.to_int8()
        got, _ = head(feats, toks, pos)
        got_logits = head.logits(got)
    assert "Int8Linear" in repr(head.blocks[0].gate) and head.lm_head_int8 is not None
    rel = (got - want).norm() / want.norm()
    assert 0 < rel < 0.05, rel  # really quantized, and close
    agree = (got_logits.argmax(-1) == want_logits.argmax(-1)).float().mean()
    assert agree > 0.9, agree


def test_reduced_vocabulary_logits_map_back_to_target_ids():
    head = _head(draft_vocab=25)
    x = torch.randn(3, 32)
    assert head.logits(x).shape == (3, 25)
    full = x @ head.embed.T
    torch.testing.assert_close(head.logits(x), full[:, head.d2t])


def test_save_and_load_give_identical_outputs(tmp_path):
    head = _head(n_layers=1)
    save_head(head, tmp_path)
    again = load_head(tmp_path, head.embed, head.embed.clone())
    # Weights are stored in float16: the loaded head is the original rounded to it.
    head.load_state_dict({k: v.half().float() if v.is_floating_point() else v
                          for k, v in head.state_dict().items()})
    feats, toks, pos = torch.randn(1, 3, 32), torch.randint(0, 50, (1, 3)), torch.arange(3)[None]
    with torch.inference_mode():
        torch.testing.assert_close(head(feats, toks, pos)[0], again(feats, toks, pos)[0])


def test_mismatched_target_is_refused_with_both_values(tmp_path):
    save_head(_head(), tmp_path)
    other = TargetFingerprint(vocab_size=51, hidden_size=32, tokenizer_sha256="abc")
    with pytest.raises(IncompatibleDraftError,
                       match="vocab_size: the draft has 50, the target 51") as err:
        check_head_fits(tmp_path, other)
    assert ("vocab_size", 50, 51) in err.value.mismatches
    assert check_head_fits(tmp_path, FP).target == FP  # the matching target is accepted


def test_target_facts_and_embeddings_come_from_the_real_gguf(target, model_path):
    import numpy as np

    from models.gguf_weights import fingerprint, read_embeddings, read_facts

    facts = read_facts(model_path)
    assert (facts.hidden_size, facts.vocab_size) == (target.n_embd, target.n_vocab)
    assert facts.n_heads == 9 and facts.n_kv_heads == 3
    embed, lm_head = read_embeddings(model_path)
    assert embed.shape == (target.n_vocab, target.n_embd)
    assert lm_head is embed  # SmolLM2 ties its LM head to the embedding
    assert np.isfinite(embed).all() and embed.std() > 0
    fp = fingerprint(target.model.pieces(), target.n_embd)
    assert fp == fingerprint(list(target.model.pieces()), target.n_embd)
    assert fp.vocab_size == target.n_vocab


def test_gguf_lm_head_on_llama_cpp_features_reproduces_its_logits(fresh_target, model_path):
    import numpy as np

    from models.gguf_weights import read_embeddings

    t = fresh_target
    t.set_features(True)
    try:
        pre = t.prefill(t.chat_prompt([{"role": "user", "content": "Name a colour."}]))
    finally:
        t.set_features(False)
    _, lm_head = read_embeddings(model_path)
    ours = lm_head @ pre.features[-1]
    assert int(np.argmax(ours)) == int(np.argmax(pre.logits))
    assert np.corrcoef(ours, pre.logits)[0, 1] > 0.999
