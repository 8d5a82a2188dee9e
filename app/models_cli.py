"""``tandem models``: search the Hub, download, list, remove and import models.

The same engine functions as the model wizard (engine/hub); this module only parses
arguments and prints tables and a progress bar."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.errors import TandemError
from engine.hub.catalog import HeadChoice, load_catalog, matching_heads
from engine.hub.download import DownloadControl, Downloader, DownloadProgress
from engine.hub.fit import estimate_fit, human_bytes, machine_memory
from engine.hub.install import find_choice, install
from engine.hub.local_models import ModelRegistry, default_registry_path, import_gguf
from engine.hub.search import list_repo, read_remote_facts, search_gguf


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, two spaces apart, with a rule under the header."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _registry() -> ModelRegistry:
    return ModelRegistry()


def _heads(repo_id: str, facts, args: argparse.Namespace) -> list[HeadChoice]:  # noqa: ANN001
    catalog = load_catalog(default_registry_path().parent.parent)  # <home>/models/models.json
    return matching_heads(repo_id, facts, catalog=catalog, endpoint=args.endpoint)


def cmd_search(args: argparse.Namespace) -> int:
    if args.repo is None:
        hits = search_gguf(args.query or "", limit=args.limit, endpoint=args.endpoint)
        if not hits:
            print(f"no GGUF repositories match {args.query!r}")
            return 0
        print(format_table(("repository", "downloads", "likes"),
                           [(h.repo_id, h.n_downloads, h.n_likes) for h in hits]))
        print("\nshow a repository's files: tandem models search --repo OWNER/NAME")
        return 0
    choices = list_repo(args.repo, endpoint=args.endpoint).gguf_choices()
    if not choices:
        print(f"{args.repo} has no GGUF files")
        return 0
    memory = machine_memory()
    facts = read_remote_facts(choices[0], endpoint=args.endpoint)  # one shape per repo
    heads = _heads(args.repo, facts, args)
    n_head = heads[0].n_bytes if heads else 0
    rows = []
    for c in choices:
        fit = estimate_fit(c.n_bytes, n_head, args.ctx, facts, memory)
        rows.append((c.quant, human_bytes(c.n_bytes), fit.label,
                     human_bytes(fit.n_total_bytes), c.name))
    print(format_table(("quant", "size", f"fit (ctx {args.ctx})", "needs", "file"), rows))
    if heads:
        print("\ndraft heads:")
        print(format_table(("repository", "size", "found by"),
                           [(h.repo_id, human_bytes(h.n_bytes), h.source) for h in heads]))
    else:
        print("\nno draft head matches; the model runs with drafts from memory")
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    try:
        choice = find_choice(args.repo, args.file, revision=args.revision,
                             endpoint=args.endpoint)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    head = None
    if args.head != "none":
        facts = read_remote_facts(choice, endpoint=args.endpoint)
        heads = _heads(args.repo, facts, args)
        if args.head == "auto":
            head = heads[0] if heads else None
        else:
            head = next((h for h in heads if h.repo_id == args.head), None)
            if head is None:
                raise ValueError(f"{args.head} is not a draft head that fits {args.repo}")
    downloader = Downloader(args.cache_dir, args.endpoint)
    what = choice.name + (f" + head {head.repo_id}" if head else "")
    bar = tqdm(total=choice.n_bytes + (head.n_bytes if head else 0), unit="B",
               unit_scale=True, unit_divisor=1024, desc=what, file=sys.stderr)

    def progress(p: DownloadProgress) -> None:
        bar.n = p.n_done
        bar.set_postfix_str(p.phase if p.phase != "download" else "")
        bar.refresh()

    control = DownloadControl()
    try:
        model, result = install(choice, head, downloader, _registry(),
                                revision=args.revision or "main", control=control,
                                on_progress=progress)
    except KeyboardInterrupt:
        bar.close()
        print("interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    bar.close()
    print(f"{model.name} ready: {model.path}")
    if model.head_dir:
        print(f"draft head: {model.head_dir}")
    if result.n_resumed:
        print(f"(resumed from {human_bytes(result.n_resumed)} already on disk)")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    models = _registry().list()
    if not models:
        print("no local models yet: tandem models search QUERY, then download")
        return 0
    rows = [(m.name, m.quant, human_bytes(m.n_bytes), m.source,
             m.head_repo or "-", "" if m.available else "missing", m.path) for m in models]
    print(format_table(("name", "quant", "size", "source", "draft head", "", "path"), rows))
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    try:
        model = _registry().remove(args.name, delete_files=args.delete_files,
                                   cache_dir=args.cache_dir)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    kept = "" if args.delete_files or model.source != "hub" else " (files kept in the cache)"
    print(f"removed {model.name}{kept}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    model = import_gguf(args.path, _registry(), name=args.name)
    print(f"imported {model.name} ({model.quant}, {human_bytes(model.n_bytes)}): {model.path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``models`` and its sub-commands to the ``tandem`` command's sub-parsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--endpoint", default=None,
                        help="Hub URL (default: HF_ENDPOINT or huggingface.co)")
    common.add_argument("--cache-dir", type=Path, default=None,
                        help="huggingface_hub cache (default: HF_HUB_CACHE)")
    p = subparsers.add_parser("models", help="search, download and manage models")
    sub = p.add_subparsers(dest="models_command", required=True)

    s = sub.add_parser("search", parents=[common],
                       help="find GGUF repositories, or list one's files")
    s.add_argument("query", nargs="?", default="")
    s.add_argument("--repo", default=None, help="list this repository's files with fit")
    s.add_argument("--limit", type=int, default=20)
    s.add_argument("--ctx", type=int, default=4096, help="context length for the fit")
    s.set_defaults(func=cmd_search)

    s = sub.add_parser("download", parents=[common], help="download a model (and its draft head)")
    s.add_argument("repo", help="OWNER/NAME")
    s.add_argument("file", help="quantization (Q4_K_M) or file name")
    s.add_argument("--head", default="auto",
                   help="draft head repository, 'auto' (first match) or 'none'")
    s.add_argument("--revision", default=None)
    s.set_defaults(func=cmd_download)

    s = sub.add_parser("list", parents=[common], help="local models")
    s.set_defaults(func=cmd_list)

    s = sub.add_parser("remove", parents=[common], help="forget a local model")
    s.add_argument("name")
    s.add_argument("--delete-files", action="store_true",
                   help="also delete a downloaded model's files from the cache")
    s.set_defaults(func=cmd_remove)

    s = sub.add_parser("import", parents=[common], help="register a GGUF file on this machine")
    s.add_argument("path", type=Path)
    s.add_argument("--name", default=None)
    s.set_defaults(func=cmd_import)


def main(argv: list[str] | None = None) -> int:
    """``python -m app.models_cli ...``: the ``models`` command on its own."""
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["models", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except (TandemError, ValueError, OSError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
