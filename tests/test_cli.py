"""The ``tandem`` command as a user runs it: a real process on the real model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import DEV_PROMPTS


def _tandem(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TANDEM_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_generate_json(tandem_home, model_path):
    out = _tandem("generate", "--prompt", "Name a fruit.", "--max-tokens", "12",
                  "--threads", "2", "--json", home=tandem_home)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data) >= {"text", "tokens", "stats"}
    assert 1 <= len(data["tokens"]) <= 12 and data["text"]
    assert data["stats"]["ttft_s"] > 0
    # The drafter follows from the plan this machine's costs gave, whatever they are.
    assert data["stats"]["drafter"] == data["plan"]["runs"]


def test_generate_sampling_is_reproducible_with_a_seed(tandem_home, model_path):
    args = ("generate", "--prompt", "Tell me a story.", "--max-tokens", "16", "--threads",
            "2", "--temperature", "0.9", "--top-p", "0.95", "--seed", "7", "--json")
    a = json.loads(_tandem(*args, home=tandem_home).stdout)
    b = json.loads(_tandem(*args, home=tandem_home).stdout)
    assert a["tokens"] == b["tokens"]


# As a real process (the table of every bad input is tests/test_bad_input.py): these
# once ended in a native abort, a hang, or garbage.
@pytest.mark.parametrize("args, message", [
    (("--model", "/nonexistent/model.gguf"), "not found"),
    (("--temperature", "1e-300"), "--temperature must be 0 (greedy) or between"),
    (("--ctx", "1"), "--ctx must be at least 64 tokens, got 1"),
    (("--threads", "1000"), "--threads must be between 1 and"),
])
def test_bad_input_gives_a_clear_error(tandem_home, model_path, args, message):
    out = _tandem("generate", "--prompt", "hi", *args, home=tandem_home)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_bench_writes_results_and_resumes(tandem_home, model_path, tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [json.loads(x) for x in DEV_PROMPTS.read_text().splitlines()]
    picked = [next(r for r in rows if r["category"] == c) for c in ("summarization", "qa")]
    prompts.write_text("\n".join(json.dumps(r) for r in picked))
    out_json = tmp_path / "bench.json"
    out = _tandem("bench", "--prompts", str(prompts), "--per-category", "1", "--drafters",
                  "none,lookup", "--max-tokens", "16", "--threads", "2", "--json",
                  str(out_json), home=tandem_home)
    assert out.returncode == 0, out.stderr
    data = json.loads(out_json.read_text())
    assert len(data["results"]) == 4
    for r in data["results"]:
        assert set(r) >= {"question_id", "category", "drafter", "new_tokens", "seconds",
                          "tok_per_s", "mean_accepted", "ttft_s", "text"}
    assert set(data["summary"]["categories"]) == {"summarization", "qa"}
    assert "ratio to 'none'" in out.stdout and "summarization" in out.stdout
    # Prompt lookup is lossless: it wrote plain decoding's answer to both prompts.
    assert data["summary"]["overall"]["lookup"]["same_answer"] == 2
    assert "same answer" in out.stdout
    # A second run finds everything done and keeps the same results.
    again = _tandem("bench", "--prompts", str(prompts), "--max-tokens", "16", "--threads",
                    "2", "--json", str(out_json), home=tandem_home)
    assert again.returncode == 0, again.stderr
    assert json.loads(out_json.read_text())["results"] == data["results"]


def test_invalid_utf8_in_a_prompt_is_replaced_not_a_codec_error(tandem_home, model_path):
    from engine.runtime.native import utf8_bytes

    assert utf8_bytes("caf\udce9 ok") == "caf\ufffd ok".encode()  # argv's escape of 0xE9
    assert utf8_bytes("a\ud800b").decode() == "a\ufffd\ufffd\ufffdb"  # a lone surrogate
    env = dict(os.environ, TANDEM_HOME=str(tandem_home))
    out = subprocess.run([sys.executable.encode(), b"-m", b"app.cli", b"generate", b"--prompt",
                          b"Translate: caf\xe9 au lait \xff", b"--max-tokens", b"4",
                          b"--threads", b"2", b"--json"], capture_output=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    assert json.loads(out.stdout)["tokens"]


def test_generate_answers_to_a_json_schema_or_a_grammar(tandem_home, model_path, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps({
        "type": "object", "required": ["name", "age"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}))
    out = _tandem("generate", "--prompt", "Maria is 34. Give her name and age as JSON.",
                  "--json-schema", str(schema), "--max-tokens", "60", "--threads", "2",
                  "--json", home=tandem_home)
    assert out.returncode == 0, out.stderr
    person = json.loads(json.loads(out.stdout)["text"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    grammar = tmp_path / "yes-no.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    out = _tandem("generate", "--prompt", "Is the sky blue?", "--grammar", str(grammar),
                  "--threads", "2", "--json", home=tandem_home)
    assert json.loads(out.stdout)["text"] in ("yes", "no")
    grammar.write_text("root ::= (\n")
    out = _tandem("generate", "--prompt", "x", "--grammar", str(grammar), "--threads", "2",
                  home=tandem_home)
    assert out.returncode == 2 and "GBNF" in out.stderr
