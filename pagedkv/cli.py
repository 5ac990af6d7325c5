"""`pagedkv` command line: generate, serve, bench, demo."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from local files only


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file, HF directory, or none for the shipped SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="1GiB", help="KV cache budget, e.g. 2GiB")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides the budget)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def make_engine(args: argparse.Namespace):  # noqa: ANN201
    import torch

    from pagedkv.engine import LLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    return LLMEngine(
        args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len,
    )


def _sampling(args: argparse.Namespace):  # noqa: ANN201
    from pagedkv.engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed)


def stream_generate(engine, prompt, params, out=sys.stdout) -> tuple[str, int, float]:  # noqa: ANN001
    """Print the answer as it is generated; return (text, tokens, seconds)."""
    rid = f"cli-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    shown, final = "", None
    while final is None:
        for o in engine.step():
            if o.request_id != rid:
                continue
            text = o.outputs[0].text
            out.write(text[len(shown):])
            out.flush()
            shown = text
            if o.finished:
                final = o
    out.write("\n")
    return shown, len(final.outputs[0].token_ids), time.perf_counter() - t0


def cmd_generate(args: argparse.Namespace) -> int:
    engine = make_engine(args)
    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    _, n, dt = stream_generate(engine, prompt, _sampling(args))
    print(f"[{n} tokens in {dt:.2f} s, {n / dt:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pagedkv.demo import run_demo

    run_demo(model=args.model, max_tokens=args.max_tokens, plot=args.plot)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedkv.server.app import run_serve

    return run_serve(args, make_engine) or 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedkv.bench import parser_for

    bench_args = parser_for(args.which).parse_args(args.rest)
    result = bench_args._run(bench_args)
    text = json.dumps(result, indent=2)
    print(text)
    if bench_args.output:
        with open(bench_args.output, "w") as f:
            f.write(text + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedkv", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="stream an answer to one prompt")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    _engine_args(g)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="the cache demonstration, then the model on a few prompts")
    d.add_argument("--model", default=None)
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--plot", metavar="DIR", default=None,
                   help="also write block-map and utilization PNGs into DIR")
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(s)
    try:
        from pagedkv.server.app import add_serve_args

        add_serve_args(s)
    except ImportError:  # pragma: no cover - server extras missing
        pass
    s.set_defaults(func=cmd_serve)

    from pagedkv.bench import names as bench_names

    b = sub.add_parser("bench", help="benchmarks; each prints one JSON object",
                       description="`pagedkv bench NAME --help` lists NAME's own options.")
    b.add_argument("which", choices=bench_names())
    b.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    b.set_defaults(func=cmd_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
