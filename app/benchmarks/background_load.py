"""Another llama.cpp process decoding on the same cores: the load a laptop meets when a
second model, a build or an indexer runs beside Tandem. The healing benchmark
(``tandem bench --heal``) calibrates under it.

    python -m app.benchmarks.background_load MODEL.gguf --threads 2   # decodes until killed
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


class BackgroundDecode:
    """``with BackgroundDecode(model, threads): ...`` runs the decoder in a child process
    and waits until it decodes, so what follows is measured under load."""

    def __init__(self, model: Path, n_threads: int) -> None:
        self.model, self.n_threads = Path(model), n_threads
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> BackgroundDecode:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "app.benchmarks.background_load", str(self.model),
             "--threads", str(self.n_threads)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # "decoding" once the model is loaded
        if "decoding" not in line:
            self.__exit__()
            raise RuntimeError("the background decoder did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


def _decode_forever(model: Path, n_threads: int) -> None:
    from engine.runtime.draft_tree import DraftTree
    from engine.runtime.target import Target, TargetConfig

    with Target(model, TargetConfig(n_ctx=512, n_threads=n_threads)) as target:
        prompt = target.tokenize("Tell me a long story about a lighthouse keeper.")
        print("decoding", flush=True)
        while True:  # one-token decodes, restarted before the context fills
            target.reset()
            pre = target.prefill(prompt, None)
            token = int(pre.logits.argmax())
            for _ in range(400):
                ver = target.verify(token, DraftTree())
                target.commit(ver, [0], [token])
                token = int(ver.logits[0].argmax())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    _decode_forever(args.model, args.threads)


if __name__ == "__main__":
    main()
