"""EngineConfig / ServerConfig: each option declared once, the CLI generated from the fields,
the same typed errors as before, checked before the model loads."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.cli import build_parser, engine_config
from pagedkv.engine.config import EngineConfig
from pagedkv.errors import (
    CacheConfigError,
    InvalidParamsError,
    ModelLoadError,
    PagedKVError,
    TierConfigError,
    UnknownOptionError,
)
from pagedkv.options import cli_fields, cli_spelling
from pagedkv.server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[1]
MISSING = "/no/such/model.gguf"  # loading it would raise ModelLoadError "not found"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")


def _sub(cmd: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[cmd]


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


# --- the CLI is generated from the fields ------------------------------------------------------


@pytest.mark.parametrize(("cmd", "classes"), [("generate", (EngineConfig,)),
                                              ("serve", (EngineConfig, ServerConfig))])
def test_every_config_flag_is_on_the_cli_with_the_fields_default(cmd: str, classes: tuple) -> None:
    flags = _flags(_sub(cmd))
    for cls in classes:
        for f, flag in cli_fields(cls):
            action = flags[flag]
            assert action.dest == f.name, flag
            assert action.default == f.default, flag
            assert action.help == f.metadata["option"].help, flag


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_every_cli_option_is_a_config_field_or_the_commands_own(cmd: str) -> None:
    own = {"generate": {"--file", "-f", "--raw", "--max-tokens", "--temperature", "--top-p",
                        "--top-k", "--seed"}, "serve": set()}[cmd] | {"-h", "--help", "--debug"}
    fields = {flag for cls in (EngineConfig, ServerConfig) for _, flag in cli_fields(cls)}
    assert set(_flags(_sub(cmd))) - own <= fields


def test_defaults_are_written_once() -> None:
    ns = build_parser().parse_args(["serve"])
    assert engine_config(ns) == EngineConfig()
    assert dataclasses.asdict(ServerConfig()) == {
        f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerConfig)}
    assert EngineConfig.block_size == 16 and EngineConfig.kv_cache_memory == "1GiB"


def test_flags_map_back_to_the_fields_they_set() -> None:
    ns = build_parser().parse_args([
        "serve", "--no-prefix-caching", "--no-dedup-inflight-prefixes", "--block-size", "32",
        "--context-shift", "--n-keep", "4", "--max-concurrent", "3", "--api-key", "a",
        "--api-key", "b"])
    cfg = engine_config(ns)
    assert (cfg.enable_prefix_caching, cfg.dedup_inflight_prefixes) == (False, False)
    assert (cfg.block_size, cfg.context_shift, cfg.n_keep) == (32, True, 4)
    server = ServerConfig.build(**{f.name: getattr(ns, f.name)
                                   for f in dataclasses.fields(ServerConfig)})
    assert server.max_concurrent == 3 and server.api_key == ["a", "b"]


def _argv(cfg: EngineConfig) -> list[str]:
    """Flags that describe cfg (the inverse of parsing)."""
    out: list[str] = []
    for f, flag in cli_fields(EngineConfig):
        v = getattr(cfg, f.name)
        if v == f.default:
            continue
        out += [flag] if isinstance(f.default, bool) else [flag, str(v)]
    return out


@given(block_size=st.integers(1, 64), max_num_seqs=st.integers(1, 512),
       num_blocks=st.none() | st.integers(1, 10_000), caching=st.booleans(),
       shift=st.booleans(), n_keep=st.integers(0, 64), memory=st.sampled_from(["1GiB", "512MB", "3e8"]),
       kv=st.sampled_from(["auto", "int8", "float16"]))
def test_cli_round_trip(block_size: int, max_num_seqs: int, num_blocks: int | None, caching: bool,
                        shift: bool, n_keep: int, memory: str, kv: str) -> None:
    cfg = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                       enable_prefix_caching=caching, context_shift=shift,
                       n_keep=n_keep if shift else 0, kv_cache_memory=memory, kv_cache_dtype=kv)
    ns = build_parser().parse_args(["generate", *_argv(cfg), "hi"])
    assert engine_config(ns) == cfg


def test_serve_help_stays_free_of_torch() -> None:
    code = ("import sys\nfrom pagedkv.cli import build_parser\n"
            "build_parser().parse_args(['serve'])\n"
            "import pagedkv.engine.config, pagedkv.server.config\n"
            "assert 'torch' not in sys.modules and 'fastapi' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=_env())
    assert r.returncode == 0, r.stderr


# --- unknown options ---------------------------------------------------------------------------


def test_llm_rejects_an_unknown_option_naming_it() -> None:
    from pagedkv import LLM, LLMEngine

    for make in (LLM, LLMEngine):
        with pytest.raises(UnknownOptionError, match="'num_block'.*'num_blocks'"):
            make(MISSING, num_block=8)  # refused before the (missing) model is looked at
    with pytest.raises(TypeError):  # still what Python itself raises for a bad keyword
        LLM(MISSING, no_such_option=1)


def test_server_rejects_an_unknown_option() -> None:
    from pagedkv.server.app import build_app

    with pytest.raises(UnknownOptionError, match="max_concurent"):
        build_app(object(), max_concurent=3)


def test_config_object_and_keywords_combine() -> None:
    base = EngineConfig(block_size=32)
    cfg = EngineConfig.build(base, num_blocks=8)
    assert (cfg.block_size, cfg.num_blocks) == (32, 8) and base.num_blocks is None
    with pytest.raises(CacheConfigError):  # replace validates again
        EngineConfig.build(base, block_size=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.block_size = 8  # type: ignore[misc]


# --- validation: the same typed errors as before, before the model loads ---------------------


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"kv_cache_dtype": "q4_0"}, CacheConfigError, "fp8_e4m3"),
        ({"activations": "int4"}, ModelLoadError, "unsupported activations"),
        ({"weights": "float32", "activations": "int8"}, ModelLoadError, "needs weights='quantized'"),
        ({"batch_weights": "int8"}, ModelLoadError, "unsupported batch_weights"),
        ({"kv_cache_memory": "lots"}, CacheConfigError, "cannot parse memory size 'lots'"),
        ({"kv_cache_memory": "0GiB"}, CacheConfigError, "kv_cache_memory must be positive"),
        ({"block_size": 0}, CacheConfigError, "block_size must be a positive int"),
        ({"num_blocks": -1}, CacheConfigError, "num_blocks"),
        ({"max_num_seqs": 0}, InvalidParamsError, "max_num_seqs"),
        ({"kv_tier": "ftp://host"}, TierConfigError, "unknown KV tier"),
        ({"kv_tier": "disk:/tmp/x?max_size=lots"}, TierConfigError, "max_size"),
        ({"kv_snapshot_interval": 5.0}, TierConfigError, "needs kv_snapshot"),
        ({"kv_snapshot": "/tmp/x", "kv_snapshot_interval": float("nan")}, TierConfigError,
         "positive"),
        ({"kv_tier": "disk:/tmp/x", "enable_prefix_caching": False}, TierConfigError,
         "needs prefix caching"),
        ({"context_shift": True, "n_keep": -1}, CacheConfigError, "n_keep"),
        ({"context_shift": True, "n_keep": 1.5}, CacheConfigError, "n_keep"),
        ({"context_shift": True, "n_discard": 0}, CacheConfigError, "n_discard"),
    ],
)
def test_bad_option_is_the_same_typed_error_before_loading(kw: dict, error: type,
                                                           match: str) -> None:
    from pagedkv import LLMEngine

    with pytest.raises(error, match=match):
        LLMEngine(MISSING, **kw)


@pytest.mark.parametrize("kw", [{"max_request_bytes": 0}, {"body_timeout": 0},
                                {"stream_queue_limit": 0}, {"max_concurrent": 0},
                                {"port": 70_000}, {"header_timeout": float("inf")}])
def test_bad_server_option_is_a_value_error(kw: dict) -> None:
    from pagedkv.server.app import build_app

    with pytest.raises(InvalidParamsError, match=next(iter(kw))):
        build_app(object(), **kw)
    assert issubclass(InvalidParamsError, ValueError)  # what OpenAIServer raised before


def test_cli_spelling_names_flags() -> None:
    with pytest.raises(PagedKVError) as info:
        EngineConfig(kv_snapshot_interval=1.0)
    cli_spelling(info.value, EngineConfig)
    assert str(info.value) == "--kv-snapshot-interval needs --kv-snapshot and a positive value"


# --- issue 24, item 13: nothing ignored silently -----------------------------------------------


@pytest.mark.parametrize("kw", [{"n_keep": 8}, {"n_discard": 16}])
def test_context_shift_options_without_context_shift_are_refused(kw: dict) -> None:
    with pytest.raises(CacheConfigError, match=f"{next(iter(kw))}=.*needs context_shift"):
        EngineConfig(**kw)
    EngineConfig(context_shift=True, **kw)  # fine with it


def test_cli_refuses_n_keep_without_context_shift_in_one_line() -> None:
    r = subprocess.run([sys.executable, "-m", "pagedkv.cli", "generate", "--n-keep", "8", "hi"],
                       capture_output=True, text=True, timeout=60,
                       env=_env())
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "--n-keep=8 needs --context-shift" in lines[0]


def test_max_model_len_over_the_models_context_is_refused(smollm2: Any) -> None:
    from pagedkv import LLMEngine

    ctx = smollm2.config.max_position_embeddings
    with pytest.raises(CacheConfigError, match=f"max_model_len \\({ctx + 1}\\).*context of {ctx}"):
        LLMEngine(smollm2, num_blocks=8, max_model_len=ctx + 1)
    assert LLMEngine(smollm2, num_blocks=8, max_model_len=ctx).max_model_len == ctx
    assert LLMEngine(smollm2, num_blocks=8).max_model_len == ctx


# --- parse_size lives in the cache layer -------------------------------------------------------


def test_parse_size_is_the_cache_layers() -> None:
    from pagedkv.cache.sizing import parse_size
    from pagedkv.engine import parse_size as engine_parse_size

    assert engine_parse_size is parse_size
    assert parse_size("2GiB") == 2 * 1024**3 and parse_size("512MB") == 512 * 1000**2
    for bad in ("lots", "1.2.3", "1e999", "1e300T"):
        with pytest.raises(CacheConfigError, match="cannot parse"):
            parse_size(bad)
    code = ("import sys\nimport pagedkv.cache.tiers\n"
            "assert not [m for m in sys.modules if m.startswith('pagedkv.engine')], 'engine'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=_env())
    assert r.returncode == 0, r.stderr
