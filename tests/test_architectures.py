"""Every architecture people download, as tiny GGUFs in each one's real tensor layout
(engine.gguf.architectures): it loads, its capability table says what speculation may do,
plain decoding runs, and every drafter gives plain decoding's tokens with drafts accepted
and rejected: rollback across a sliding window's edge, and recurrent state taken back
through llama.cpp's snapshots."""

from __future__ import annotations

import platform
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.drafters.lookup import PromptLookupDrafter
from engine.drafters.memory import MemoryDrafter
from engine.drafters.suffix_index import SuffixIndex
from engine.gguf.architectures import (
    ARCHITECTURES,
    PLAIN_ONLY_ARCHITECTURES,
    TinyShape,
    write_architecture_gguf,
)
from engine.planning.cpu_check import perturbed
from engine.runtime.target import Target, TargetConfig

# What each architecture's table must say: memory kind, trees, draft limit, layer inputs.
EXPECTED = {
    "llama": ("KV", True, None, True),
    "qwen2": ("KV", True, None, False),
    "qwen3": ("KV", True, None, True),
    "qwen3moe": ("KV", True, None, True),
    "gemma3": ("sliding-window KV", True, None, False),
    "gpt-oss": ("sliding-window KV", True, None, True),
    "qwen35": ("hybrid", False, 8, True),
    "lfm2": ("hybrid", False, 8, True),
    "phi3": ("KV", True, None, False),
    "glm4moe": ("KV", True, None, False),
    "deepseek2": ("KV", True, None, False),
}
PROMPTS = ("The lighthouse keeper wrote in his log every evening: the weather, the ships",
           "Count with me: one two three four five six seven eight nine ten eleven")
N_NEW = 40  # with a prompt of ~15 tokens, past the tiny window of 32


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("architectures")
    return {arch: write_architecture_gguf(arch, folder / f"{arch}.gguf", model_path)
            for arch in ARCHITECTURES}


def _perturbed(tokens: list[int], every: int, shift: int) -> list[int]:
    """``tokens`` with every ``every``-th one changed (the tiny files share the bundled
    model's 49,152-token vocabulary): a memory that is right in runs."""
    return perturbed(tokens, every, shift, 49152)


def test_the_tables_match_llama_cpp(tiny_models: dict[str, Path]) -> None:
    for arch, path in tiny_models.items():
        with Target(path, TargetConfig(n_ctx=256, n_threads=2)) as target:
            table = target.arch.table()
            memory, trees, max_draft, layer_inputs = EXPECTED[arch]
            assert (table["memory"], table["trees"], table["max_draft"],
                    table["layer_inputs"]) == EXPECTED[arch], arch
            assert table["speculation"] and table["architecture"] == arch
            assert table["sliding_window"] == (TinyShape().window if "sliding" in memory else 0)
            # Flash attention on (the tiled kernel on the CPU; a window keeps it in any
            # case); that kernel sums by cell layout, so CPU targets verify chains.
            assert target.flash_attn and not target.trees, arch
            # A long prompt's cells move from an F16 cache out of KV caches, windowed or
            # not; recurrent state has no such move.
            assert table["f16_prefill"] == (memory != "hybrid")
            # Opened where cells can move and flash attention runs (latent attention
            # keeps it on the CPU too); without it the target's cache reads prompts.
            assert (target.f16_prefill_off is None) == (memory != "hybrid"
                                                         and target.flash_attn)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_drafter_gives_plain_decodings_tokens(arch: str, tiny_models: dict[str, Path]
                                                    ) -> None:
    with Target(tiny_models[arch], TargetConfig(n_ctx=512, n_threads=2)) as target:
        config = GenerationConfig(N_NEW, max_draft=16)
        free = VerifyCostModel(slope=0.0, learn=False)  # every drafted node is verified
        for text in PROMPTS:
            prompt = target.tokenize(text, special=False)
            target.reset()
            plain = generate(target, prompt, None, config).tokens
            assert len(plain) == N_NEW and np.all(np.array(plain) < target.n_vocab)
            # Two memories of the answer, each wrong at other places: drafts are accepted
            # in runs and rejected at each wrong token, and branch where the two differ.
            memory = SuffixIndex()
            memory.insert(prompt + _perturbed(plain, 7, 1))
            memory.insert(prompt + _perturbed(plain, 5, 2))
            for drafter in (PromptLookupDrafter(), MemoryDrafter(memory)):
                target.reset()
                out = generate(target, prompt, drafter, config, cost=free, remember=False)
                assert out.tokens == plain, (arch, drafter.name, text)
                if drafter.name != "memory":
                    continue
                steps = out.stats.steps
                accepted = sum(s.n_accepted for s in steps)
                proposed = sum(s.n_proposed for s in steps)
                assert accepted >= N_NEW // 3, (arch, accepted)  # runs were accepted
                assert proposed > accepted, arch  # and some drafts were taken back
                if target.max_draft is not None:
                    assert max(s.n_proposed for s in steps) <= target.max_draft


