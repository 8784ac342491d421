"""``transformd convert | sample | inspect | demo``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..formats import ScaleMode
from .common import (EXIT_BAD_INPUT, EXIT_OK, add_target_arguments, missing_here, non_negative_float, positive_int,
                     shown, user_path, visible)

__all__ = ["add_commands"]


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``convert``, ``sample`` and ``inspect``."""
    convert = subparsers.add_parser(
        "convert",
        help="convert an MXFP8 checkpoint directory to block FP8",
        description="Convert the MXFP8 checkpoint SRC into a 128x128 block-FP8 checkpoint in DIR; print DIR last.",
    )
    convert.add_argument("src", metavar="SRC",
                         help="MXFP8 checkpoint directory (config.json + safetensors), or a Hugging Face repo id "
                              "org/Model in the local hub cache (HF_HUB_CACHE, HF_HOME; a path that exists is a path)")
    convert.add_argument("--revision", metavar="REV",
                         help="with a repo id: branch, tag or full commit hash in the hub cache (default main)")
    convert.add_argument("--out", metavar="DIR", type=user_path,
                         help="output directory (must be empty or absent); without it the conversion goes into "
                              "the cache and a second call for the same checkpoint returns at once")
    convert.add_argument("--cache-dir", metavar="DIR", type=user_path,
                         help="cache root (default: $TRANSFORMD_CACHE_DIR, else $XDG_CACHE_HOME/transformd, "
                              "else ~/.cache/transformd)")
    add_target_arguments(convert)
    convert.add_argument("--scale-mode", choices=[m.value for m in ScaleMode], default=ScaleMode.EXACT.value,
                         help="exact: power-of-two tile scales, lossless for normal values (default); "
                              "amax: amax/448, parity with vLLM's in-engine conversion")
    convert.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                         help="where to convert (auto: the GPU when there is one)")
    convert.add_argument("--select", metavar="REGEX",
                         help="a check that the checkpoint's MXFP8 weights are the ones expected: each name must "
                              "match REGEX (RE2, searched anywhere in it), else nothing is converted (a block-FP8 "
                              "checkpoint cannot carry MXFP8 tensors, so none may stay)")
    convert.add_argument("--overwrite", action="store_true",
                         help="replace an earlier conversion's output in DIR (a DIR of other files is refused)")
    convert.add_argument("--report", action="store_true",
                         help="print the reconstruction error per tensor and overall before DIR")
    convert.add_argument("--no-head-start", action="store_true",
                         help="convert only in this process's pipeline (by default, when this process converts and "
                              "the source is in the page cache, a worker process converts its last shards on the CPU "
                              "while torch is imported; the same bytes)")
    convert.add_argument("--no-daemon", action="store_true",
                         help="into the cache, convert in this process even when a transformd daemon serves the "
                              "same cache directory (by default that daemon converts, without this process's "
                              "start-up, and this command shows its progress; found as for 'transformd resolve': "
                              "$TRANSFORMD_SOCKET, $XDG_RUNTIME_DIR/transformd.sock, /run/transformd/transformd.sock)")
    convert.add_argument("--remote", metavar="URL",
                         help="into the cache: a remote tier many nodes share, s3://BUCKET[/PREFIX] (credentials and "
                              "endpoint from the AWS variables and profiles) or file:///PATH; the entry is downloaded "
                              "from it before converting, and a conversion is uploaded to it once DIR is printed "
                              "(default: $TRANSFORMD_REMOTE). A repo id at a full commit with no snapshot here is "
                              "found by the alias the converting node recorded")
    convert.add_argument("--remote-read-only", action="store_true",
                         help="only download from the remote tier, never upload to it")
    convert.add_argument("--progress-every", metavar="S", type=non_negative_float, default=5.0,
                         help="seconds between progress lines when standard error is not a terminal (default 5)")
    convert.set_defaults(handler=_run_convert)

    sample = subparsers.add_parser(
        "sample",
        help="write a small MXFP8 MoE sample checkpoint",
        description="Write a small ModelOpt-layout MXFP8 MoE checkpoint into DIR; print DIR last.",
    )
    sample.add_argument("dir", metavar="DIR", type=user_path,
                        help="where to write it (created; must be empty or absent)")
    sample.add_argument("--layers", type=positive_int, default=2, help="decoder layers (default 2)")
    sample.add_argument("--experts", type=positive_int, default=4, help="MoE experts per layer (default 4)")
    sample.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    sample.add_argument("--shards", type=positive_int, default=2,
                        help="safetensors files to spread it over (default 2)")
    sample.add_argument("--scale-suffix", choices=["weight_scale", "weight_scale_inv"], default="weight_scale",
                        help="ModelOpt (weight_scale) or MiniMax-style (weight_scale_inv) scale names")
    sample.add_argument("--fused-experts", action="store_true", help="3-D [E, N, K] expert tensors")
    sample.set_defaults(handler=_run_sample)

    inspect = subparsers.add_parser(
        "inspect",
        help="engine readiness of a block-FP8 checkpoint, or the reconstruction error of a conversion",
        description="With one directory: which engines (vLLM, SGLang, transformers) load this block-FP8 checkpoint, at "
                    "which tensor-parallel sizes, and why not at others (exit 2 when none loads it). With two: "
                    "compare the MXFP8 checkpoint SRC with its conversion OUT; print the error table, then OUT.",
    )
    inspect.add_argument("src", metavar="SRC", type=user_path,
                         help="a block-FP8 checkpoint (alone), or the MXFP8 checkpoint directory that was converted")
    inspect.add_argument("out", metavar="OUT", type=user_path, nargs="?",
                         help="its conversion (a 'convert --out' directory or a cache entry's checkpoint/)")
    inspect.set_defaults(handler=_run_inspect)

    demo = subparsers.add_parser(
        "demo",
        help="the main job on the built-in sample, through a daemon: serve, resolve, map, report, hit the cache",
        description="Start a transformd daemon (on a private unix socket and cache in DIR, stopped at the end), "
                    "write the sample MXFP8 checkpoint, resolve it through the HTTP API (which converts it), map "
                    "the converted tensors, report the reconstruction error of both scale modes, then resolve it "
                    "again from the cache; print the converted directory last. Everything stays in DIR "
                    "(sample, cache, daemon.log); it is printed first.",
    )
    demo.add_argument("--dir", metavar="DIR", type=user_path,
                      help="working directory for the sample, the daemon's socket and log, and its cache (default: "
                           "a new directory under $TMPDIR or /tmp, kept and printed so you can look at it; remove "
                           "it when done)")
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                      help="where the daemon converts (auto: the GPU when there is one)")
    demo.set_defaults(handler=_run_demo)


