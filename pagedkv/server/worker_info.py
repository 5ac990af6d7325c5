"""What a router asks a worker: SGLang's worker endpoints, so `pagedkv serve` replicas can sit
behind `sglang-router` (`--policy cache_aware`) as SGLang workers do.

sglang-router registers a worker by GET /health, /server_info and /model_info (SGLang also
spells them /get_server_info and /get_model_info); its load-based policies read GET /get_load.
Each answers from the engine's own figures (the engine thread's stats call), nothing made up:
- /server_info: the model, served name, tp_size / dp_size 1, the scheduler's limits;
- /model_info: model_path (the served model name: the id requests name), is_generation;
- /get_load: one entry per data-parallel rank (one here): requests running and waiting, and
  the KV tokens in use.
They sit behind the API key like every non-health route (the router sends its own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pagedkv import __version__
from pagedkv.server.async_engine import EngineDeadError

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.server.app import OpenAIServer


def add_worker_routes(app: FastAPI, server: OpenAIServer) -> None:
    from pagedkv.server.app import error_for

    async def engine_facts() -> dict:
        def facts(engine: object) -> dict:
            st = engine.stats()  # type: ignore[attr-defined]
            cfg = engine.config  # type: ignore[attr-defined]
            return {"running": st.num_running, "waiting": st.num_waiting,
                    "used_tokens": st.blocks_used * engine.cache.block_size,  # type: ignore[attr-defined]
                    "max_num_seqs": cfg.max_num_seqs,
                    "max_batched_tokens": cfg.max_num_batched_tokens,
                    "block_size": engine.cache.block_size,  # type: ignore[attr-defined]
                    "arch": engine.loaded.config.architecture}  # type: ignore[attr-defined]
        try:
            return await server.engine.call(facts)
        except EngineDeadError as exc:
            raise error_for(exc) from None

    async def server_info() -> Response:
        f = await engine_facts()
        name = server.served_model_name
        return JSONResponse({
            "model_path": name, "served_model_name": name, "tokenizer_path": name,
            "tp_size": 1, "dp_size": 1, "load_balance_method": "round_robin",
            "disaggregation_mode": "null", "model_type": f["arch"], "architectures": [f["arch"]],
            "version": __version__, "max_batch_size": f["max_num_seqs"],
            "max_running_requests": f["max_num_seqs"], "max_num_reqs": f["max_num_seqs"],
            "max_prefill_tokens": f["max_batched_tokens"],
            "max_total_num_tokens": server.cache_tokens, "context_length": server.max_model_len,
            "page_size": f["block_size"], "engine": "pagedkv",
        })

    async def model_info() -> Response:
        f = await engine_facts()
        name = server.served_model_name
        return JSONResponse({"model_path": name, "tokenizer_path": name, "is_generation": True,
                             "model_type": f["arch"], "architectures": [f["arch"]],
                             "served_model_name": name})

    async def get_load() -> Response:
        f = await engine_facts()
        return JSONResponse([{"dp_rank": 0, "num_reqs": f["running"] + f["waiting"],
                              "num_waiting_reqs": f["waiting"], "num_tokens": f["used_tokens"]}])

    for path, fn in (("/server_info", server_info), ("/get_server_info", server_info),
                     ("/model_info", model_info), ("/get_model_info", model_info),
                     ("/get_load", get_load)):
        app.add_api_route(path, fn, methods=["GET"])
