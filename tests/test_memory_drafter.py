"""The suffix index and the drafter with memory: pure logic, no model."""

import random

import pytest

from engine.drafters.memory import MemoryConfig, MemoryDrafter
from engine.drafters.suffix_index import (
    FORMAT_VERSION,
    IndexConfig,
    MemoryFileError,
    SuffixIndex,
    open_memory,
)
from tests.tree_helpers import assert_well_formed, paths

SMALL = IndexConfig(anchor_orders=(2, 4), min_match=2, min_buckets=16)


# -- the index ----------------------------------------------------------------------------


def test_longest_match_wins():
    idx = SuffixIndex(SMALL)
    idx.insert([5, 1, 2, 7, 9, 6, 1, 2, 8, 3])
    spec = idx.continuations([6, 1, 2], max_depth=8, max_nodes=16)
    assert spec.match_len == 3 and spec.tree.tokens == [8, 3] and spec.tree.is_chain()
    spec = idx.continuations([4, 1, 2], max_depth=8, max_nodes=16)  # only "1 2" matches
    assert spec.match_len == 2 and sorted(t for t, p in zip(spec.tree.tokens, spec.tree.parents,
                                                            strict=True) if p == -1) == [7, 8]


def test_counts_become_conditional_frequencies():
    idx = SuffixIndex(SMALL)
    for tail in ([4, 6], [4, 7], [4, 6], [5, 6]):
        idx.insert([1, 2, 3, *tail])
    spec = idx.continuations([9, 1, 2, 3], max_depth=4, max_nodes=16)
    got = paths(spec.tree)
    assert got[(4,)] == pytest.approx(0.75) and got[(5,)] == pytest.approx(0.25)
    assert got[(4, 6)] == pytest.approx(0.5) and got[(4, 7)] == pytest.approx(0.25)
    assert got[(5, 6)] == pytest.approx(0.25)
    assert spec.tree.tokens[:2] == [4, 6]  # best first
    assert_well_formed(spec.tree)


def test_no_match_and_short_match_propose_nothing():
    idx = SuffixIndex(SMALL)
    idx.insert([1, 2, 3, 4, 5])
    assert len(idx.continuations([7, 8, 9], 8, 16).tree) == 0
    assert len(idx.continuations([7, 8, 4], 8, 16).tree) == 0  # a match of one token
    assert len(SuffixIndex(SMALL).continuations([1, 2], 8, 16).tree) == 0


def test_size_grows_with_the_match_and_respects_caps():
    idx = SuffixIndex(SMALL)
    seq = list(range(100, 140))
    idx.insert(seq + [0] + seq)
    short = idx.continuations([0, 100, 101], max_depth=30, max_nodes=30)
    long = idx.continuations(seq[:12], max_depth=30, max_nodes=30)
    assert short.match_len == 3 and len(short.tree) == 6  # nodes_per_match x 3
    assert long.match_len == 12 and len(long.tree) == 24
    assert len(idx.continuations(seq[:12], max_depth=5, max_nodes=30).tree) == 5
    assert len(idx.continuations(seq[:12], max_depth=30, max_nodes=3).tree) == 3


def test_no_continuation_crosses_a_sequence_boundary():
    idx = SuffixIndex(SMALL)
    idx.insert([1, 2, 3])
    idx.insert([4, 5, 6])
    assert len(idx.continuations([1, 2, 3], 8, 16).tree) == 0  # 3 ended its sequence
    assert len(idx.continuations([2, 3, 4], 8, 16).tree) == 0  # "3 4" never occurred
    idx.extend([1, 2, 9])  # extends the last sequence: 4 5 6 1 2 9
    assert idx.continuations([6, 1, 2], 8, 16).tree.tokens == [9]


def test_random_trees_are_well_formed():
    rng = random.Random(1)
    idx = SuffixIndex(SMALL)
    for _ in range(30):
        idx.insert([rng.randrange(6) for _ in range(rng.randrange(5, 60))])
    for _ in range(200):
        tail = [rng.randrange(6) for _ in range(8)]
        spec = idx.continuations(tail, max_depth=6, max_nodes=20, min_score=0.001)
        assert_well_formed(spec.tree)
        assert len(spec.cond) == len(spec.tree)


def test_memory_stays_under_its_bounds():
    rng = random.Random(0)
    # 200k random tokens: first the token bound binds, then a tight byte bound does
    for cfg in (IndexConfig(max_tokens=20_000, max_bytes=1_000_000),
                IndexConfig(max_tokens=20_000, max_bytes=300_000)):
        idx = SuffixIndex(cfg)
        for _ in range(100):
            idx.insert([rng.randrange(50_000) for _ in range(1000)])
            assert idx.n_entries <= cfg.max_tokens and idx.nbytes() <= cfg.max_bytes
        assert idx.n_evictions > 0 and idx.n_entries > 2_000
    one = SuffixIndex(IndexConfig(max_tokens=20_000))
    one.insert(list(range(50_000)))  # one sequence beyond the bound keeps its tail
    assert one.n_entries <= 20_000
    assert one.continuations([49_996, 49_997, 49_998], 4, 4).tree.tokens == [49_999]


