"""``tandem serve``: the OpenAI-compatible API for other programs."""

from __future__ import annotations

import argparse

from app.cli.common import add_head_args, add_model_args, add_plan_args, open_service
from engine.drafters.kinds import CHOICES, DrafterKind


def cmd_serve(args: argparse.Namespace) -> int:
    import threading

    from app.server.serve import ApiServer, check_binding

    check_binding(args.host, args.port, args.api_key)  # before the model loads
    if args.queue < 1 or args.max_tokens < 1 or args.parallel < 1:
        raise ValueError("--queue, --max-tokens and --parallel must be at least 1")
    with open_service(args) as service:
        engine = service.current()
        assert engine is not None
        server = ApiServer(lambda: service, threading.Lock(), args.host, args.port,
                           args.api_key, args.queue, min(args.max_tokens, engine.target.n_ctx),
                           parallel=args.parallel)
        together = f"; {server.parallel} requests at once" if server.parallel > 1 else ""
        print(f"Tandem serving {engine.describe()} at {server.url} "
              f"(OpenAI API{together}; Ctrl-C stops)", flush=True)
        if server.parallel_note:
            print(f"tandem serve: --parallel {args.parallel}: {server.parallel_note}",
                  flush=True)
        server.run()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``serve`` to the ``tandem`` command's sub-parsers."""
    p = subparsers.add_parser("serve", help="an OpenAI-compatible API for other programs")
    add_model_args(p)
    p.add_argument("--drafter", choices=CHOICES, default=DrafterKind.AUTO.value,
                   help="auto: the planner picks layout, drafter and budget (tandem plan)")
    add_head_args(p)
    add_plan_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (anything but loopback needs --api-key)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every request")
    p.add_argument("--queue", type=int, default=8,
                   help="requests that may wait for the model; more get 429")
    p.add_argument("--parallel", type=int, default=1,
                   help="requests answered at once, decoded together in one batch (plain "
                        "decoding: no drafts); each answer stays exactly its answer alone")
    p.add_argument("--max-tokens", type=int, default=4096,
                   help="the most new tokens one request may ask for")
    p.set_defaults(func=cmd_serve)
