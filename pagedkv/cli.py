"""`pagedkv` command line: generate, serve, bench, demo.

Every error ends the command with one line on stderr and a non-zero exit code (`--debug` shows
the traceback). Arguments, the model path and the server port are checked before the model is
loaded; torch is imported only once a command runs, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, NoReturn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from local files only

from pagedkv import __version__  # noqa: E402  (after the environment default)
from pagedkv.errors import InvalidParamsError, PagedKVError  # noqa: E402
from pagedkv.startup import say  # noqa: E402

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class _Help(argparse.HelpFormatter):
    """Shows an option's default when it has a meaningful one (not None / False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: {default})"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and defaults shown in --help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --- argument types: a bad value is a one-line usage error, before anything loads -----------


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def temperature(text: str) -> float:
    v = _float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = greedy), got {v}")
    return v


def probability(text: str) -> float:
    v = _float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {v}")
    return v


def top_k(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (off) or >= 0, got {v}")
    return v


# --- engine options, shared by generate and serve ------------------------------------------


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file or a model folder (local files only); default: the shipped "
                        "SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype")
    p.add_argument("--weights", default=None, choices=["quantized", "float32"],
                   help="GGUF weights: keep the file's quantized blocks (the default for GGUF at "
                        "float32) or dequantize them to float32 at load")
    p.add_argument("--activations", default="float32", choices=["float32", "int8"],
                   help="int8: round each quantized matmul's input to 8 bits per 32 values and "
                        "multiply in integers (llama.cpp's way; faster, approximate). float32: exact")
    p.add_argument("--batch-weights", default="quantized", choices=["quantized", "float32"],
                   help="float32: also keep a float32 copy of the quantized weights, pre-packed, "
                        "for prefill and large batches (faster there, exact; costs the memory of "
                        "a float32 model). quantized: dequantize tile by tile (no extra memory)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-memory", default="1GiB", help="KV cache budget, e.g. 2GiB, 512MB")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV storage: auto (the compute dtype), float32, float16, bfloat16, int8, "
                        "fp8_e4m3 (int8/fp8: ~3.8x the tokens of float32 in the same memory)")
    p.add_argument("--num-blocks", type=positive_int, default=None,
                   help="KV blocks (overrides --kv-cache-memory)")
    p.add_argument("--max-num-seqs", type=positive_int, default=64,
                   help="sequences decoded together")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                   help="tokens per engine step (prefill chunks + decodes)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context length (default: the model's)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    p.add_argument("--context-shift", action="store_true",
                   help="a sequence that fills the context keeps its first --n-keep tokens, drops "
                        "the next --n-discard and goes on (llama.cpp's context shift) instead of "
                        "finishing with 'length'; longer prompts are cut the same way")
    p.add_argument("--n-keep", type=int, default=0,
                   help="context shift: tokens always kept at the start (the system prompt)")
    p.add_argument("--n-discard", type=positive_int, default=None,
                   help="context shift: tokens dropped per shift (default: half of the rest)")
    p.add_argument("--kv-tier", default=None,
                   help="second KV level shared across restarts/replicas: disk:DIR[?max_size=10GiB] "
                        "or redis://host:port/db[?ttl=SECONDS]")
    p.add_argument("--kv-snapshot", default=None, metavar="DIR",
                   help="write every cached KV block here on shutdown, reload it at start")
    p.add_argument("--kv-snapshot-interval", type=float, default=None, metavar="SECONDS",
                   help="also snapshot new cached blocks every SECONDS, in the background")
    p.add_argument("--no-dedup-inflight-prefixes", action="store_true",
                   help="admit requests that share a prefix with a running prefill at once, "
                        "instead of holding them until the shared blocks are cached")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: the physical core count; more threads than "
                        "free cores slows every step down)")