def _choose_target(args: argparse.Namespace) -> tuple[str | None, str]:
    """The concrete target for ``args`` (None: serve the source unconverted) and why."""
    from ..engines import choose_target
    from ..platform import detect_platform

    return choose_target(args.target, args.engine, detect_platform() if args.target == "auto" else None)


def _print_outcome(report: dict, engine: str | None, target: str, why: str) -> None:
    """After a conversion, on standard error: with ``--engine``, the target chosen and whether that engine loads
    it, with every reason it does not at some TP sizes; without, a warning for each engine that could not load it at
    any tensor-parallel size, with every reason."""
    if engine is not None:
        print(shown(f"transformd: target {target}: {why}"), file=sys.stderr)
    from ..engines import readiness_lines

    for name, r in report.items():
        if engine == name:  # every verdict, with every reason
            first, *rest = readiness_lines(r)
            for line in [f"transformd: {name}: {first}", *rest]:
                print(("  " if line.startswith(" ") else "") + shown(line), file=sys.stderr)  # (shown: one line)
        elif engine is None and not r.loads:
            more = f" (and {len(r.problems) - 1} more: transformd inspect DIR)" if len(r.problems) > 1 else ""
            print(shown(f"transformd: warning: {name} could not load this checkpoint at any TP size: "
                        f"{r.problems[0]}{more}"), file=sys.stderr)
        if engine in (None, name):
            for warning in r.warnings:
                print(shown(f"transformd: warning: {warning}"), file=sys.stderr)


@contextlib.contextmanager
def _while_starting(src: str | Path, device: str, progress: Callable[[Any], None], read_ahead: bool = True
                    ) -> Iterator[Callable[[Any], None]]:
    """While torch is imported: read ``src``'s first shards into the page cache (:mod:`transformd.readahead`; not
    with ``read_ahead`` false: the hashing of a source new to the cache does that itself) and start CUDA on the GPUs
    the conversion will use (:mod:`transformd.cuda_start`). ``progress`` is given back wrapped so that the
    conversion's first update stops the reading."""
    from ..cuda_start import start_cuda
    from ..readahead import ReadAhead, shard_files

    shards = shard_files(src)
    ahead = ReadAhead(shards) if read_ahead else None
    cuda = start_cuda(device, len(shards))

    def update(status: Any) -> None:
        if ahead is not None:
            ahead.stop()
        progress(status)

    try:
        yield update
    finally:
        if ahead is not None:
            ahead.stop()
        if cuda is not None:  # (done by now unless the conversion failed early: not left in the driver at exit)
            cuda.join(10)


