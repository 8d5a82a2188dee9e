"""The packaged build ships no torch (docs/packaging.md): Tandem must plan and answer
without it, and say why its torch head is not offered. Run in a child process where
``import torch`` fails, as it does in the bundle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys
from pathlib import Path
sys.modules["torch"] = None  # import torch now raises ImportError, as in the bundle
from engine.drafters.head_fit import NO_TORCH, torch_available
from engine.planning.drafter_options import drafter_options
from engine.runtime.model_info import read_model_info
from engine.decoding.generation import GenerationConfig
from engine.session import Engine, EngineConfig

model = sys.argv[1]
options = {o.drafter: o for o in drafter_options(read_model_info(model))}
engine = Engine(EngineConfig(model_path=Path(model), n_threads=2))
try:
    prompt = engine.chat_prompt([{"role": "user", "content": "Name a colour."}])
    result = engine.generate(prompt, GenerationConfig(max_tokens=8)).text
finally:
    engine.close()
print(json.dumps({"torch": torch_available(), "no_torch": NO_TORCH,
                  "head": [options["head"].available, options["head"].detail],
                  "eagle3": options["eagle3"].available, "text": result,
                  "torch_loaded": sys.modules.get("torch") is not None}))
"""


def test_plans_and_answers_without_torch(model_path: Path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(model_path)], capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["torch"] is False and seen["torch_loaded"] is False
    assert seen["head"] == [False, seen["no_torch"]]
    assert seen["eagle3"] is True  # heads through llama.cpp stay offered
    assert seen["text"].strip()
