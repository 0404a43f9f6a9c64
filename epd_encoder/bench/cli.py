# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder bench``: the flags, turned into targets and a ``RunSpec`` (docs/bench.md).

Serve flags for a server the bench starts come from ``--serve-arg=--flag=value``
(repeatable) or everything after ``--``; they apply to ours and to the reference
baseline alike. Exit status: 0 when every target ran, 1 when a target failed (its
server did not start, warm-up failed; the others' results are still written when it was
a baseline), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import tempfile
import sys
from pathlib import Path

from epd_encoder.bench.load import LoadPoint
from epd_encoder.bench.media import MediaSource
from epd_encoder.bench.report import document, table, write_json, write_png
from epd_encoder.bench.runner import RunSpec, Target, ratios, run_target
from epd_encoder.bench.server import NAIVE_SERVER, ServerStartError, environment, naive_command, serve_command
from epd_encoder.bench.workload import WorkloadSpec, load_trace, parse_sizes


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: need positive values")
    return values


def build_parser() -> argparse.ArgumentParser:
    from epd_encoder.flags import ArgumentParser  # a parse error leads with the error, as serve's

    ap = ArgumentParser(
        prog="epd-encoder bench",
        description="Load an encode server and measure it, optionally beside baselines in the same run. "
        "Serve flags for a started server: --serve-arg=--flag=value, or everything after '--'.")
    t = ap.add_argument_group("target")
    t.add_argument("--url", help="a running server (ours or anything that speaks our API)")
    t.add_argument("--model", help="checkpoint dir: start `epd-encoder serve` on it (unless --url) and the "
                   "naive / reference baselines")
    t.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="a flag for the started servers, e.g. --serve-arg=--max-batch-cost=4096 (repeatable)")
    t.add_argument("--baseline", action="append", default=[], choices=["naive", "reference"],
                   help="naive: benchmarks/naive_server.py on --model; reference: our server with "
                   "--scheduling reference (repeatable)")
    t.add_argument("--baseline-url", action="append", default=[], metavar="URL",
                   help="another server that speaks our API (repeatable)")
    t.add_argument("--naive-server", type=Path, default=NAIVE_SERVER, help="the naive server script")
    lo = ap.add_argument_group("load")
    lo.add_argument("--concurrency", type=_floats, help="closed loop: N clients; a list sweeps (1,4,8)")
    lo.add_argument("--rate", type=_floats, help="open loop: Poisson arrivals per second; a list sweeps")
    lo.add_argument("--duration", type=float, help="seconds per load point (sending stops, answers finish)")
    lo.add_argument("--num-requests", type=int, help="requests per load point (default 200 without --duration)")
    lo.add_argument("--warmup", type=int, default=4, help="warm-up requests per target, not measured")
    lo.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    w = ap.add_argument_group("workload")
    w.add_argument("--image-sizes", default="448x448",
                   help="WxH[:weight] or LO-HI[:weight] (each side drawn in [LO, HI]), comma-separated")
    w.add_argument("--images-per-request", type=int, default=1)
    w.add_argument("--duplicate-rate", type=float, default=0.0,
                   help="fraction of items repeating an earlier one, Zipf over the pool")
    w.add_argument("--pool-size", type=int, default=1000, help="distinct media duplicates are drawn from")
    w.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent over the pool's ranks")
    w.add_argument("--video-share", type=float, default=0.0, help="fraction of items that are videos")
    w.add_argument("--video-seconds", type=float, default=2.0)
    w.add_argument("--video-size", default="160x120", help="WxH of generated clips")
    w.add_argument("--video-fps", type=float, default=2.0, help="video_options.fps sent with videos")
    w.add_argument("--image-format", choices=["png", "jpeg"], default="png")
    w.add_argument("--image-dir", help="read images from this folder (sorted, cycling) instead of generating")
    w.add_argument("--trace", help="JSONL trace to replay: {\"timestamp\": s, \"media\": [path or URL, ...]}")
    w.add_argument("--seed", type=int, default=0)
    o = ap.add_argument_group("delivery and output")
    o.add_argument("--delivery", choices=["inline", "pull", "push"], default="inline")
    o.add_argument("--push-backend", default="tcp", help="our receiver's backend for push")
    o.add_argument("--push-pool-mb", type=int, default=256,
                   help="our receiver's pool: embeddings of every push request in flight must fit")
    o.add_argument("--output", type=Path, help="write results.json and results.png here")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _points(args: argparse.Namespace, ap: argparse.ArgumentParser) -> tuple[LoadPoint, ...]:
    if args.concurrency and args.rate:
        ap.error("--concurrency and --rate exclude each other")
    if args.rate:
        return tuple(LoadPoint("rate", r) for r in args.rate)
    if args.concurrency:
        if any(c != int(c) for c in args.concurrency):
            ap.error("--concurrency takes whole numbers")
        return tuple(LoadPoint("concurrency", c) for c in args.concurrency)
    return (LoadPoint("trace", 0),) if args.trace else (LoadPoint("concurrency", 8),)