def _shard_bytes(src: str | Path) -> int | None:
    """The bytes of ``src``'s shards (their sizes: nothing is read), the bar's total until the conversion's own."""
    from ..readahead import shard_files

    sizes = []
    for shard in shard_files(src):
        try:
            sizes.append(shard.stat().st_size)
        except OSError:
            pass
    return sum(sizes) or None


# -------------------------------------------------------------------------------------------------------------------
# Handlers


def _run_convert(args: argparse.Namespace) -> int:
    from ..engines import engine_from_env
    from ..hub import RepoNotCachedError, RevisionNotCachedError, locate

    args.engine = args.engine or engine_from_env()  # (the engine's container may name it once: TRANSFORMD_ENGINE)
    tier = _tier(args)
    try:
        args.src, hub = locate(args.src, args.revision, note=sys.stderr)  # a repo id: its snapshot in the hub cache
    except RepoNotCachedError as err:  # (a relative name is a repo id unless it exists here: say so first)
        if tier is not None and (found := _by_alias(args, tier)) is not None:
            return found
        path = None if isinstance(err, RevisionNotCachedError) else missing_here(args.src)
        if path is None:
            raise
        raise type(err)(f"no such directory: {path}; as a repo id, {err.message}") from None
    target, why = _choose_target(args)
    if target is None:  # native MX: the source is what the engine should load
        print(f"transformd: nothing converted: {why}", file=sys.stderr)
        print(args.src)
        return EXIT_OK
    if args.out is None:
        return _run_convert_cached(args, target, why, tier, None if hub is None else (hub.repo_id, hub.commit))
    cache_only = [flag for flag, given in (("--cache-dir", args.cache_dir is not None), ("--no-daemon", args.no_daemon),
                                           ("--remote", tier is not None)) if given]
    if cache_only:
        raise ValueError(f"{' and '.join(cache_only)}: for a conversion into the cache, not with --out")
    from ..progress import ConvertProgress, summary

    bar = ConvertProgress(sys.stderr, every_s=args.progress_every)
    bar.phase("converting", _shard_bytes(args.src))  # (drawn now: torch's import and a head start come first)
    with bar, _while_starting(args.src, args.device, bar.update) as update:
        from ..checkpoint import convert_checkpoint  # (it imports torch while the source is read ahead)

        result = convert_checkpoint(
            args.src,
            args.out,
            target=target,
            scale_mode=args.scale_mode,
            select=args.select,
            device=args.device,
            overwrite=args.overwrite,
            progress=update,
            engine=args.engine,
            head_start=False if args.no_head_start else None,
            require_engine=True,  # (no engine named: refused if one would load it wrong without an error)
        )
    _print_outcome(result.readiness, args.engine, target, why)
    if result.left_out:
        print(shown(f"transformd: note: not referenced by the index, not carried over: {', '.join(result.left_out)}"),
              file=sys.stderr)
    print(summary(result, f"into {result.out}"), file=sys.stderr, flush=True)
    if args.report:
        from ..report import compare_checkpoints

        print(visible(compare_checkpoints(args.src, result.out).format_table(legend=True)))
    print(result.out)
    return EXIT_OK


def _tier(args: argparse.Namespace) -> Any:
    """The remote tier of ``--remote`` / ``$TRANSFORMD_REMOTE``, or None."""
    url = args.remote or os.environ.get("TRANSFORMD_REMOTE") or None
    if url is None:
        if args.remote_read_only:
            raise ValueError("--remote-read-only: for a --remote (or $TRANSFORMD_REMOTE)")
        return None
    from ..request import Tier

    return Tier.from_url(url, read_only=args.remote_read_only)