@pytest.mark.parametrize("arch", ["gemma3", "gpt-oss"])
def test_a_long_prompts_cells_move_into_a_sliding_window_cache(arch: str,
                                                                tiny_models: dict[str, Path]
                                                                ) -> None:
    """A prompt far past the window is prefilled in the F16 context and its cells (both
    caches: full attention and windowed) moved in; the first token's logits are the ones
    an own prefill gives, up to F16 against Q8_0 keys, and drafted decoding after it still
    gives plain decoding's tokens."""
    config = GenerationConfig(24, max_draft=16)
    with Target(tiny_models[arch], TargetConfig(n_ctx=1024, n_threads=2, flash_attn=True)
                ) as target:
        prompt = target.tokenize(" ".join(PROMPTS * 12), special=False)
        assert len(prompt) > 8 * TinyShape().window
        target.reset(cold=True)
        moved = target.prefill(prompt).logits.copy()
        target.reset(cold=True)
        plain = generate(target, prompt, None, config).tokens
        assert target.f16_prefill_off is None  # the move worked: a failure turns it off
        memory = SuffixIndex()
        memory.insert(prompt + _perturbed(plain, 6, 1))
        target.reset(cold=True)
        out = generate(target, prompt, MemoryDrafter(memory), config,
                       cost=VerifyCostModel(slope=0.0, learn=False), remember=False)
        assert out.tokens == plain and sum(s.n_accepted for s in out.stats.steps) > 8
    own_config = TargetConfig(n_ctx=1024, n_threads=2, f16_prefill=False, flash_attn=True)
    with Target(tiny_models[arch], own_config) as own:
        logits = own.prefill(prompt).logits
    assert moved.argmax() == logits.argmax()
    assert 0 < np.abs(moved - logits).max() < 0.5


