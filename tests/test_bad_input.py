"""Every bad input a user can give, as two tables run in one process each: the CLI (its
``main``, as the terminal calls it) and the engine's API (one engine, one bad call after
another). Each case ends in its error class and one line that names what is wrong, with
no traceback; after each, the next valid request in the same process gives the same
answer as before."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.cli import main
from engine.decoding.generation import GenerationConfig
from engine.decoding.sampling import SamplingParams
from engine.drafters import DEFAULT_HEAD_DIR
from engine.errors import (
    ContextFullError,
    InvalidPromptError,
    InvalidSamplingError,
    InvalidSettingError,
    ModelLoadError,
    TandemError,
)
from engine.planning.planner import Overrides
from engine.session import Engine, EngineConfig
from tests.hub_server import write_tiny_gguf

VALID = ["generate", "--prompt", "Name a fruit.", "--max-tokens", "6", "--threads", "2",
         "--drafter", "none", "--json"]


@pytest.fixture(scope="module")
def files(tmp_path_factory, model_path) -> dict[str, str]:
    """Broken files of every kind a user can point Tandem at."""
    d = tmp_path_factory.mktemp("bad-input")
    text = d / "notes.gguf"
    text.write_text("these are my notes, not a model\n")
    truncated = d / "truncated.gguf"
    truncated.write_bytes(Path(model_path).read_bytes()[:3_000_000])
    vocab_only = write_tiny_gguf(d / "vocab-only.gguf", vocab_only=True)
    heads = {name: d / name for name in ("head-not-safetensors", "head-wrong-shapes",
                                         "head-bad-json")}
    for head in heads.values():
        shutil.copytree(DEFAULT_HEAD_DIR, head)
    (heads["head-not-safetensors"] / "head.safetensors").write_bytes(b"\x00" * 64)
    weights = heads["head-wrong-shapes"] / "head.safetensors"
    state = load_file(str(weights))
    first = sorted(k for k, v in state.items() if v.is_floating_point())[0]
    state[first] = torch.zeros(3, 5, dtype=state[first].dtype)
    save_file(state, str(weights))
    (heads["head-bad-json"] / "head.json").write_text("{ not json")
    prompts = d / "prompts.jsonl"
    prompts.write_text("this is not json\n")
    return {"text": str(text), "truncated": str(truncated), "vocab_only": str(vocab_only),
            "missing": str(d / "missing.gguf"), "directory": str(d), "prompts": str(prompts),
            **{k.replace("-", "_"): str(v) for k, v in heads.items()},
            "no_head": str(d / "no-such-head")}


def _run(argv: list[str], capsys) -> tuple[int, str, str]:  # noqa: ANN001
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own refusals (a choice or a type)
        rc = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return rc, out.out, out.err


# (case id, arguments after the command with {file} placeholders, exit code, the message)
CLI_CASES = [
    ("missing model", "generate --prompt hi --model {missing}", 2, "model file not found"),
    ("model is a directory", "generate --prompt hi --model {directory}", 2, "is not a file"),
    ("model is text", "generate --prompt hi --model {text}", 2, "is not a GGUF file"),
    ("truncated model", "generate --prompt hi --model {truncated}", 2, "the file is truncated"),
    ("vocabulary-only model", "generate --prompt hi --model {vocab_only}", 2,
     "holds no weights"),
    ("context too small", "generate --prompt hi --ctx 1", 2, "--ctx must be at least 64"),
    ("context negative", "generate --prompt hi --ctx -1", 2, "--ctx must be at least 64"),
    ("context past training", "generate --prompt hi --ctx 1000000", 2,
     "--ctx must be at most 8192 tokens (what"),
    ("context not a number", "generate --prompt hi --ctx lots", 2, "argument --ctx"),
    ("no threads", "generate --prompt hi --threads 0", 2, "--threads must be between 1 and"),
    ("too many threads", "generate --prompt hi --threads 1000", 2, "--threads must be between"),
    ("negative temperature", "generate --prompt hi --temperature -1", 2, "--temperature must"),
    ("tiny temperature", "generate --prompt hi --temperature 1e-300", 2,
     "--temperature must be 0 (greedy) or between"),
    ("temperature nan", "generate --prompt hi --temperature nan", 2, "--temperature must"),
    ("top-p zero", "generate --prompt hi --top-p 0", 2, "--top-p must be in (0, 1]"),
    ("top-p above one", "generate --prompt hi --top-p 1.5", 2, "--top-p must be in (0, 1]"),
    ("negative top-k", "generate --prompt hi --top-k -1", 2, "--top-k must be an integer"),
    ("negative seed", "generate --prompt hi --seed -3", 2, "--seed must be an integer >= 0"),
    ("min-p one", "generate --prompt hi --min-p 1", 2, "--min-p must be in [0, 1)"),
    ("repeat penalty zero", "generate --prompt hi --repeat-penalty 0", 2,
     "--repeat-penalty must be in (0,"),
    ("frequency penalty", "generate --prompt hi --frequency-penalty 5", 2,
     "--frequency-penalty must be between -2"),
    ("penalty window", "generate --prompt hi --penalty-last-n -1", 2,
     "--penalty-last-n must be an integer"),
    ("no new tokens", "generate --prompt hi --max-tokens 0", 2, "--max-tokens must be"),
    ("budget negative", "generate --prompt hi --budget -1", 2, "--budget must be between 0"),
    ("budget too large", "generate --prompt hi --budget 999", 2, "--budget must be between 0"),
    ("depth zero", "generate --prompt hi --depth 0", 2, "--depth must be between 1"),
    ("unknown device", "generate --prompt hi --head-device gpu0", 2,
     "--head-device must be cpu, cuda"),
    ("unknown layout", "generate --prompt hi --layout fastest", 2, "argument --layout"),
    ("unknown drafter", "generate --prompt hi --drafter magic", 2, "argument --drafter"),
    ("prompt past the context", "generate --ctx 128 --drafter none --prompt=" + "word," * 200,
     2, "the prompt needs"),
    ("empty raw prompt", "generate --raw --prompt= --drafter none", 2, "the prompt is empty"),
    ("head not safetensors", "generate --prompt hi --max-tokens 4 --drafter head "
     "--draft-head {head_not_safetensors}", 0, "{head_not_safetensors}/head.safetensors"),
    ("head of wrong shapes", "generate --prompt hi --max-tokens 4 --drafter head "
     "--draft-head {head_wrong_shapes}", 0, "{head_wrong_shapes}/head.safetensors"),
    ("head config not json", "generate --prompt hi --max-tokens 4 --drafter head "
     "--draft-head {head_bad_json}", 0, "{head_bad_json}/head.json"),
    ("auto with a broken head", "generate --prompt hi --max-tokens 4 --drafter auto "
     "--draft-head {head_not_safetensors}", 0, "{head_not_safetensors}/head.safetensors"),
    ("auto with a misshapen head", "generate --prompt hi --max-tokens 4 --drafter auto "
     "--draft-head {head_wrong_shapes}", 0, "{head_wrong_shapes}/head.safetensors"),
    ("auto with no head there", "generate --prompt hi --max-tokens 4 --drafter auto "
     "--draft-head {no_head}", 0, "no draft head in {no_head}"),
    ("bench prompts missing", "bench --prompts {missing}", 2, "No such file"),
    ("bench prompts not jsonl", "bench --prompts {prompts} --drafters none", 2,
     "not a benchmark prompt"),
    ("bench unknown drafter", "bench --prompts {prompts} --drafters magic", 2,
     "unknown drafter(s) magic"),
    ("serve on a bad port", "serve --port 70000", 2, "--port must be between 0 and 65535"),
    ("serve open without a key", "serve --host 0.0.0.0", 2, "--api-key"),
    ("import a vocabulary-only GGUF", "models import {vocab_only}", 2,
     "holds no weights"),
]


@pytest.mark.parametrize("case", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_the_cli_answers_bad_input_with_one_line_and_goes_on(case, files, capsys):
    _, argv, code, message = case
    args = [a.format(**files) for a in argv.split(" ") if a]
    if args[0] == "generate" and "--threads" not in args:
        args += ["--threads", "2"]
    rc, _, err = _run(args, capsys)
    assert "Traceback" not in err
    assert rc == code, err
    said = [line for line in err.splitlines() if message.format(**files) in line]
    assert said, err
    if code:  # the refusal is one line that starts the way every CLI error does
        errors = [line for line in err.splitlines() if ": error: " in line]
        assert len(errors) == 1 and message.format(**files) in errors[0], err
    # The next valid request in the same process answers as it always does.
    rc, out, err = _run(VALID, capsys)
    assert rc == 0, err
    assert '"tokens": [' in out


# --- the engine's API: what the GUI and the server call ---------------------------------
@pytest.fixture(scope="module")
def engine(model_path, tmp_path_factory):
    config = EngineConfig(model_path=model_path, drafter="memory", n_ctx=256, n_threads=2,
                          cache_dir=tmp_path_factory.mktemp("cache"),
                          memory_dir=tmp_path_factory.mktemp("memory"))
    with Engine(config) as e:
        yield e


@pytest.fixture(scope="module")
def valid(engine) -> tuple[list[int], list[int]]:
    prompt = engine.chat_prompt([{"role": "user", "content": "Name a fruit."}])
    return prompt, engine.generate(prompt, GenerationConfig(8)).tokens


def _sampling(**bad: object) -> GenerationConfig:
    return GenerationConfig(8, sampling=SamplingParams(**bad))


# (case id, the call on the engine, the error class, the setting named or a message part)
API_CASES = [
    ("prompt past the context", lambda e: e.generate([1] * 400), ContextFullError,
     "needs 401 tokens"),
    ("empty prompt", lambda e: e.generate([]), InvalidPromptError, "empty"),
    ("negative token id", lambda e: e.generate([1, -1]), InvalidPromptError, "token id -1"),
    ("token id past the vocabulary", lambda e: e.generate([1, e.target.n_vocab]),
     InvalidPromptError, "outside this model's vocabulary"),
    ("no messages", lambda e: e.chat_prompt([]), InvalidPromptError, "non-empty list"),
    ("unknown role", lambda e: e.chat_prompt([{"role": "robot", "content": "hi"}]),
     InvalidPromptError, "role 'robot'"),
    ("content not text", lambda e: e.chat_prompt([{"role": "user", "content": 5}]),
     InvalidPromptError, "text content"),
    ("message not a dict", lambda e: e.chat_prompt(["hi"]), InvalidPromptError, "dict"),
    ("no new tokens", lambda e: GenerationConfig(0), InvalidSamplingError, "max_tokens"),
    ("negative budget", lambda e: GenerationConfig(8, max_draft=-1), InvalidSamplingError,
     "max_draft"),
    ("tiny temperature", lambda e: _sampling(temperature=1e-300), InvalidSamplingError,
     "temperature"),
    ("temperature nan", lambda e: _sampling(temperature=math.nan), InvalidSamplingError,
     "temperature"),
    ("temperature huge", lambda e: _sampling(temperature=1e9), InvalidSamplingError,
     "temperature"),
    ("top-p zero", lambda e: _sampling(top_p=0.0), InvalidSamplingError, "top_p"),
    ("top-k not an integer", lambda e: _sampling(top_k=2.5), InvalidSamplingError, "top_k"),
    ("seed negative", lambda e: _sampling(seed=-1), InvalidSamplingError, "seed"),
    ("min-p one", lambda e: _sampling(min_p=1.0), InvalidSamplingError, "min_p"),
    ("repeat penalty infinite", lambda e: _sampling(repeat_penalty=math.inf),
     InvalidSamplingError, "repeat_penalty"),
    ("presence penalty", lambda e: _sampling(presence_penalty=-9.0), InvalidSamplingError,
     "presence_penalty"),
    ("penalty window", lambda e: _sampling(penalty_last_n=10**9), InvalidSamplingError,
     "penalty_last_n"),
    ("context too small", lambda e: EngineConfig(n_ctx=8), InvalidSettingError, "n_ctx"),
    ("no threads", lambda e: EngineConfig(n_threads=0), InvalidSettingError, "n_threads"),
    ("unknown drafter", lambda e: EngineConfig(drafter="magic"), InvalidSettingError,
     "drafter"),
    ("unknown KV cache", lambda e: EngineConfig(kv_cache="quick"), InvalidSettingError,
     "kv_cache"),
    ("unknown device", lambda e: EngineConfig(head_device="gpu0"), InvalidSettingError,
     "head_device"),
    ("depth zero", lambda e: EngineConfig(overrides=Overrides(depth=0)), InvalidSettingError,
     "depth"),
    ("budget too large", lambda e: Overrides(max_draft=999), InvalidSettingError,
     "max_draft"),
    ("unknown layout", lambda e: Overrides(layout="fastest"), InvalidSettingError, "layout"),
    ("context past training", lambda e: Engine(EngineConfig(
        model_path=e.model.path, n_ctx=10**6, drafter="none")), InvalidSettingError, "n_ctx"),
    ("model missing", lambda e: Engine(EngineConfig(model_path=Path("/no/model.gguf"))),
     ModelLoadError, "not found"),
]


@pytest.mark.parametrize("case", API_CASES, ids=[c[0] for c in API_CASES])
def test_the_engine_refuses_bad_input_clearly_and_stays_usable(case, engine, valid):
    _, call, error, named = case
    with pytest.raises(error) as caught:
        call(engine)
    exc = caught.value
    assert isinstance(exc, TandemError)  # what every front end catches
    message = str(exc)
    assert "\n" not in message and named in message
    if isinstance(exc, InvalidSettingError):
        assert exc.setting == named  # each front end names it its own way from this
    prompt, answer = valid
    assert engine.generate(prompt, GenerationConfig(8)).tokens == answer
