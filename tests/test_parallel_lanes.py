"""Several answers at once (engine.decoding.parallel): each answer decoded as a row of a
shared batch is exactly its answer alone, token for token and in its log probabilities,
greedy and seeded, with a grammar too; and the rows really were batched."""

from __future__ import annotations

import threading

import pytest

from engine.decoding.generation import GenerationConfig, generate
from engine.decoding.parallel import ParallelLanes
from engine.decoding.sampling import SamplingParams
from engine.planning.kernels import SHORT_BATCH
from engine.runtime.target import Target, TargetConfig
from tests.conftest import pick_per_category

YES_NO = 'root ::= ("yes" | "no") " because " [a-z ]+ "."'


def _configs() -> list[GenerationConfig]:
    return [GenerationConfig(40, logprobs=2),
            GenerationConfig(24),
            GenerationConfig(40, SamplingParams(temperature=0.8, top_p=0.95, seed=7),
                             logprobs=1),
            GenerationConfig(32, grammar=YES_NO)]


def _answers_together(target, prompts, configs):  # noqa: ANN001, ANN202
    lanes = ParallelLanes(target, len(prompts))
    results: list = [None] * len(prompts)
    errors: list[BaseException] = []

    def answer(i: int) -> None:
        lane = lanes.lane()
        try:
            results[i] = generate(lane, prompts[i], None, configs[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            lane.release()

    threads = [threading.Thread(target=answer, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    closer = threading.Thread(target=lambda: ([t.join() for t in threads], lanes.close()))
    closer.start()
    lanes.serve_forever()  # the native work, on this thread (the target's)
    closer.join()
    lanes.free()
    assert not errors, errors
    return results, lanes.rows_decoded


def test_answers_together_equal_their_answers_alone(fresh_target, dev_prompts):
    t = fresh_target
    rows = pick_per_category(dev_prompts, 1)[:4]
    prompts = [t.chat_prompt([{"role": "user", "content": r["turns"][0]}]) for r in rows]
    prompts[3] = t.chat_prompt([{"role": "user", "content": "Is the sea salty? Answer yes "
                                 "or no, then why."}])
    configs = _configs()
    alone = []
    for prompt, config in zip(prompts, configs, strict=True):
        t.set_features(False)
        alone.append(generate(t, prompt, None, config))
    together, batches = _answers_together(t, prompts, configs)
    for a, b in zip(alone, together, strict=True):
        assert b.tokens == a.tokens and b.finish_reason == a.finish_reason
        assert b.text == a.text
    for i in (0, 2):  # the target's own numbers, bit for bit
        assert [lp.logprob for lp in together[i].logprobs] == \
            [lp.logprob for lp in alone[i].logprobs]
    assert together[3].text.startswith(("yes because", "no because"))
    assert max(batches) >= 3  # answers shared batches
    assert sum(batches) == sum(len(r.tokens) for r in together) - len(together) + sum(
        r.finish_reason == "eos" for r in together)


def _long_question(topic: str, n_facts: int) -> str:
    facts = " ".join(f"Fact {i}: the {topic} log for day {i} reads {i * 7 % 13} units "
                     f"at station {i % 5}." for i in range(n_facts))
    return f"{facts}\nIn one sentence, what do these {topic} logs say?"


@pytest.mark.parametrize(("n_facts", "n_tokens"), [
    (16, (300, 500)),
    # The reported case (~1.5k tokens each); four such prompts take minutes on 2 cores.
    pytest.param(64, (1300, 1800), marks=pytest.mark.slow)])
def test_long_prompts_read_in_the_f16_context_answer_together_as_alone(
        quantized, n_facts: int, n_tokens: tuple[int, int]):
    """On a K-quant the long prompts are read in the F16 context and their cells wait
    there (a pending move) after the first token: a lane's prompt must be settled into
    the target's cache before its cells move to the lane, or the lane decodes with none
    (llama.cpp: "invalid input batch"). Two long questions at once, greedy, equal their
    answers alone. Repacked batches of up to 3 rows are exact on Q4_K_M."""
    config = TargetConfig(n_ctx=2048, n_threads=2, repack=True, max_batch=SHORT_BATCH)
    with Target(quantized("q4_k_m"), config) as t:
        assert t.f16_prefill_off is None  # long prompts go through the F16 context
        prompts = [t.chat_prompt([{"role": "user",
                                   "content": _long_question(topic, n_facts)}])
                   for topic in ("rainfall", "traffic")]
        assert all(n_tokens[0] <= len(p) <= n_tokens[1] for p in prompts), \
            [len(p) for p in prompts]
        configs = [GenerationConfig(8), GenerationConfig(8)]
        alone = []
        for prompt, config_ in zip(prompts, configs, strict=True):
            t.set_features(False)
            alone.append(generate(t, prompt, None, config_))
        together, batches = _answers_together(t, prompts, configs)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert max(batches) == 2  # the two answers shared batches