def targets(args: argparse.Namespace, serve_args: list[str], ap: argparse.ArgumentParser) -> list[Target]:
    if not args.url and not args.model:
        ap.error("give --url (a running server) or --model (a server to start)")
    if set(args.baseline) and not args.model:
        ap.error("--baseline naive / reference start a server on --model; give --model")
    model = args.model
    out = [Target("ours", url=args.url) if args.url else
           Target("ours", command=lambda port: serve_command(model, port, serve_args))]
    for name in dict.fromkeys(args.baseline):
        if name == "naive":
            if not args.naive_server.is_file():
                ap.error(f"--baseline naive: {args.naive_server} is not there (--naive-server)")
            note = "answers inline only" if args.delivery != "inline" else ""
            out.append(Target("naive", command=lambda port: naive_command(model, port, args.naive_server),
                              delivery="inline", note=note))
        else:
            out.append(Target("reference", command=lambda port: serve_command(
                model, port, [*serve_args, "--scheduling", "reference"])))
    for i, url in enumerate(args.baseline_url):
        out.append(Target(f"url{i + 1}" if len(args.baseline_url) > 1 else "url", url=url))
    return out


def spec(args: argparse.Namespace, ap: argparse.ArgumentParser) -> RunSpec:
    try:
        workload = WorkloadSpec(parse_sizes(args.image_sizes), args.images_per_request, args.duplicate_rate,
                                args.pool_size, args.zipf_s, args.video_share)
        trace = tuple(load_trace(args.trace)) if args.trace else None
    except (ValueError, OSError) as e:
        ap.error(str(e))
    if args.duration is not None and args.num_requests is not None:
        ap.error("--duration and --num-requests exclude each other")
    num = (None if args.duration is not None else args.num_requests or (len(trace) if trace else 200))
    videos = args.video_share > 0 or (trace is not None and any(m.kind == "video" for r in trace for m in r.items))
    return RunSpec(workload, _points(args, ap), num_requests=num, duration=args.duration, seed=args.seed,
                   delivery=args.delivery, warmup=args.warmup, timeout=args.timeout,
                   push_backend=args.push_backend, push_pool_bytes=args.push_pool_mb << 20, trace=trace,
                   extra={"video_options": {"fps": args.video_fps}} if videos else {},
                   progress=not args.no_progress)


def main(argv: list[str]) -> int:
    own, serve_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = build_parser()
    args = ap.parse_args(own)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    serve_args = [a for s in args.serve_arg for a in shlex.split(s)] + serve_args
    run = spec(args, ap)
    tgts = targets(args, serve_args, ap)
    try:
        vw, vh = (int(v) for v in args.video_size.split("x"))
        source = MediaSource(args.seed, image_format=args.image_format, image_dir=args.image_dir,
                             video_seconds=args.video_seconds, video_size=(vw, vh))
    except ValueError as e:
        ap.error(str(e))
    log_dir = args.output or Path(tempfile.mkdtemp(prefix="epd-bench-"))  # started servers' logs
    runs, failed = [], []
    for target in tgts:
        print(f"bench: {target.name} ({target.url or 'started here'}), {len(run.points)} load point(s)",
              file=sys.stderr)
        try:
            runs.append(run_target(target, run, source, log_dir))
        except (ServerStartError, RuntimeError) as e:
            print(f"error: {target.name}: {e}", file=sys.stderr)
            if not runs:  # ours: nothing to compare against
                return 1
            failed.append(target.name)  # a baseline: the others' results are still written
    doc = document(runs, {r["name"]: ratios(runs[0], r) for r in runs[1:]},
                   command=["epd-encoder", "bench", *argv], machine=environment(),
                   workload={"image_sizes": args.image_sizes, "images_per_request": args.images_per_request,
                             "duplicate_rate": args.duplicate_rate, "pool_size": args.pool_size,
                             "zipf_s": args.zipf_s, "video_share": args.video_share, "seed": args.seed,
                             "image_format": args.image_format, "image_dir": args.image_dir,
                             "trace": args.trace, "num_requests": run.num_requests, "duration": run.duration,
                             "delivery": run.delivery, "serve_args": serve_args}, failed=failed)
    print(table(doc))
    if args.output:
        print(f"wrote {write_json(doc, args.output)}")
        png = write_png(doc, args.output, warn=lambda m: print(f"warning: {m}", file=sys.stderr))
        if png:
            print(f"wrote {png}")
    return 1 if failed else 0
