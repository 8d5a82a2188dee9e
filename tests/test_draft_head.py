"""The draft head's module contracts: shapes, cache consistency, save/load, fingerprint."""

from __future__ import annotations

import pytest
import torch

from engine.drafters.head import check_head_fits
from engine.errors import IncompatibleDraftError
from models.draft_head import DraftHead
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