@pytest.mark.parametrize("arch", ["deepseek2", "llama"])
def test_moved_cells_attend_as_the_caches_own(arch: str, tiny_models: dict[str, Path]) -> None:
    """The token after a long prompt, decoded over cells moved out of the F16 context,
    scores as over cells the cache evaluated itself (up to F16 against Q8_0 keys). For
    latent attention (deepseek2) the cache holds K alone, V being a view of it."""
    from engine.runtime.draft_tree import DraftTree

    prompt_text = " ".join(PROMPTS * 8)
    second, first = [], None
    for f16_prefill in (True, False):
        config = TargetConfig(n_ctx=1024, n_threads=2, f16_prefill=f16_prefill,
                              flash_attn=True)
        with Target(tiny_models[arch], config) as target:
            prompt = target.tokenize(prompt_text, special=False)
            assert len(prompt) >= 128
            logits = target.prefill(prompt).logits
            first = int(logits.argmax()) if first is None else first  # one token for both
            second.append(target.verify(first, DraftTree.chain([])).logits[0].copy())
            assert target.f16_prefill_off is (None if f16_prefill else target.f16_prefill_off)
    moved, own = second
    assert moved.argmax() == own.argmax()
    assert 0 < np.abs(moved - own).max() < 0.5


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "qwen35", "lfm2", "gemma3", "deepseek2"])
def test_q4_k_m_of_every_memory_kind_is_made_exact(arch: str, tiny_models: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """The most downloaded quantization on experts, windows and recurrent layers: the
    chosen kernels are exact (on x86, llama.cpp's repacked ones for every batch size, with
    Tandem's patch; elsewhere repacking off or short verifications where the probe saw
    repacked batches differ), and drafted decoding then gives plain decoding's tokens."""
    from engine.planning.kernels import choose_kernels
    from engine.runtime.native import ftype_named, quantize

    path = tmp_path / f"{arch}.Q4_K_M.gguf"
    quantize(tiny_models[arch], path, ftype_named("q4_k_m"), 2)
    config = TargetConfig(n_ctx=512, n_threads=2)
    choice = choose_kernels(path, config, 2, None)
    assert choice.exact, arch
    if platform.machine() in ("x86_64", "AMD64"):
        assert choice.repack and choice.max_batch is None and choice.tried[True].exact, arch
    else:
        assert choice.repack == (choice.max_batch == 3) or choice.tried[True].exact, arch
    with Target(path, replace(config, repack=choice.repack,
                              max_batch=choice.max_batch)) as target:
        assert _memory_drafts_equal_plain(target, PROMPTS[0]) > 8


def test_a_recurrent_model_without_snapshots_decodes_plainly_and_says_why(
        model_path: Path, tmp_path: Path) -> None:
    """Mamba's state cannot take back a rejected draft: auto and a drafter asked for by
    name both decode plainly, with a note; nothing aborts."""
    from engine.session import Engine, EngineConfig

    mamba = write_architecture_gguf(PLAIN_ONLY_ARCHITECTURES[0], tmp_path / "mamba.gguf",
                                    model_path)
    for drafter in ("auto", "memory"):
        config = EngineConfig(model_path=mamba, drafter=drafter, n_ctx=512, n_threads=2,
                              cache_dir=tmp_path, memory_dir=tmp_path)
        with Engine(config) as engine:
            assert engine.drafter_name == "none", drafter
            assert any("decodes plainly" in n and "recurrent state" in n
                       for n in engine.notes), engine.notes
            assert engine.architecture["speculation"] is False
            out = engine.generate(engine.target.tokenize(PROMPTS[1], special=False),
                                  GenerationConfig(12))
            assert len(out.tokens) == 12 and not any(s.n_proposed for s in out.stats.steps)


def test_tandem_synth_writes_a_quantized_model_with_a_big_vocabulary(model_path: Path,
                                                                     tmp_path: Path) -> None:
    """The command behind the architecture benchmarks: an architecture, a weight type, a
    vocabulary padded to a big model's size; llama.cpp loads and decodes it."""
    from app.cli import main

    out = tmp_path / "gemma3-big-vocab.gguf"
    assert main(["synth", str(out), "--arch", "gemma3", "--type", "q4_0",
                 "--vocab", "100000", "--tokenizer", str(model_path)]) == 0
    with Target(out, TargetConfig(n_ctx=256, n_threads=2)) as target:
        assert target.n_vocab == 100000 and target.arch.n_swa == TinyShape().window
        prompt = target.tokenize(PROMPTS[0], special=False)
        assert max(prompt) < 49152  # the padding is never made by the tokenizer
        tokens = generate(target, prompt, None, GenerationConfig(6)).tokens
        assert len(tokens) == 6 and target.detokenize(tokens)


def test_direct_random_blocks_load_and_keep_the_f32_fills_scale(model_path: Path,
                                                                 tmp_path: Path) -> None:
    """``tandem synth --direct``: weight matrices written as random quantized blocks (an
    MoE of 20-30B has no room here for its F32 file first); llama.cpp loads and decodes
    the files, and each type dequantizes to the F32 fill's spread (1/sqrt(inputs))."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from engine.gguf.architectures import random_blocks

    for kind in (T.Q4_K, T.Q8_0, T.MXFP4):
        weights = dequantize(random_blocks(kind, (32, 512), np.random.default_rng(1)), kind)
        assert weights.shape == (32, 512), kind
        spread = weights.std() * np.sqrt(512)
        assert 0.7 < spread < 1.4 and abs(weights.mean()) < 0.01, (kind, spread)
    for arch, experts in (("qwen3moe", T.Q4_K), ("gpt-oss", T.MXFP4)):
        path = write_architecture_gguf(arch, tmp_path / f"{arch}-direct.gguf", model_path,
                                       direct=True)
        types = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
        assert types["blk.0.ffn_up_exps.weight"] == experts
        assert types["blk.0.attn_norm.weight"] == T.F32
        with Target(path, TargetConfig(n_ctx=256, n_threads=2)) as target:
            prompt = target.tokenize(PROMPTS[0], special=False)
            assert len(generate(target, prompt, None, GenerationConfig(6)).tokens) == 6


def test_a_plain_only_target_keeps_no_state_snapshots(tiny_models: dict[str, Path]) -> None:
    """Snapshots cost every decode a copy of the state; without drafts they are not kept,
    and such a target verifies no drafts (they could not be taken back)."""
    config = TargetConfig(n_ctx=256, n_threads=2, state_snapshots=False)
    with Target(tiny_models["qwen35"], config) as target:
        assert target.max_draft == 0
        prompt = target.tokenize(PROMPTS[0], special=False)
        memory = SuffixIndex()
        memory.insert(prompt + list(range(100, 140)))
        out = generate(target, prompt, MemoryDrafter(memory), GenerationConfig(8),
                       remember=False)
        assert len(out.tokens) == 8 and not any(s.n_proposed for s in out.stats.steps)
    with Target(tiny_models["llama"], config) as target:  # no state: nothing changes
        assert target.max_draft is None


def test_a_hybrid_drops_and_takes_up_state_snapshots_keeping_its_cache(
        tiny_models: dict[str, Path]) -> None:
    """Snapshots switched off and on between answers: the cells stay (the next answer
    continues as if nothing changed), drafts are taken only while snapshots are kept,
    and then they still equal plain decoding."""
    gen = GenerationConfig(12)
    with Target(tiny_models["qwen35"], TargetConfig(n_ctx=256, n_threads=2)) as target:
        prompt = target.tokenize(PROMPTS[0], special=False)
        first = generate(target, prompt, None, gen).tokens
        follow = prompt + first + target.tokenize(" and then", special=False)
        unswitched = generate(target, follow, None, gen).tokens
        target.reset()
        generate(target, prompt, None, gen)
        target.set_state_snapshots(0)
        assert target.state_snapshots == 0 and target.max_draft == 0
        assert target.n_past == len(prompt) + len(first) - 1  # the last token is not cached
        switched = generate(target, follow, None, gen)
        assert switched.tokens == unswitched and switched.stats.n_prompt_reused >= len(prompt)
        target.set_state_snapshots(3)  # drafts of up to 3 tokens
        assert target.state_snapshots == 3 and target.max_draft == 3
        # Restored state has no snapshots yet: nothing of it can be taken back (llama.cpp
        # would say yes and read an unwritten snapshot).
        assert not target.ctx.kv_remove(0, target.n_past - 1)
        assert _memory_drafts_equal_plain(target, PROMPTS[1]) > 4


def test_auto_that_drafts_nothing_keeps_no_state_snapshots(tiny_models: dict[str, Path],
                                                           tmp_path: Path) -> None:
    from engine.planning.planner import Overrides
    from engine.session import Engine, EngineConfig

    config = EngineConfig(model_path=tiny_models["qwen35"], drafter="auto", n_ctx=1024,
                          n_threads=2, cache_dir=tmp_path, memory_dir=tmp_path,
                          overrides=Overrides(drafter="none"))
    with Engine(config) as engine:
        assert engine.drafter_name == "none"
        assert engine.target.state_snapshots == 0
    config = replace(config, overrides=Overrides(drafter="memory", max_draft=2))
    with Engine(config) as engine:  # snapshots for the drafts it may take back
        assert engine.drafter_name == "memory" and engine.max_draft == 2
        assert engine.target.state_snapshots == 2
        prompt = engine.target.tokenize(PROMPTS[0], special=False)
        answer = engine.generate(prompt, GenerationConfig(12)).tokens
        cached = list(engine.target.tokens)
        engine.remeasure()  # measured with all of them, then back to the plan's
        assert engine.drafter_name == "memory" and engine.target.state_snapshots == 2
        # The conversation's cells are put back: the next turn parts from them as a
        # session that never measured (before: read from nothing, 3.3e-6 apart).
        assert engine.target.tokens == cached and engine.target.n_read_again == 0
        follow = prompt + answer + engine.target.tokenize(" and then", special=False)
        after = engine.target.prefill(follow).logits.copy()
        engine.target.reset()
        assert engine.generate(prompt, GenerationConfig(12)).tokens == answer
    with Engine(replace(config, drafter="none", overrides=Overrides())) as plain:
        assert plain.generate(prompt, GenerationConfig(12)).tokens == answer
        assert np.array_equal(plain.target.prefill(follow).logits, after)


@pytest.mark.parametrize("arch", ["gemma3", "gpt-oss"])
def test_a_sliding_window_cache_keeps_its_cells_across_a_dropped_span(
        arch: str, tiny_models: dict[str, Path]) -> None:
    """A long chat's oldest turns dropped on a sliding-window model: the cells after the
    cut are shifted back (both caches, the windowed one past its edge) instead of
    prefilled again, and drafted decoding from that cache gives plain decoding's tokens."""
    from engine.runtime.prefill import SHIFT_MIN_KEPT

    with Target(tiny_models[arch], TargetConfig(n_ctx=1024, n_threads=2)) as target:
        head = target.tokenize(PROMPTS[0], special=False)
        dropped = target.tokenize(" " + " ".join([PROMPTS[1]] * 3), special=False)
        kept = target.tokenize(" " + " ".join(PROMPTS * 4), special=False)
        question = target.tokenize(" Count again: one two three", special=False)
        assert len(kept) > max(SHIFT_MIN_KEPT, 2 * TinyShape().window)
        cached, prompt = head + dropped + kept, head + kept + question
        config = GenerationConfig(24, max_draft=16)
        free = VerifyCostModel(slope=0.0, learn=False)
        answers = []
        for drafted in (False, True):
            target.reset(cold=True)
            generate(target, cached, None, GenerationConfig(4))
            drafter = None
            if drafted:
                memory = SuffixIndex()
                memory.insert(prompt + _perturbed(answers[0].tokens, 6, 1))
                drafter = MemoryDrafter(memory)
            out = generate(target, prompt, drafter, config, cost=free, remember=False)
            assert out.stats.n_prompt_reused >= len(head) + SHIFT_MIN_KEPT, arch
            answers.append(out)
        assert answers[1].tokens == answers[0].tokens
        assert sum(s.n_accepted for s in answers[1].stats.steps) > 8


@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_a_hybrids_cache_parted_a_few_tokens_back_is_its_fresh_prefill(
        arch: str, tiny_models: dict[str, Path]) -> None:
    """A next prompt that parts from the cache 3-6 tokens before its end (one-token
    decodes since): llama.cpp's snapshots hold only the last batch's states and its
    seq_rm said true anyway, with a wrong state; the target evaluates again instead."""
    with Target(tiny_models[arch], TargetConfig(n_ctx=512, n_threads=2)) as target:
        prompt = target.tokenize(PROMPTS[0], special=False)
        for back in (3, 6):
            target.reset(cold=True)
            answer = generate(target, prompt, None, GenerationConfig(16)).tokens
            parted = prompt + answer[:16 - back] + [1234, 2345]
            warm = target.prefill(parted).logits.copy()
            target.reset(cold=True)
            assert np.array_equal(warm, target.prefill(parted).logits), (arch, back)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_draft_model_of_each_architecture_drafts_losslessly(
        arch: str, tiny_models: dict[str, Path]) -> None:
    """The file drafting for itself through the draft-model drafter (chains, and side
    sequences where the memory allows them): plain decoding's tokens, most drafts taken.
    A hybrid draft model drafts in a copy of its committed state (its own rollback)."""
    from engine.drafters.draft_model import DraftModelConfig, DraftModelDrafter

    with Target(tiny_models[arch], TargetConfig(n_ctx=512, n_threads=2)) as target:
        prompt = target.tokenize(PROMPTS[1], special=False)
        config = GenerationConfig(N_NEW, max_draft=16)
        target.reset()
        plain = generate(target, prompt, None, config).tokens
        for sequences in (1, 3):
            drafter = DraftModelDrafter(tiny_models[arch], 600, 2,
                                        DraftModelConfig(max_sequences=sequences, p_min=0.0))
            try:
                target.reset()
                out = generate(target, prompt, drafter, config,
                               cost=VerifyCostModel(slope=0.0, learn=False), remember=False)
            finally:
                drafter.close()
            assert out.tokens == plain, (arch, sequences)
            assert sum(s.n_accepted for s in out.stats.steps) >= N_NEW * 2 // 3, arch


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_an_eagle3_head_drafts_losslessly_or_is_refused_with_the_reason(
        arch: str, tiny_models: dict[str, Path], tmp_path: Path, model_path: Path) -> None:
    """Graphs that export layer inputs draft with an EAGLE-3 head through llama.cpp and
    give plain decoding's tokens, with drafts both kept and taken back (LFM2 included:
    llama.cpp's embeddings mode computes no logits there, so layer inputs are read without
    it); the others refuse the head with the reason instead of aborting in llama.cpp."""
    from engine.drafters.eagle3 import Eagle3Drafter
    from engine.drafters.native_head import HeadChainConfig
    from engine.errors import ModelLoadError
    from engine.gguf.eagle3 import shape_for_target, write_eagle3_head

    path = tiny_models[arch]
    if EXPECTED[arch][3]:
        # Layers that add little to the residual stream, and an LM head with the
        # embeddings' values: the model mostly says its last token again, which the head
        # (passing the token's embedding through) guesses; where it does not, it is wrong.
        path = write_architecture_gguf(arch, tmp_path / f"{arch}.gguf", model_path,
                                       TinyShape(damp=0.05))
    shape = shape_for_target(path, (0, 1, 1))
    e = shape.hidden
    fc = np.zeros((e, 3 * e), np.float32)
    fc[:, :e] = np.eye(e, dtype=np.float32)  # copies the token's embedding (layer 0 input)
    head = write_eagle3_head(tmp_path / "head.gguf", path, shape, {
        "fc.weight": fc,
        "blk.0.attn_output.weight": np.zeros((e, shape.n_heads * shape.head_dim), np.float32),
        "blk.0.ffn_down.weight": np.zeros((e, shape.ffn), np.float32)},
        tokenizer_from=model_path)  # the tiny models carry the bundled tokenizer
    with Target(path, TargetConfig(n_ctx=512, n_threads=2)) as target:
        if not EXPECTED[arch][3]:
            with pytest.raises(ModelLoadError, match="graph cannot export layer inputs"):
                Eagle3Drafter(head, target)
            return
        # Every guess proposed (the head's scores are flat on a tiny vocabulary's worth).
        drafter = Eagle3Drafter(head, target, HeadChainConfig(p_min=0.0))
        try:
            config = GenerationConfig(24, max_draft=8)
            prompt = target.tokenize(PROMPTS[0], special=False)
            target.reset()
            plain = generate(target, prompt, None, config).tokens
            target.reset()
            out = generate(target, prompt, drafter, config,
                           cost=VerifyCostModel(slope=0.0, learn=False))
            assert out.tokens == plain, arch
            assert not out.stats.fallback
            accepted = sum(s.n_accepted for s in out.stats.steps)
            rejected = sum(s.n_proposed - s.n_accepted for s in out.stats.steps)
            assert accepted > 0 and rejected > 0, (arch, accepted, rejected)
        finally:
            drafter.close()


def test_lfm2_takes_its_attention_layers_where_the_shape_puts_them(model_path: Path,
                                                                   tmp_path: Path) -> None:
    """LFM2-1.2B's attention sits at layers 2, 5, 8, 10, 12 and 14 (``REAL_SHAPES``); a
    tiny model with its own list loads, reads the KV heads per layer, and drafts from a
    memory of its answer are accepted with the output plain decoding's."""
    from gguf import GGUFReader

    from engine.gguf.architectures import REAL_SHAPES

    arch, real = REAL_SHAPES["lfm2-1.2b"]
    assert arch == "lfm2" and len(real.lfm2_attention) == 6
    shape = TinyShape(n_layers=5, lfm2_attention=(0, 3))
    path = write_architecture_gguf("lfm2", tmp_path / "lfm2.gguf", model_path, shape=shape)
    kv_heads = GGUFReader(path).fields["lfm2.attention.head_count_kv"].contents()
    assert kv_heads == [2, 0, 0, 2, 0]
    with Target(path, TargetConfig(n_ctx=512, n_threads=2)) as target:
        assert _memory_drafts_equal_plain(target, PROMPTS[1]) >= N_NEW // 3


def _memory_drafts_equal_plain(target: Target, text: str) -> int:
    """Plain decoding of ``text``, then drafts from a memory of that answer (wrong at
    every 7th token): the output must be plain decoding's. Returns the drafts accepted."""
    gen = GenerationConfig(N_NEW, max_draft=16)
    prompt = target.tokenize(text, special=False)
    target.reset()
    plain = generate(target, prompt, None, gen).tokens
    memory = SuffixIndex()
    memory.insert(prompt + _perturbed(plain, 7, 1))
    target.reset()
    out = generate(target, prompt, MemoryDrafter(memory), gen,
                   cost=VerifyCostModel(slope=0.0, learn=False), remember=False)
    assert out.tokens == plain
    return sum(s.n_accepted for s in out.stats.steps)


@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_a_hybrids_answer_ended_at_eos_leaves_the_next_turn_as_plain_decoding_does(
        arch: str, tiny_models: dict[str, Path]) -> None:
    """An answer that ends at an end-of-generation token keeps every token it decoded,
    drafted or not: plain decoding, whose state keeps no snapshots, takes nothing back
    (it would have to read the whole conversation again, in other sums), and the next
    turn's first-token logits are bit for bit the same with and without drafts."""
    path = tiny_models[arch]
    with Target(path, TargetConfig(n_ctx=512, n_threads=2, state_snapshots=False)) as plain:
        prompt = plain.tokenize(PROMPTS[1], special=False)
        answer = generate(plain, prompt, None, GenerationConfig(16)).tokens
        end = next(i for i in range(6, 16) if answer[i] not in answer[:i])
        plain.model.eog_ids = frozenset({answer[end]})  # the answer ends there
        plain.reset(cold=True)
        first = generate(plain, prompt, None, GenerationConfig(32))
        assert first.finish_reason == "eos" and first.tokens == answer[:end]
        follow = prompt + first.tokens + [answer[end]] + plain.tokenize(" and then",
                                                                        special=False)
        want = plain.prefill(follow)
        assert want.n_reused == len(prompt) + end  # nothing read again
    with Target(path, TargetConfig(n_ctx=512, n_threads=2)) as drafted:
        drafted.model.eog_ids = frozenset({answer[end]})
        memory = SuffixIndex()
        memory.insert(prompt + _perturbed(answer, 4, 1))
        out = generate(drafted, prompt, MemoryDrafter(memory), GenerationConfig(32),
                       cost=VerifyCostModel(slope=0.0, learn=False), remember=False)
        assert out.tokens == first.tokens and out.finish_reason == "eos"
        assert sum(s.n_accepted for s in out.stats.steps) > 0
        got = drafted.prefill(follow)
        assert got.n_reused == want.n_reused
        np.testing.assert_array_equal(got.logits, want.logits)


@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_a_hybrid_goes_back_to_its_prompts_checkpoint_not_to_the_start(
        arch: str, tiny_models: dict[str, Path]) -> None:
    """Recurrent state cannot go back further than its snapshots: a regenerate, or a
    follow-up parting inside the answer (its text tokenized otherwise), takes it back to
    the checkpoint the prompt left, as llama-server's context checkpoints do. Only the
    answer's tokens are read again, not the conversation, and the next logits are bit
    for bit those of reading the same tokens after the prompt."""
    path = tiny_models[arch]
    gen = GenerationConfig(16)
    with Target(path, TargetConfig(n_ctx=512, n_threads=2)) as target:
        prompt = target.tokenize(PROMPTS[1], special=False)
        answer = generate(target, prompt, None, gen).tokens
        assert len(target.tokens) > len(prompt) + 1
        again = generate(target, prompt, None, gen)  # a regenerate
        assert again.tokens == answer and target.n_read_again == 0
        parted = prompt + answer[:-4] + target.tokenize(" and then", special=False)
        got = target.prefill(parted)
        assert got.n_reused == len(prompt) + len(answer) - 4
        assert target.n_read_again == len(answer) - 4  # the answer's, not the prompt's
    with Target(path, TargetConfig(n_ctx=512, n_threads=2)) as fresh:
        fresh.prefill(prompt)
        fresh.sequence.evaluate_cells_only(answer[:-4])
        want = fresh.prefill(parted)
        assert fresh.n_read_again == 0
    np.testing.assert_array_equal(got.logits, want.logits)


@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_a_prompt_parting_one_token_back_after_a_prompt_goes_back_to_a_checkpoint(
        arch: str, tiny_models: dict[str, Path]) -> None:
    """A plain session (no snapshots) whose next prompt parts one token before the
    cache's end, where the last batch read was a prompt: its state cannot go back that
    one token, so it goes back to the earlier prompt's checkpoint and reads from there,
    not the whole conversation (the differential on lfm2: 4 of 609 follow-ups did)."""
    path = tiny_models[arch]
    with Target(path, TargetConfig(n_ctx=512, n_threads=2)) as target:
        target.set_state_snapshots(0)  # as a plain session keeps
        first = target.tokenize(PROMPTS[1], special=False)
        answer = generate(target, first, None, GenerationConfig(8)).tokens
        second = first + answer + target.tokenize(" and then", special=False)
        target.prefill(second)
        parted = second[:-1] + target.tokenize(" or", special=False)
        got = target.prefill(parted)
        assert got.n_reused == len(second) - 1
        assert target.n_read_again == len(second) - 1 - len(first)  # not the first prompt
    with Target(path, TargetConfig(n_ctx=512, n_threads=2)) as fresh:
        fresh.set_state_snapshots(0)
        fresh.prefill(first)
        fresh.sequence.evaluate_cells_only(second[len(first):-1])
        want = fresh.prefill(parted)
    np.testing.assert_array_equal(got.logits, want.logits)


def test_a_latent_attention_chat_that_outgrows_the_context_is_read_again_not_shifted(
        tiny_models: dict[str, Path]) -> None:
    """llama.cpp's K shift of a latent-attention cache in Q8_0 crashes the process (the
    differential found it on deepseek2). The target says it cannot shift, so a chat whose
    oldest turns are dropped is read again, and answers as a fresh read does."""
    with Target(tiny_models["deepseek2"], TargetConfig(n_ctx=512, n_threads=2)) as target:
        assert not target.ctx.can_shift
        head = target.tokenize(PROMPTS[0], special=False)
        dropped = target.tokenize(" " + " ".join([PROMPTS[1]] * 3), special=False)
        kept = target.tokenize(" " + " ".join(PROMPTS * 2), special=False)
        generate(target, head + dropped + kept, None, GenerationConfig(4))
        prompt = head + kept
        warm = generate(target, prompt, None, GenerationConfig(8))
        assert warm.stats.n_prompt_reused <= len(head) + 1
        target.reset(cold=True)
        assert generate(target, prompt, None, GenerationConfig(8)).tokens == warm.tokens
    with Target(tiny_models["deepseek2"], TargetConfig(n_ctx=512, n_threads=2, type_k="f16",
                                                       type_v="f16")) as target:
        assert target.ctx.can_shift  # an F16 cache shifts


@pytest.mark.parametrize("arch", ["gemma3", "gpt-oss"])
def test_a_sliding_window_prompt_going_back_into_a_moved_prompt_goes_on_from_the_cache(
        arch: str, tiny_models: dict[str, Path]) -> None:
    """A long prompt moved in from the F16 context leaves the window cache only its last
    window. A prompt parting inside it (an edit, a new chat with the same system prompt)
    still goes on from the cache: the window before the parting point is moved again from
    the F16 context (llama-server keeps checkpoints of the window cache for this), and its
    logits are a fresh read's up to F16 against Q8_0 keys (attending to cells that were
    not there, gemma3 had been 4.8 apart). Drafted decoding after it gives plain
    decoding's tokens. Where the F16 context no longer holds those cells the prompt is
    read afresh: a fresh read's logits bit for bit."""
    config = TargetConfig(n_ctx=1024, n_threads=2, flash_attn=True)
    gen = GenerationConfig(24, max_draft=16)
    with Target(tiny_models[arch], config) as target:
        long = target.tokenize(" ".join(f"word{i}" for i in range(200)), special=False)
        other = target.tokenize(" and then something else entirely", special=False)
        for shared in (20, len(long) // 2, len(long) - 10):
            target.reset(cold=True)
            generate(target, long, None, GenerationConfig(4))
            gap = target.sequence.window_gap
            assert gap is not None and gap[0] < shared < gap[1] + TinyShape().window
            prompt = long[:shared] + other
            warm = target.prefill(prompt)
            assert warm.n_reused == shared, (arch, shared)
            logits = warm.logits.copy()
            target.reset(cold=True)
            assert np.abs(logits - target.prefill(prompt).logits).max() < 0.5, (arch, shared)
        # Drafted after a refill, as plain decoding after the same one.
        prompt = long[:len(long) // 2] + other
        answers = []
        for drafter in (None, "memory"):
            target.reset(cold=True)
            generate(target, long, None, GenerationConfig(4))
            memory = None
            if drafter:
                memory = SuffixIndex()
                memory.insert(prompt + _perturbed(answers[0], 6, 1))
            out = generate(target, prompt, memory and MemoryDrafter(memory), gen,
                           cost=VerifyCostModel(slope=0.0, learn=False), remember=False)
            assert out.stats.n_prompt_reused == len(prompt) - len(other)
            answers.append(out.tokens)
            if drafter:
                assert sum(s.n_accepted for s in out.stats.steps) > 4
        assert answers[0] == answers[1], arch
        # The F16 context emptied: nothing to move again, so the prompt is read afresh.
        target.reset(cold=True)
        generate(target, long, None, GenerationConfig(4))
        target.prompts.f16.clear()
        warm_logits = target.prefill(prompt).logits.copy()
        target.reset(cold=True)
        assert np.array_equal(warm_logits, target.prefill(prompt).logits), arch
        target.reset(cold=True)
        answer = generate(target, long, None, GenerationConfig(4)).tokens
        follow = generate(target, long + answer + other, None, GenerationConfig(4))
        assert follow.stats.n_prompt_reused >= len(long)


def test_a_window_moved_again_after_cells_kept_before_the_hole(
        tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A short turn read in the target's own cache, then a long one moved in: the hole
    starts after the short turn. An edit inside the long turn moves the window before it
    again, and the hole shrinks to what lies before that window; the window cache then
    holds every position from the window's start. Where the move fails, the sequence is
    cut to the hole's start and the prompt read from there, with no error: the same
    logits as a fresh read."""
    from engine.errors import NativeError
    from engine.runtime.f16_prefill import F16Prefill

    window = TinyShape().window
    config = TargetConfig(n_ctx=1024, n_threads=2, flash_attn=True)
    with Target(tiny_models["gemma3"], config) as target:
        short = target.tokenize(" ".join(PROMPTS[:1]), special=False)
        assert len(short) < 64  # read in the target's own cache
        long = short + target.tokenize(" ".join(f"word{i}" for i in range(150)),
                                       special=False)
        other = target.tokenize(" and then something else entirely", special=False)
        shared = (len(short) + len(long)) // 2

        def after_the_long_turn() -> tuple[int, int]:
            target.reset(cold=True)
            generate(target, short, None, GenerationConfig(2))
            generate(target, long, None, GenerationConfig(2))
            gap = target.sequence.window_gap
            assert gap is not None and gap[0] >= len(short) - 1 and gap[1] > shared
            return gap

        gap = after_the_long_turn()
        prompt = long[:shared] + other
        read = target.prefill(prompt)
        assert read.n_reused == shared
        lo = shared - window + 1
        assert target.sequence.window_gap == (gap[0], lo)
        assert target.ctx.kv_pos_min(0) == 0  # the short turn's cells, kept
        logits = read.logits.copy()

        def fails(self: F16Prefill, start: int, end: int) -> np.ndarray:
            raise NativeError("llama_state_seq_set_data", 0, "planted failure")

        after_the_long_turn()
        monkeypatch.setattr(F16Prefill, "cells_from", fails)
        again = target.prefill(prompt)
        assert again.n_reused <= gap[0] and target.f16_prefill_off
        assert target.sequence.window_gap is None
        monkeypatch.undo()
    with Target(tiny_models["gemma3"], replace(config, f16_prefill=False)) as fresh:
        expected = fresh.prefill(prompt).logits
    assert np.array_equal(again.logits, expected)  # read in the Q8_0 cache, as afresh
    assert np.abs(logits - expected).max() < 0.5


@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_a_hybrid_prompt_parting_inside_a_drafted_answers_last_batch_reads_as_plain(
        arch: str, tmp_path: Path) -> None:
    """A next prompt that parts a few tokens before the answer's end (its text tokenized
    otherwise): plain decoding's state cannot go back there and is read again; a drafted
    answer's last verification holds snapshots that reach, from other sums. The drafted
    session reads again too, so the next logits are plain decoding's bit for bit (lfm2,
    the differential: 2.7e-5 apart)."""
    from tests.differential import matrix_model

    gen = GenerationConfig(N_NEW, max_draft=16)
    path, _ = matrix_model(arch, tmp_path)  # the differential's file (layers damped)
    with Target(path, TargetConfig(n_ctx=512, n_threads=2)) as target:
        prompt = target.tokenize(PROMPTS[0], special=False)
        other = target.tokenize(" and then something else", special=False)
        target.reset(cold=True)
        plain = generate(target, prompt, None, gen).tokens
        parted = prompt + plain[:-3] + other  # two tokens before the cache's end
        expected = target.prefill(parted).logits.copy()
        memory = SuffixIndex()
        memory.insert(prompt + plain)  # drafts the whole answer: its last batch is long
        target.reset(cold=True)
        out = generate(target, prompt, MemoryDrafter(memory), gen,
                       cost=VerifyCostModel(slope=0.0, learn=False), remember=False)
        assert out.tokens == plain and out.stats.steps[-1].n_accepted >= 3
        assert np.array_equal(target.prefill(parted).logits, expected), arch


@pytest.mark.parametrize("arch", ["gemma3", "gpt-oss"])
def test_a_regenerate_after_a_window_of_answer_reuses_the_whole_prompt(
        arch: str, tiny_models: dict[str, Path]) -> None:
    """A regenerate after an answer longer than the window goes on from the whole
    prompt, not from what a moved window left (116 of 376 tokens once), and answers as
    the first: with flash attention (the rule for sliding-window models: the prompt read
    in the F16 context, its last window moved in) and without (read in the target's own
    cache, whose window cache is full size)."""
    for flash_attn in (None, False):
        config = TargetConfig(n_ctx=1024, n_threads=2, flash_attn=flash_attn)
        with Target(tiny_models[arch], config) as target:
            assert target.flash_attn is (flash_attn is None)
            prompt = target.tokenize(" ".join(PROMPTS * 6), special=False)
            assert len(prompt) > 4 * TinyShape().window
            first = generate(target, prompt, None, GenerationConfig(3 * TinyShape().window))
            assert len(first.tokens) > TinyShape().window
            again = generate(target, prompt, None, GenerationConfig(3 * TinyShape().window))
            assert again.stats.n_prompt_reused in (len(prompt) - 1, len(prompt)), flash_attn
            assert again.tokens == first.tokens