def _by_alias(args: argparse.Namespace, tier: Any) -> int | None:
    """``convert org/Model --revision COMMIT`` with no snapshot of it here: the entry the tier's alias record names
    (converted by another node), into the cache; None when the tier has none (the hub's error is then said)."""
    from ..cache import Cache, Recipe
    from ..hub import is_full_commit, is_repo_id

    if args.out is not None or not is_repo_id(args.src, paths_exist=False) or not is_full_commit(args.revision):
        return None
    target, why = _choose_target(args)  # (the platform's and the engine's: no source needed)
    if target is None:
        return None
    from ..checkpoint.layout import Layout, layout_for
    from ..request import check_engine

    cache = Cache(args.cache_dir)
    entry = None
    for layout in dict.fromkeys((layout_for(args.engine), Layout.AS_IS)):  # (as-is: a source with no stack to split)
        recipe = Recipe(target=target, scale_mode=args.scale_mode, select=args.select, layout=layout)
        entry = tier.fetch_alias(cache, args.src, args.revision, recipe)
        if entry is not None:
            break
    if entry is None:
        return None
    report = _readiness_of(entry)
    if args.engine != "raw":  # (what its conversion recorded: an engine that would load it wrong is refused)
        check_engine(report, args.engine, entry.path)
    _print_outcome(report, args.engine, target, why)
    print(_cached_summary(entry), file=sys.stderr, flush=True)
    print(entry.path)
    return EXIT_OK


def _readiness_of(entry: Any) -> Any:
    """The readiness an entry's conversion recorded, else computed from its headers."""
    from ..checkpoint import readiness_of_dir
    from ..request import recorded_readiness

    return recorded_readiness(entry) or readiness_of_dir(entry.path)


def _run_convert_cached(args: argparse.Namespace, target: str, why: str, tier: Any = None,
                        alias: tuple[str, str] | None = None) -> int:
    """``convert`` into the cache: the steps of :mod:`transformd.request`, with the daemon that serves the same
    cache as the converter when there is one. ``alias``: the repo id and full commit the source was named by."""
    from .. import request
    from ..cache import Cache, CacheError, PendingIdentity, Recipe, TransformdConverter, cache_key
    from ..checkpoint.plan import source_layout
    from ..errors import CheckpointError
    from ..progress import ConvertProgress

    if args.overwrite:
        raise ValueError("--overwrite needs --out; cache entries are never overwritten (see 'transformd cache rm')")
    # a conversion of its own (no daemon) gets a head start as --out does (the daemon's never: its torch is imported)
    cache = Cache(args.cache_dir, converter=TransformdConverter(args.device, head_start=not args.no_head_start))
    recipe = Recipe(target=target, scale_mode=args.scale_mode, select=args.select,
                    layout=source_layout(args.src, args.engine))
    # The source's identity when the stat cache knows its files or they are few (a large source new to the cache
    # is not read here: its conversion hashes it as it reads it), and the entry of that key if there is one.
    ours = cache.written_here()  # (another user's cache, a daemon's, is read by key only: its daemon keys, converts)
    bar = ConvertProgress(sys.stderr, every_s=args.progress_every)
    if ours:  # (hashing a source printed nothing: the bar is drawn from the start, each phase its label)
        bar.phase("hashing", _shard_bytes(args.src))
        try:
            identity = request.identify(cache, args.src, defer=True)
            if request.key_first(tier, identity, alias, recipe):  # (the tier is asked by key: hashed first)
                identity = request.identify(cache, args.src)
        finally:
            bar.close(leave=False)  # (a daemon asked next shows its own; a conversion here draws the bar again)
    else:
        identity = None
    known = None if isinstance(identity, PendingIdentity) else identity
    slot = identity.slot(recipe) if isinstance(identity, PendingIdentity) else None  # (its conversion's name)
    entry = request.find(cache, known, recipe)  # a hit: the source was keyed and its entry found, neither done again
    planned = None
    # refuse before converting (headers only); the cache checks everything else. A hit is checked against what its
    # conversion recorded; no engine named: what one would load wrong (config.json and the tensor names)
    report = request.recorded_readiness(entry) if entry is not None and args.engine != "raw" else None
    if report is None and args.engine is None:
        refusal = request.unnamed_refusal(cache, args.src)
        if refusal is not None:
            raise CheckpointError(refusal, file=args.src)
    elif args.engine != "raw":
        if report is None:  # read once, from the files identified, and handed to the conversion below
            planned = request.plan(cache, args.src, recipe, identity=known, slot=slot)
            report = request.readiness(planned, recipe)
        request.check_engine(report, args.engine, args.src, planned, target)
    if entry is None and not args.no_daemon:
        from .delegate import convert_through_daemon

        entry = convert_through_daemon(cache, args.src, recipe, known=known, progress_every=args.progress_every,
                                       here=ours)
    if entry is None and not ours:
        asked = "--no-daemon was given" if args.no_daemon else "no daemon serving it answers here"
        owner = cache.staging_dir.stat().st_uid
        raise CacheError(f"cannot convert into {cache.root}: only its owner (uid {owner}, its daemon) writes that "
                         f"cache, and {asked}; give a --cache-dir of your own otherwise")
    if entry is None:
        bar.phase("converting", _shard_bytes(args.src))
        # a plan is of the files identified: the conversion must find them, with that content, as they were then
        expect = {} if planned is None else {"key": known and cache_key(known, recipe), "slot": slot}
        # a source new to the cache is hashed beside its conversion, which reads it ahead itself (cache.alongside)
        with bar, _while_starting(args.src, args.device, lambda status: bar.update(status.progress),
                                  read_ahead=known is not None) as update:
            entry = request.produce(cache, args.src, recipe, identity=known, planned=planned, progress=update,
                                    tier=tier, alias=alias, **expect)
    _print_outcome(_readiness_of(entry), args.engine, target, why)
    print(_cached_summary(entry), file=sys.stderr, flush=True)
    if args.report:
        from ..report import compare_checkpoints

        print(visible(compare_checkpoints(args.src, entry.path).format_table(legend=True)))
    print(entry.path, flush=True)
    if tier is not None and not tier.wait_uploads(0):  # the answer is out; this process ends with its upload
        print(f"transformd: uploading the entry to {tier.remote.url}", file=sys.stderr, flush=True)
        tier.wait_uploads()
    return EXIT_OK