def test_eviction_drops_the_least_recently_used():
    idx = SuffixIndex(IndexConfig(max_tokens=260, evict_to=0.8))
    old = [1000 + i for i in range(100)]
    idx.insert(old)
    idx.insert([2000 + i for i in range(100)])
    idx.touch(idx.continuations(old[:5], 4, 4).positions)  # the first one was just useful
    idx.insert([3000 + i for i in range(100)])
    assert len(idx.continuations(old[:5], 4, 4).tree) == 4
    assert len(idx.continuations([2000, 2001, 2002], 4, 4).tree) == 0


# -- persistence --------------------------------------------------------------------------


def filled_index() -> SuffixIndex:
    idx = SuffixIndex(tag="model-a")
    rng = random.Random(2)
    for _ in range(20):
        idx.insert([rng.randrange(40) for _ in range(200)])
    return idx


def test_save_load_round_trip_gives_identical_drafts(tmp_path):
    idx = filled_index()
    path = tmp_path / "memory.bin"
    idx.save(path)
    again = SuffixIndex.load(path, tag="model-a")
    assert again.n_entries == idx.n_entries and again.n_sequences == idx.n_sequences
    rng = random.Random(3)
    for _ in range(100):
        tail = [rng.randrange(40) for _ in range(10)]
        assert idx.continuations(tail, 8, 16) == again.continuations(tail, 8, 16)
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind


def test_missing_file_is_an_empty_memory(tmp_path):
    idx, note = open_memory(tmp_path / "none.bin")
    assert idx.n_entries == 0 and note == ""


def test_an_empty_memory_saves_and_loads(tmp_path):
    """A session whose first answer was not remembered still saves its memory."""
    path = tmp_path / "memory.bin"
    SuffixIndex(SMALL, tag="model-a").save(path)
    again, note = open_memory(path, tag="model-a")
    assert again.n_entries == 0 and again.n_sequences == 0 and note == ""


def corruptions(data: bytes) -> dict[str, bytes]:
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    version = bytearray(data)
    version[8:12] = (FORMAT_VERSION + 1).to_bytes(4, "little")
    return {"truncated": data[:-7], "header only": data[:10], "flipped": bytes(flipped),
            "garbage": bytes(range(256)) * 4, "empty": b"", "version": bytes(version)}


def test_a_bad_file_gives_an_empty_memory_and_a_note(tmp_path):
    path = tmp_path / "memory.bin"
    filled_index().save(path)
    for what, data in corruptions(path.read_bytes()).items():
        bad = tmp_path / f"{what}.bin"
        bad.write_bytes(data)
        with pytest.raises(MemoryFileError):
            SuffixIndex.load(bad)
        idx, note = open_memory(bad)
        assert idx.n_entries == 0 and str(bad) in note, what


def test_a_memory_for_another_model_is_not_used(tmp_path):
    path = tmp_path / "memory.bin"
    filled_index().save(path)
    idx, note = open_memory(path, tag="model-b")
    assert idx.n_entries == 0 and idx.tag == "model-b" and "model-a" in note
    assert open_memory(path, tag="model-a")[0].n_entries > 0


# -- the drafter --------------------------------------------------------------------------

PROMPT = [900, 901, 902, 50, 51, 52, 53]  # a chat template and a question
ANSWER = [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]


def run_generation(d: MemoryDrafter, prompt: list[int], answer: list[int]) -> None:
    d.begin(prompt + answer[:1], None)
    d.accept(answer[1:], None)
    d.finish(prompt + answer)


def test_drafts_an_earlier_answer_when_the_question_comes_back():
    d = MemoryDrafter()
    run_generation(d, PROMPT, ANSWER)
    d.begin([1, 2, 3, *PROMPT, ANSWER[0]], None)  # another conversation, same question
    tree = d.draft(8)
    assert tree.tokens == ANSWER[1:9] and tree.is_chain()
    assert_well_formed(tree)
    assert d.stats()["memory_nodes"] == 8 and d.stats()["memory_entries"] > 0


def test_drafts_from_its_own_prompt():
    d = MemoryDrafter()
    d.begin([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], None)
    tree = d.draft(8)
    assert tree.tokens[:3] == [4, 5, 6]
    assert_well_formed(tree)


def test_nothing_without_a_match_or_before_begin():
    d = MemoryDrafter()
    assert len(d.draft(8)) == 0  # no generation yet: the first token is not known
    run_generation(d, PROMPT, ANSWER)
    assert len(d.draft(8)) == 0  # finished
    d.begin([7, 8, 9, 10, 11], None)
    assert len(d.draft(8)) == 0
    assert d.stats()["empty_drafts"] == 1


def test_drafts_respect_max_tokens():
    d = MemoryDrafter()
    for i in range(5):  # five answers to the same question, diverging
        run_generation(d, PROMPT, ANSWER[:3 + i] + [100 + i] * 5)
    d.begin([*PROMPT, ANSWER[0]], None)
    for n in (0, 1, 3, 7, 30):
        tree = d.draft(n)
        assert len(tree) <= n
        assert_well_formed(tree)
    assert len(d.draft(30)) > 8  # a tree with branches


