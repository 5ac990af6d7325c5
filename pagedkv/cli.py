"""`pagedkv` command line: generate, serve, bench, demo.

Every error ends the command with one line on stderr and a non-zero exit code (`--debug` shows
the traceback). Arguments, the model path and the server port are checked before the model is
loaded; torch is imported only once a command runs, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from local files only

from pagedkv import __version__  # noqa: E402  (after the environment default)
from pagedkv.errors import InvalidParamsError, PagedKVError  # noqa: E402
from pagedkv.options import (  # noqa: E402
    add_arguments,
    cli_spelling,
    finite_float,
    from_namespace,
    positive_int,
)
from pagedkv.startup import say  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.engine.config import EngineConfig

__all__ = ["build_parser", "engine_config", "main", "make_engine", "positive_int"]

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class _Help(argparse.HelpFormatter):
    """Shows an option's default when it has a meaningful one (not None / False, and not for a
    flag that takes no value)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default in (None, False, argparse.SUPPRESS) or "default" in text
                or not action.option_strings or action.nargs == 0):
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

def temperature(text: str) -> float:
    v = finite_float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = greedy), got {v}")
    return v


def probability(text: str) -> float:
    v = finite_float(text)
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


# --- engine options, shared by generate and serve: EngineConfig's fields ----------------------


@contextlib.contextmanager
def _as_flags() -> Iterator[None]:
    """A config validation error raised inside names flags (--n-keep), not fields (n_keep)."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.server.config import ServerConfig

    try:
        yield
    except PagedKVError as e:
        cli_spelling(e, EngineConfig, ServerConfig)
        raise


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine options, checked as far as they can be without loading the model (the
    model path first: a missing file or a hub id is the likeliest mistake)."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.preflight import check_model_source

    check_model_source(args.model)
    with _as_flags():
        return from_namespace(EngineConfig, args)


def set_threads(config: EngineConfig) -> EngineConfig:
    """Set the torch threads and say which and why: --threads, else one per physical core that
    other programs leave free (cpu_load.py). Leaves a CoreWatch that `serve`'s stats task
    re-checks while serving (nothing else reads it)."""
    import torch

    from pagedkv import cpu_load
    from pagedkv.preflight import physical_cores

    cores = physical_cores()
    choice = cpu_load.choose_threads(cores, config.threads)
    torch.set_num_threads(choice.threads)
    cpu_load.WATCH = cpu_load.CoreWatch(choice, cores, explicit=config.threads is not None)
    s = "" if choice.threads == 1 else "s"
    say(f"pagedkv {__version__}: {choice.threads} thread{s} ({choice.reason})")
    return dataclasses.replace(config, threads=choice.threads)


def make_engine(config: EngineConfig):  # noqa: ANN201
    """The engine the options describe, announced line by line on stderr."""
    from pagedkv.engine import LLMEngine
    from pagedkv.startup import engine_lines, prepare_kernel

    config = set_threads(config)
    prepare_kernel()
    say(f"loading {config.model or 'SmolLM2-135M-Instruct'} ...")
    with _as_flags():
        engine = LLMEngine(config=config)
    for line in engine_lines(engine, config.model, config.dtype):
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
    config = engine_config(args)
    t_load = time.monotonic()
    engine = make_engine(config)
    load_s = time.monotonic() - t_load
    raw = args.raw or not engine.has_chat_template
    if raw and not args.raw:
        say(f"{engine.model_name} has no chat template: the prompt goes in as plain text")
    chat = prompt if raw else [{"role": "user", "content": prompt}]
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
    from pagedkv.server.config import ServerConfig

    config = engine_config(args)
    with _as_flags():
        server = from_namespace(ServerConfig, args)
    check_port(server.host, server.port)
    from pagedkv.server.app import run_serve

    return run_serve(args, lambda _args: make_engine(config)) or 0


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


def _engine_args(p: argparse.ArgumentParser) -> None:
    from pagedkv.engine.config import EngineConfig  # a light module: no torch

    add_arguments(p, EngineConfig)


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
