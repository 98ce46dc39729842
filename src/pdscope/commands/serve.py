"""`pdscope serve`: the HTTP side's settings, checked, then the server run until stopped.

The engine's knobs are :class:`~pdscope.engine.args.EngineArgs`; these are the rest of the
flags. As there, a field with a ``help`` is a flag, so the CLI lists each one once.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from pdscope.commands.flags import names
from pdscope.engine.args import EngineArgs, knob
from pdscope.specs.sizes import parse_bytes

MIN_REQUEST_BYTES = 1024


@dataclass
class ServeSettings:
    host: str = knob("127.0.0.1", "Address to bind (loopback unless told).")
    port: int = knob(8000, "TCP port.")
    served_model_name: str | None = knob(None, "Model name clients send (default: --model).")
    api_key: str | None = knob(
        None, "Require 'Authorization: Bearer KEY' (all routes but /health, /metrics)."
    )
    max_queue: int | None = knob(None, "Refuse (503) new requests while this many wait.")
    max_request_bytes: str = knob(
        "8MiB", "Refuse (413) request bodies larger than this, e.g. 8MiB."
    )
    allowed_origins: str = knob(
        "",
        "Comma-separated browser origins allowed besides loopback ones, e.g. "
        "'https://app.example,http://*.lan:*'; '*' allows any.",
    )
    allowed_hosts: str = knob(
        "",
        "Comma-separated Host names accepted besides loopback names and IP addresses (checked "
        "when bound to loopback, against DNS rebinding).",
    )
    threads: int | None = knob(
        None,
        "CPU threads for the engine's math (default: all cores). Fewer leaves cores to HTTP "
        "clients on the same machine.",
    )
    shutdown_timeout: float = knob(
        0.0,
        "Seconds SIGTERM/SIGINT lets requests in flight finish before they are aborted "
        "(0: at once, as vLLM's default). A second signal aborts them at once.",
    )

    def __post_init__(self) -> None:
        """Refuse bad flags before the model loads (a ``ValueError`` names the flag)."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be 0-65535, got {self.port}")
        try:  # uvicorn's own failure names no host: "[Errno -2] Name or service not known"
            if self.host:  # "" binds every interface
                socket.getaddrinfo(self.host, None)
        except (OSError, UnicodeError) as exc:
            raise ValueError(
                f"--host {self.host}: no address to bind ({getattr(exc, 'strerror', None) or exc})"
            ) from None
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_request_body_bytes < MIN_REQUEST_BYTES:
            raise ValueError(
                f"--max-request-bytes must be at least 1KiB, got {self.max_request_bytes}"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if not 0 <= self.shutdown_timeout < float("inf"):
            raise ValueError(
                f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}"
            )

    @property
    def max_request_body_bytes(self) -> int:
        try:
            return parse_bytes(self.max_request_bytes)
        except ValueError as exc:
            raise ValueError(f"--max-request-bytes: {exc}") from None


# How long GNU OpenMP's workers spin before they sleep (GOMP_SPINCOUNT), for a server that has
# not been told (nor OMP_WAIT_POLICY): libgomp's own default, ~300,000 spins, keeps the workers
# spinning through the engine's Python between steps and between its kernels, taking the
# cores the server's HTTP loop and, on a small machine, its clients need. Measured on a 2-core
# AMD EPYC (docs/performance.md, "One OpenMP team"): at the default a probe beside the server
# could no longer read 8 streams as one batch and bench at 8 streams gained 1.3x over 1 instead
# of 1.5x or more; at 1,000 (what libgomp itself counts when its threads outnumber the CPUs)
# batch-1 decode took 9.0-10.0 ms a token against 7.3-8.9 at the default, and 10.5-11.9 before
# the server kept one OpenMP team. The one-call decode step now runs in one region whose
# barriers spin as long as this count says ("A decode step in one OpenMP region"), so a
# decode step pays a wake-up only at its start (in process at 1,000, 0.94-1.16x the speed of
# the step whose every kernel was a region: within this host's noise; at 0, ~1.3x). A step
# with a prefill still opens a region per kernel (oneDNN's matmuls, torch's ops), and at 1,000
# the workers slept between them: on the AMX Xeon an 8-token prefill step of the small model
# took 19.0 ms against 15.7 at 10,000, and two servers side by side, 10,000 against 1,000, read
# mean TTFT 0.86-0.88x and output tok/s 1.07-1.09x at 1 and 8 streams, with a client on the
# same 2 cores; 30,000 read about the same as 10,000 (docs/performance.md, "Between a
# prefill's kernels"). So a model whose layers hold SPIN_MIN_LAYER_WEIGHTS weights or more
# gets SERVER_SPIN_COUNT; a smaller one (the test models: steps of ~0.3 ms, whose gaps the
# HTTP loop and colocated clients need) keeps SMALL_MODEL_SPIN_COUNT, with which the tests
# that put a client beside the server passed in every run where 10,000 failed two of four
# (a 2-core AMD EPYC, before the one-call decode step). The line is the C step's
# TEAM_MIN_LAYER_WEIGHTS (engine/csrc/decode_ops.c): below it kernels are too short to share.
SERVER_SPIN_COUNT = "10000"
SMALL_MODEL_SPIN_COUNT = "1000"
SPIN_MIN_LAYER_WEIGHTS = 2 << 20


def spin_count(model: str) -> str:
    """The GOMP_SPINCOUNT for serving ``model`` (a preset name or a checkpoint directory),
    from its config alone (torch is not loaded yet): SERVER_SPIN_COUNT where its config
    cannot be read (the load then says why)."""
    from pathlib import Path

    from pdscope.checkpoint.presets import PRESETS
    from pdscope.specs.errors import SpecError
    from pdscope.specs.models import read_config, spec_from_config

    try:
        config = PRESETS.get(model) or read_config(Path(model).expanduser())
        layers = spec_from_config(config, name=model).layers
    except (SpecError, OSError, KeyError, TypeError, ValueError):
        return SERVER_SPIN_COUNT
    # the weights a token's step reads in a layer (plan's arithmetic): C's layer_weights
    layer = max(spec.attn_params + spec.mlp_active_params for spec in layers)
    return SERVER_SPIN_COUNT if layer >= SPIN_MIN_LAYER_WEIGHTS else SMALL_MODEL_SPIN_COUNT


def serve(args: EngineArgs, s: ServeSettings) -> None:
    """Load the engine and serve until SIGINT/SIGTERM. A ``ValueError`` or
    ``FileNotFoundError`` means the engine could not be built from ``args``."""
    import os
    import sys

    told = {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & os.environ.keys()
    if not told and "torch" not in sys.modules:  # libgomp reads it once, loaded with torch
        os.environ["GOMP_SPINCOUNT"] = spin_count(args.model)
    if s.threads is not None:
        import torch

        torch.set_num_threads(s.threads)
    from pdscope.server.run import serve as run_server

    run_server(
        args,
        host=s.host,
        port=s.port,
        served_model_name=s.served_model_name,
        api_key=s.api_key,
        max_queue=s.max_queue,
        allowed_origins=names(s.allowed_origins),
        allowed_hosts=names(s.allowed_hosts),
        max_request_bytes=s.max_request_body_bytes,
        shutdown_timeout_s=s.shutdown_timeout,
    )
