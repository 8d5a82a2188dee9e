"""``tandem worker``: serve this machine's devices to other Tandem instances."""

from __future__ import annotations

import argparse
import sys

from engine.workers.endpoints import DEFAULT_PORT


def cmd_worker(args: argparse.Namespace) -> int:
    from engine.workers.serve import Worker

    worker = Worker(args.host, args.port, args.device, args.threads, args.allow_network,
                    args.cache, say=lambda line: print(line, file=sys.stderr, flush=True))
    names = ", ".join(f"{d.name} ({d.description})" for d in worker.devices)
    print(f"Tandem worker at {worker.endpoint}: {names}, {worker.n_threads} threads. Use it "
          f"with --workers {worker.endpoint} (Ctrl-C stops)", flush=True)
    worker.start()
    while worker.wait(0.5):  # short waits, so Ctrl-C is seen
        pass
    print(f"tandem: the worker stopped: cannot listen at {worker.endpoint} (port in use?)",
          file=sys.stderr)
    return 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``worker`` to the ``tandem`` command's sub-parsers."""
    p = subparsers.add_parser(
        "worker", help="serve this machine's CPU or GPU to other Tandem instances (RPC)",
        description="Serve this machine's devices to Tandem on other machines (llama.cpp's "
        "RPC backend): they put a target's layers and KV cache here with --workers "
        "HOST:PORT. The protocol has no authentication: the worker listens on loopback "
        "unless --allow-network; reach it through an SSH tunnel.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (beyond loopback needs --allow-network)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    p.add_argument("--device", default="cpu",
                   help="what to serve: cpu, cuda:0, vulkan:0, ... (comma-separated)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the work (default: physical cores)")
    p.add_argument("--allow-network", action="store_true",
                   help="listen beyond this machine, with no authentication (see --help)")
    p.add_argument("--cache", type=str, default=None, metavar="DIR",
                   help="keep received weights in DIR, so a model loads faster next time")
    p.set_defaults(func=cmd_worker)