def _cached_summary(entry) -> str:
    """The last line on standard error of ``convert`` into the cache: how this call got the entry, with numbers."""
    from ..progress import summary

    where = f"cache entry {entry.path}"
    try:
        manifest = entry.manifest
        result = manifest.result if isinstance(manifest.result, dict) else {}
        recipe = manifest.recipe
    except (OSError, ValueError, KeyError, TypeError):
        return f"transformd: {entry.outcome}: {where}"
    result = {"target": recipe.target, "scale_mode": recipe.scale_mode, **result}
    if entry.outcome == "fetched":
        return (f"transformd: downloaded from the remote tier (converted by another node, nothing converted now): "
                f"target {result['target']}, scale mode {result['scale_mode']}; {where}")
    if entry.outcome == "hit":
        return (f"transformd: found in the cache (converted earlier, nothing converted now): "
                f"target {result['target']}, scale mode {result['scale_mode']}; {where}")
    how = {"converted": "converted", "daemon": "the daemon converted"}.get(entry.outcome, "another process converted")
    return summary(result, where, how=how, timings=dict(manifest.timings or {}))


def _run_sample(args: argparse.Namespace) -> int:
    from ..sample import write_sample_checkpoint

    path = write_sample_checkpoint(
        args.dir,
        layers=args.layers,
        experts=args.experts,
        seed=args.seed,
        shards=args.shards,
        scale_suffix=args.scale_suffix,
        fused_experts=args.fused_experts,
    )
    print(path)
    return EXIT_OK


def _run_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    print(run_demo(args.dir, device=args.device))
    return EXIT_OK


def _check_block_fp8(src: Path) -> None:
    """Refuse a directory whose config.json does not say block FP8 (``quant_method: fp8``): what engines would make of
    it is not a block-FP8 checkpoint's readiness (a BF16 model "loads" unquantized; an MXFP8 one is the input)."""
    from ..checkpoint.plan import CONFIG_NAME, load_json  # (checked reads: no FIFO, size limit, depth)
    from ..errors import CheckpointError

    if not src.is_dir():
        raise CheckpointError("does not exist" if not src.exists() else "is not a directory", file=src)
    config = src / CONFIG_NAME
    qc = (load_json(config, required=True) or {}).get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "fp8":
        said = f"quant_method {method!r}" if method is not None else "no quantization_config"
        raise CheckpointError(f"says {said}, not a block-FP8 checkpoint's 'fp8': inspect DIR reports how engines load "
                              "converted output (an MXFP8 checkpoint: convert it first, or compare it with its "
                              "output: inspect SRC OUT)", file=config)


def _run_inspect(args: argparse.Namespace) -> int:
    if args.out is None:
        from ..checkpoint import readiness_of_dir
        from ..engines import readiness_lines

        _check_block_fp8(args.src)
        report = readiness_of_dir(args.src)
        for name, r in report.items():
            first, *below = readiness_lines(r)
            print(shown(f"{name}: {first}"))
            for line in [*below, *(f"  warning: {w}" for w in r.warnings)]:
                print(("  " if line.startswith(" ") else "") + shown(line))
        print(args.src)
        return EXIT_OK if any(r.loads for r in report.values()) else EXIT_BAD_INPUT
    from ..report import compare_checkpoints

    print(visible(compare_checkpoints(args.src, args.out).format_table(legend=True)))
    print(args.out)
    return EXIT_OK


