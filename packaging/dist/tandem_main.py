"""The packaged build's one executable: the chat window with no arguments, the CLI
(``tandem chat``, ``generate``, ``serve``...) with any.

The app starts helpers as ``sys.executable -m MODULE ...`` (the engine's own process,
a worker); in the bundle ``sys.executable`` is this program, so ``-m`` runs the module
as Python would."""

from __future__ import annotations

import runpy
import sys


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "-m":
        module = sys.argv[2]
        sys.argv = [sys.argv[0], *sys.argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    if len(sys.argv) > 1:
        from app.cli import main as cli

        return cli()
    from app.gui.app import main as gui

    return gui()


if __name__ == "__main__":
    sys.exit(main())
