"""Checks the CLI runs before loading a model: each fails fast with one clear message.

Loading the model takes seconds and building the decode kernel the first time about a minute,
so everything that can be wrong with the command line (a model path that is not there, a hub
id, a port already taken, a cache size that does not parse) is found before either starts.
Nothing here imports torch.
"""

from __future__ import annotations

import errno
import os
import re
import socket
from pathlib import Path

from pagedkv.errors import ModelLoadError, PagedKVError

# "org/name" or "org/name@rev": what a Hugging Face hub id looks like
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w.-]+)?")


class PortInUseError(PagedKVError, OSError):
    """The server's host:port cannot be bound (taken, or not an address of this machine)."""


def check_model_source(model: str | None) -> None:
    """None (the shipped model) or an existing local .gguf file / model folder."""
    if model is None or model.lower() == "smollm2":
        return
    path = Path(model).expanduser()
    if path.exists():
        return
    if _HUB_ID.fullmatch(model) and not model.startswith((".", "/", "~")):
        raise ModelLoadError(
            f"{model!r} looks like a Hugging Face hub id, but pagedkv loads local files only: "
            f"download it first (huggingface-cli download {model.split('@')[0]} --local-dir "
            f"DIR) and pass --model DIR, or a .gguf file"
        )
    raise ModelLoadError(f"model path not found: {model} (a .gguf file or a model folder)")


def check_port(host: str, port: int) -> None:
    """Raise PortInUseError unless host:port can be bound now (binds with SO_REUSEADDR, as
    uvicorn does, then releases it)."""
    if not 0 <= port <= 65535:
        raise PortInUseError(f"--port {port} is not a TCP port (0..65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise PortInUseError(f"--host {host!r} does not resolve: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                msg = f"port {port} on {host} is already in use; stop the other server or " \
                      "pick another --port"
            else:
                msg = f"cannot listen on {host}:{port} ({e.strerror}); check --host and --port"
            raise PortInUseError(msg) from None


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads not counted); falls back to the
    logical count where the topology cannot be read."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            pkg = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            return len(cpus) or 1
        cores.add((pkg, core))
    return len(cores) or 1