def check_engine_args(args: argparse.Namespace) -> None:
    """Everything about the engine options that can be checked without loading the model."""
    from pagedkv.engine import parse_size
    from pagedkv.preflight import check_model_source

    check_model_source(args.model)
    from pagedkv.cache.quant import resolve_kv_cache_dtype

    resolve_kv_cache_dtype(getattr(args, "kv_cache_dtype", "auto"))  # names the supported ones
    if getattr(args, "kv_tier", None):
        from pagedkv.cache.tiers import parse_spec

        parse_spec(args.kv_tier)  # TierConfigError names what is wrong
    if getattr(args, "kv_snapshot_interval", None) is not None and (
            args.kv_snapshot_interval <= 0 or not args.kv_snapshot):
        raise InvalidParamsError("--kv-snapshot-interval needs --kv-snapshot and a positive value")
    if args.num_blocks is None:
        try:
            budget = parse_size(args.kv_cache_memory)
        except (PagedKVError, ValueError, OverflowError) as e:
            raise InvalidParamsError(f"--kv-cache-memory: {e}") from None
        if budget < 1:
            raise InvalidParamsError(f"--kv-cache-memory must be positive, got "
                                     f"{args.kv_cache_memory!r}")


def set_threads(args: argparse.Namespace) -> None:
    import torch

    from pagedkv.preflight import physical_cores

    n = args.threads or physical_cores()
    torch.set_num_threads(n)
    why = "--threads" if args.threads else "one per physical core; --threads N to change"
    say(f"pagedkv {__version__}: {n} threads ({why})")


def make_engine(args: argparse.Namespace):  # noqa: ANN201
    """The engine the options describe, announced line by line on stderr."""
    from pagedkv.engine import LLMEngine
    from pagedkv.startup import engine_lines, prepare_kernel

    set_threads(args)
    prepare_kernel()
    say(f"loading {args.model or 'SmolLM2-135M-Instruct'} ...")
    engine = LLMEngine(
        args.model,
        dtype=args.dtype,
        weights=getattr(args, "weights", None),
        activations=getattr(args, "activations", "float32"),
        batch_weights=getattr(args, "batch_weights", "quantized"),
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        dedup_inflight_prefixes=not args.no_dedup_inflight_prefixes,
        max_model_len=args.max_model_len,
        kv_tier=args.kv_tier,
        kv_snapshot=args.kv_snapshot,
        kv_snapshot_interval=args.kv_snapshot_interval,
        context_shift=args.context_shift,
        n_keep=args.n_keep,
        n_discard=args.n_discard,
    )
    for line in engine_lines(engine, args.model, args.dtype):
        say(line)
    return engine


# --- generate --------------------------------------------------------------------------------


def _sampling(args: argparse.Namespace):  # noqa: ANN201
    from pagedkv.engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed)


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt argument, else --file, else stdin when it is not a terminal."""
    if args.prompt not in (None, "-") and args.file:
        raise InvalidParamsError("give the prompt as an argument or with --file, not both")
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise InvalidParamsError(f"--file: {e.strerror}: {args.file}") from None
    elif args.prompt not in (None, "-"):
        text = args.prompt
    elif args.prompt == "-" or not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        raise InvalidParamsError("no prompt: give one as an argument, with --file, or on stdin")
    if not text.strip():
        raise InvalidParamsError("the prompt is empty")
    return text.rstrip("\n") if args.file or args.prompt in (None, "-") else text


def stream_generate(engine, prompt, params, out=sys.stdout):  # noqa: ANN001, ANN201
    """Print the answer as it is generated; return (last RequestOutput, interrupted).

    Ctrl-C ends it early: the request is aborted and the answer so far ends with a newline.
    """
    rid = f"cli-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, params)
    shown, last = "", None
    try:
        while last is None or not last.finished:
            for o in engine.step():
                if o.request_id != rid:
                    continue
                text = o.outputs[0].text
                out.write(text[len(shown):])
                out.flush()
                shown, last = text, o
    except KeyboardInterrupt:
        engine.abort_request(rid)
        out.write("\n")
        out.flush()
        return last, True
    out.write("\n")
    out.flush()
    return last, False


def summary_line(out: Any, load_s: float, seconds: float, interrupted: bool = False) -> str:
    """`[load 1.9 s | first token 0.21 s | 48 tokens in 1.6 s, 30.2 tok/s | finish: stop]`."""
    parts = [f"load {load_s:.1f} s"]
    n = len(out.outputs[0].token_ids) if out is not None else 0
    if out is not None and out.first_token_time is not None:
        parts.append(f"first token {out.first_token_time - out.arrival_time:.2f} s")
    parts.append(f"{n} tokens in {seconds:.1f} s, {n / seconds if seconds else 0:.1f} tok/s")
    parts.append("interrupted (Ctrl-C)" if interrupted
                 else f"finish: {out.outputs[0].finish_reason}")
    return "[" + " | ".join(parts) + "]"


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    params = _sampling(args)
    check_engine_args(args)
    t_load = time.monotonic()
    engine = make_engine(args)
    load_s = time.monotonic() - t_load
    chat = prompt if args.raw else [{"role": "user", "content": prompt}]
    t0 = time.monotonic()
    out, interrupted = stream_generate(engine, chat, params)
    say(summary_line(out, load_s, time.monotonic() - t0, interrupted))
    return EXIT_INTERRUPTED if interrupted else 0


# --- the other commands ----------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from pagedkv.demo import run_demo

    run_demo(model=args.model, max_tokens=args.max_tokens, plot=args.plot)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedkv.preflight import check_port
    from pagedkv.server.app import run_serve

    check_engine_args(args)
    check_port(args.host, args.port)
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


# --- the parser ------------------------------------------------------------------------------


def _common() -> argparse.ArgumentParser:
    """Options every subcommand takes."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the full traceback of an error")
    return p