def test_scores_learn_from_the_target():
    d = MemoryDrafter(config=MemoryConfig())
    ctx = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    d.begin(ctx, None)
    before = d.draft(8).scores
    d.accept([4, 7], None)  # the first token taken, then the target went its own way
    d.begin(ctx, None)
    after = d.draft(8).scores
    assert after[0] > before[0]
    assert after[1] / after[0] < before[1] / before[0]


def test_drafts_are_deterministic():
    def make() -> MemoryDrafter:
        d = MemoryDrafter()
        rng = random.Random(5)
        for _ in range(10):
            run_generation(d, PROMPT, [rng.randrange(20) for _ in range(50)])
        d.begin([*PROMPT, 3], None)
        return d

    a, b = make(), make()
    for tok in range(20):
        ta, tb = a.draft(16), b.draft(16)
        assert ta == tb
        assert_well_formed(ta)
        a.accept([tok], None)
        b.accept([tok], None)


def test_finish_keeps_the_answer_and_the_last_turn_only():
    d = MemoryDrafter(config=MemoryConfig(prompt_tail=4))
    long_prompt = list(range(500, 600)) + PROMPT
    run_generation(d, long_prompt, ANSWER)
    assert d.memory.n_entries == 4 + len(ANSWER)


def test_merged_trees_stay_well_formed():
    rng = random.Random(7)
    d = MemoryDrafter()
    for _ in range(20):  # small vocabulary: both sources match often and overlap
        text = [rng.randrange(8) for _ in range(60)]
        d.begin(text[:20], None)
        for pos in range(20, 60, 2):
            tree = d.draft(rng.randrange(1, 24))
            assert_well_formed(tree)
            d.accept(text[pos:pos + 2], None)
        d.finish(text)
    assert d.stats()["memory_nodes"] > 0


def test_bad_token_ids_leave_the_index_as_it_was():
    idx = SuffixIndex(SMALL)
    idx.insert([1, 2, 3, 4])
    for bad in ([5, -1, 6], [5, 1 << 40]):
        with pytest.raises(ValueError):
            idx.insert(bad)
        with pytest.raises(ValueError):
            idx.extend(bad)
    assert idx.n_entries == 4 and idx.continuations([1, 2], 4, 4).tree.tokens == [3, 4]


def test_deep_levels_learn_apart_for_prompt_copies_and_an_answer_repeating_itself():
    """A summary that copies its prompt drifts off after a few tokens; a model repeating
    its own answer goes on. Past the first levels each is priced by its own record."""
    d = MemoryDrafter()
    copied = list(range(1, 13))
    for _ in range(20):  # copies of the prompt that hold for two tokens only
        d.begin([*copied, 99, 1, 2, 3], None)
        assert len(d.draft(16)) >= 6
        d.accept([4, 5, 77], None)
    d.begin([*copied, 99, 1, 2, 3], None)
    prompt_copy = d.draft(16).scores
    d.begin([50, 1], None)  # the answer writes the pattern, then starts it again
    d.accept([*copied[1:], 1, 2, 3], None)
    repeat = d.draft(16).scores
    assert len(prompt_copy) >= 6 and len(repeat) >= 6
    # The third level, given the second: twenty failures for prompt copies...
    assert prompt_copy[2] / prompt_copy[1] < 0.2
    assert repeat[2] / repeat[1] > 0.8  # ...and the prior for a repeat, which goes on
    assert prompt_copy[5] < repeat[5]


# -- in the benchmark ---------------------------------------------------------------------


def test_a_repeated_bench_run_never_drafts_from_its_own_answer(model_path, tmp_path):
    """With --repeat, a prompt's answer enters the memory once, after its last run, so
    every run drafts from what the earlier prompts left (a repeat that found its own
    answer copied it whole and made the figures meaningless)."""
    from app.benchmarks.bench import engine_runner, run_bench
    from engine.session import Engine, EngineConfig
    from training.spec_bench import BenchPrompt

    config = EngineConfig(model_path=model_path, drafter="memory", n_ctx=1024, n_threads=2,
                          cache_dir=tmp_path, memory_dir=tmp_path / "memory")
    with Engine(config) as engine:
        run = engine_runner(engine)
        calls: list[bool] = []

        def recording(tokens: list[int], max_tokens: int, remember: bool = True) -> dict:
            calls.append(remember)
            return run(tokens, max_tokens, remember)

        prompts = [BenchPrompt(1, "writing", ["Write two sentences about the sea."])]
        payload = run_bench(engine.target, prompts, {"memory": recording}, 24, repeat=3)
        assert calls[-3:] == [False, False, True]  # after the warm-up's one call
        assert engine.drafter.memory.n_sequences == 1
        # Each run drafted from the same (empty) memory: none copied a whole answer.
        assert payload["results"][0]["mean_accepted"] < 3
