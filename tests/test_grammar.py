"""Constrained decoding (GBNF, JSON schemas) and log probabilities on the bundled model:
every answer obeys its grammar, and drafted decoding under a grammar equals plain decoding
under it, greedy and sampled, with the same log probabilities."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.decoding.grammar import Grammar
from engine.decoding.json_grammar import json_object_grammar, json_schema_grammar
from engine.decoding.sampling import SamplingParams
from engine.drafters.base import Drafter
from engine.errors import InvalidSamplingError
from engine.runtime.draft_tree import DraftTree

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 24}},
          "required": ["name", "age", "city"]}
QUESTIONS = ("Maria is 34 and lives in Lisbon. Give her name, age and city as JSON.",
             "Describe Tom, a 52 year old baker from Leeds, as JSON with name, age and city.")


class OracleDrafter(Drafter):
    """Drafts the known answer's next tokens, sometimes after a wrong token and usually
    followed by one (random ids: mostly tokens the grammar forbids), so drafts are cut,
    accepted whole and rejected part way."""

    name = "oracle"

    def __init__(self, oracle: list[int], seed: int, n_vocab: int) -> None:
        self.oracle, self.n_vocab = oracle, n_vocab
        self.rng = np.random.default_rng(seed)
        self.n = 0

    def begin(self, context, features):  # noqa: ANN001
        self.n = 1

    def draft(self, max_tokens, token_time_s=0.0):  # noqa: ANN001
        tree = DraftTree()
        node = -1
        if self.rng.random() < 0.2:
            node = tree.add(int(self.rng.integers(self.n_vocab)), node)
        for tok in self.oracle[self.n:self.n + int(self.rng.integers(1, 8))]:
            node = tree.add(tok, node)
        node = tree.add(int(self.rng.integers(self.n_vocab)), node)
        return tree.truncated(max_tokens)

    def accept(self, new_tokens, features):  # noqa: ANN001
        self.n += len(new_tokens)


def _answer(target, question: str, config: GenerationConfig, drafter=None):  # noqa: ANN001
    target.reset()
    prompt = target.chat_prompt([{"role": "user", "content": question}])
    return generate(target, prompt, drafter, config,
                    cost=VerifyCostModel(slope=0.0, learn=False))


def test_a_grammar_llama_cpp_cannot_parse_is_refused_by_name(target):
    for bad in ('root ::= "a" | undefined-rule', "root ::= (", 'other ::= "x"'):
        with pytest.raises(InvalidSamplingError, match="grammar"):
            Grammar.compile(target.model, bad)
    with pytest.raises(InvalidSamplingError, match="response_format"):
        json_schema_grammar({"$ref": "https://example.com/schema.json"})


def test_the_grammar_state_admits_and_masks_as_the_grammar_says(target):
    yes = target.tokenize("yes", special=False)
    grammar = Grammar.compile(target.model, 'root ::= "yes" | "no"')
    try:
        allowed = grammar.mask()
        assert allowed[yes[0]] and allowed.sum() < 20  # a few prefixes of yes and no
        assert not any(allowed[t] for t in grammar.eog)  # not complete yet
        assert not grammar.allowed(target.tokenize(" maybe", special=False)[0])
        copy = grammar.clone()
        for tok in yes:
            copy.accept(tok)
        assert copy.mask().sum() == len(grammar.eog & set(np.flatnonzero(copy.mask())))
        with pytest.raises(ValueError):
            copy.accept(yes[0])  # complete: only an end of generation is admitted
        copy.close()
        assert grammar.allowed(yes[0])  # the original state did not move
    finally:
        grammar.close()


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=7)],
                         ids=["greedy", "seeded"])
def test_answers_under_a_json_schema_parse_and_drafting_changes_nothing(target, sampling):
    gbnf = json_schema_grammar(PERSON)
    config = GenerationConfig(160, sampling=sampling, grammar=gbnf, logprobs=2)
    accepted = cut = 0
    for i, question in enumerate(QUESTIONS):
        plain = _answer(target, question, config)
        assert plain.finish_reason == "eos", plain.text
        person = json.loads(plain.text)
        assert set(person) == {"name", "age", "city"} and isinstance(person["age"], int)
        for seed in range(3):
            drafter = OracleDrafter(plain.tokens, seed + 10 * i, target.n_vocab)
            out = _answer(target, question, config, drafter)
            assert out.tokens == plain.tokens, (question, seed)
            assert out.logprobs == plain.logprobs
            accepted += sum(s.n_accepted for s in out.stats.steps)
            cut += sum(s.n_proposed for s in out.stats.steps)
    assert accepted >= 40  # the known answer's tokens were drafted and kept
    lp = plain.logprobs
    assert lp is not None and len(lp) == len(plain.tokens)
    assert all(t.logprob <= 0 and len(t.top) == 2 for t in lp)


def test_json_object_turns_prose_into_an_object(target):
    """json_object makes the answer an object where the model writes prose. (The
    bundled 135M model does not close a free-form object within 200 tokens: it repeats a
    key. A schema, above, bounds it.)"""
    question = "Tell me about the moon in two sentences."
    free = _answer(target, question, GenerationConfig(48))
    forced = _answer(target, question, GenerationConfig(64, grammar=json_object_grammar()))
    assert not free.text.lstrip().startswith("{")
    assert forced.text.startswith("{") and '"' in forced.text
    if forced.finish_reason == "eos":
        assert isinstance(json.loads(forced.text), dict)


def test_log_probabilities_are_the_target_distribution(target):
    """Greedy without a grammar: each token is its position's likeliest, and the
    reported numbers are that row's log-softmax."""
    out = _answer(target, QUESTIONS[0], GenerationConfig(24, logprobs=3))
    assert out.logprobs is not None and len(out.logprobs) == len(out.tokens)
    for t in out.logprobs:
        assert t.top[0][0] == t.token and t.top[0][2] == t.logprob
        assert t.top[0][2] >= t.top[1][2] >= t.top[2][2]
        assert sum(np.exp([lp for _, _, lp in t.top])) <= 1.0 + 1e-9
        assert t.piece == target.token_bytes(t.token)


class SilentDrafter(Drafter):
    """Never proposes anything: whatever is drafted comes from the grammar."""

    name = "silent"

    def begin(self, context, features):  # noqa: ANN001
        pass

    def draft(self, max_tokens, token_time_s=0.0):  # noqa: ANN001
        return DraftTree()

    def accept(self, new_tokens, features):  # noqa: ANN001
        pass


def test_the_text_a_schema_leaves_no_choice_in_is_drafted_whole(target):
    """Keys and punctuation between a schema's values are the grammar's only way on: they
    are drafted from the grammar itself (a drafter that proposes nothing still gets
    them accepted), and the answer is plain decoding's."""
    config = GenerationConfig(160, grammar=json_schema_grammar(PERSON))
    for question in QUESTIONS:
        plain = _answer(target, question, config)
        out = _answer(target, question, config, SilentDrafter())
        assert out.tokens == plain.tokens
        assert sum(s.n_accepted for s in out.stats.steps) >= 4, plain.text
        assert len(out.stats.steps) < len(plain.stats.steps)
    grammar = Grammar.compile(target.model, json_schema_grammar(PERSON))
    try:
        assert grammar.forced_text() == '{"name":"'  # compact: no optional spaces
        grammar.accept(target.tokenize("{", special=False)[0])
        assert grammar.forced_text() == '"name":"'
        assert grammar.forced_text(3) == '"na'
    finally:
        grammar.close()