def _generate_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    g = sub.add_parser("generate", parents=[common], help="stream an answer to one prompt",
                       description="Stream the answer to one prompt (greedy by default).")
    g.add_argument("prompt", nargs="?", default=None,
                   help="the prompt; omit it (or give '-') to read stdin")
    g.add_argument("--file", "-f", default=None, help="read the prompt from this file")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--max-tokens", type=positive_int, default=256, help="tokens to generate")
    g.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=top_k, default=-1, help="-1 = off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    _engine_args(g)
    g.set_defaults(func=cmd_generate)


def _serve_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    from pagedkv.server.options import add_serve_args  # a light module: no FastAPI, no torch

    s = sub.add_parser("serve", parents=[common], help="OpenAI-compatible HTTP server",
                       description="OpenAI-compatible HTTP server (/v1/completions, "
                                   "/v1/chat/completions, /metrics, ...).")
    _engine_args(s)
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    """The whole parser; building it imports nothing heavy."""
    from pagedkv.bench import names as bench_names

    ap = Parser(prog="pagedkv", description=__doc__.split("\n\n")[0],
                epilog="`pagedkv COMMAND --help` lists a command's options.")
    ap.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    ap.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    common = _common()
    _generate_parser(sub, common)

    d = sub.add_parser("demo", parents=[common],
                       help="the cache demonstration, then the model on a few prompts")
    d.add_argument("--model", default=None, help="model for the second part (default: shipped)")
    d.add_argument("--max-tokens", type=positive_int, default=48)
    d.add_argument("--plot", metavar="DIR", default=None,
                   help="also write block-map and utilization PNGs into DIR")
    d.set_defaults(func=cmd_demo)

    _serve_parser(sub, common)

    b = sub.add_parser("bench", parents=[common],
                       help="benchmarks; each prints one JSON object",
                       description="`pagedkv bench NAME --help` lists NAME's own options.")
    b.add_argument("which", choices=bench_names(), metavar="NAME",
                   help="one of: " + ", ".join(bench_names()))
    b.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    b.set_defaults(func=cmd_bench)
    return ap


def error_line(e: BaseException) -> str:
    """One line for an error: our own errors say enough; anything else names its type."""
    if isinstance(e, PagedKVError):
        msg = str(e)
    elif isinstance(e, OSError) and e.strerror:
        msg = f"{e.strerror}" + (f": {e.filename}" if e.filename else "")
    else:
        msg = f"{type(e).__name__}: {e} (run with --debug for the traceback)"
    return " ".join(msg.split())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv[: argv.index("--")] if "--" in argv else "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        say("\npagedkv: interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:
        if debug:
            raise
        say(f"pagedkv: error: {error_line(e)}")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
