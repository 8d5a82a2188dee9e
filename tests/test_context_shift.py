"""A long chat's dropped turns do not cost a prefill of everything after them (issue 36,
item 2): the cached cells after the cut are shifted back over it and the sequence written
back in position order; the result matches llama.cpp's own shift, answers equal plain
decoding's from the same cache, and a chat in a small context reuses its cache across the
drops."""

from __future__ import annotations

import numpy as np
import pytest

from engine.decoding.generation import GenerationConfig, generate
from engine.drafters.lookup import LookupConfig, PromptLookupDrafter
from engine.runtime.prefill import SHIFT_MIN_KEPT
from engine.runtime.sequences import find_cut
from engine.session import Engine, EngineConfig


def test_a_cut_is_found_after_the_common_prefix():
    cached = [1, 2, 3] + list(range(100, 120)) + list(range(200, 300))
    prompt = [1, 2, 3] + list(range(200, 300)) + [7, 7]
    assert find_cut(cached, prompt, 3, 64) == (20, 100)
    assert find_cut(cached, prompt, 3, 101) is None  # too little kept to be worth it
    assert find_cut(cached, [1, 2, 3, 9, 9] + list(range(200, 300)), 3, 64) is None
    # A token of the kept part also inside the cut: the true start is still found.
    cached = [1] + [200, 5, 5] + list(range(200, 300))
    assert find_cut(cached, [1] + list(range(200, 300)), 1, 64) == (3, 100)


def _conversation(dev_prompts: list[dict], n: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for row in dev_prompts[:n]:
        messages += [{"role": "user", "content": row["turns"][0]},
                     {"role": "assistant", "content": "Sure. " + row["turns"][0][:300]}]
    return messages


def _prompts(target, dev_prompts) -> tuple[list[int], list[int], int]:  # noqa: ANN001
    """A conversation's prompt, the same with its first exchange dropped and a new
    question, and where they part."""
    messages = _conversation(dev_prompts, 5)
    question = {"role": "user", "content": "Now say all of that in one sentence."}
    long = target.chat_prompt(messages + [question])
    short = target.chat_prompt(messages[:1] + messages[3:] + [question])
    head = target.chat_prompt(messages[:1])  # ends with the assistant's opening
    n_same = len(head) - 3
    assert long[:n_same] == short[:n_same] and len(long) - len(short) > 20
    return long[:-20], short, n_same


def test_the_shifted_cache_is_llama_cpps_own_shift_in_position_order(fresh_target,
                                                                    dev_prompts):
    """The cells after the cut moved back and written from the start hold what llama.cpp's
    shift in place holds (byte for byte: positions, rotated K, V), in one run of cells;
    the next token is the one a fresh prefill of the shortened prompt picks."""
    t = fresh_target
    cached, prompt, n_same = _prompts(t, dev_prompts)
    n_cut, n_kept = find_cut(cached, prompt, n_same, SHIFT_MIN_KEPT)
    t.reset()
    t.prefill(cached)
    t.settle()  # the prompt's cells, into the cache shifted below
    end = n_same + n_cut + n_kept
    t.ctx.kv_remove(0, end, -1)
    t.ctx.kv_remove(0, n_same, n_same + n_cut)
    t.ctx.kv_shift(0, n_same + n_cut, end, -n_cut)
    t.batch.fill([cached[0]], [end], [(1,)], [False])  # llama.cpp shifts at a decode
    t.ctx.decode(t.batch)
    t.ctx.kv_remove(1, -1, -1)
    in_place = t.ctx.state_seq_get(0)
    t.reset()
    t.prefill(cached)
    assert t.prompts._keep_across_a_cut(prompt, n_same) == n_same + n_kept
    assert t.ctx.state_seq_get(0) == in_place
    assert t.tokens == prompt[:n_same + n_kept]
    shifted = t.prefill(prompt)
    t.settle()
    assert shifted.n_reused == n_same + n_kept and t.ctx.kv_pos_max(0) == len(prompt) - 1
    t.reset(cold=True)
    fresh = t.prefill(prompt)
    assert int(np.argmax(shifted.logits)) == int(np.argmax(fresh.logits))
    t.reset()


@pytest.mark.parametrize("branches", [1, 3], ids=["chain", "tree"])
def test_answers_after_a_shift_equal_plain_decoding(fresh_target, dev_prompts, branches):
    t = fresh_target
    cached, prompt, n_same = _prompts(t, dev_prompts)
    gen = GenerationConfig(48)
    answers = []
    for drafter in (None, PromptLookupDrafter(LookupConfig(max_branches=branches))):
        t.reset()
        generate(t, cached, None, GenerationConfig(8))
        out = generate(t, prompt, drafter, gen)
        assert out.stats.n_prompt_reused > n_same + SHIFT_MIN_KEPT
        answers.append(out)
    assert answers[1].tokens == answers[0].tokens
    assert sum(s.n_accepted for s in answers[1].stats.steps) > 0
    t.reset()


def test_a_long_chat_reuses_its_cache_across_dropped_turns(model_path, tmp_path,
                                                          dev_prompts):
    """Through two engines, one drafting and one plain, in a context the chat outgrows:
    after each drop the cache keeps all but the dropped exchanges, and every answer, drop
    or not, is the plain engine's."""
    def engine(drafter: str) -> Engine:
        return Engine(EngineConfig(model_path=model_path, drafter=drafter, n_ctx=768,
                                   n_threads=2, cache_dir=tmp_path / drafter,
                                   memory_dir=tmp_path / drafter))

    with engine("lookup") as drafted, engine("none") as plain:
        messages: list[dict[str, str]] = [{"role": "system", "content": "Be brief."}]
        drops = 0
        for row in dev_prompts[:10]:
            messages.append({"role": "user", "content": row["turns"][0][:400]})
            fitted = drafted.fit_chat(messages, 48)
            want = plain.generate(fitted.tokens, GenerationConfig(48))
            got = drafted.generate(fitted.tokens, GenerationConfig(48))
            assert got.tokens == want.tokens, row["question_id"]
            if fitted.n_dropped:
                drops += 1
                # All but the dropped exchanges and the new question came from the cache.
                assert got.stats.n_prompt_reused > len(fitted.tokens) // 2, got.stats
            messages.append({"role": "assistant",
                             "content": plain.target.detokenize(want.tokens)})
        assert drops >= 3
