"""`cuvil serve`: the models of a cuvil.yaml behind the KServe v2 protocol, scheduled and hot-updated.

A layer over `cuvil.runtime` (load, swap, schedule), never inside the compiler:
builds run in a separate worker process through `project.build_project`.

    protocol.py   v2 tensors in and out (JSON and the binary data extension)
    scheduler.py  earliest deadline first over per-model queues; shedding under overload
    registry.py   loaded versions, content-addressed; atomic swap, unload when drained
    builder.py    the build worker; syntactic and semantic diff hashes
    updater.py    hot updates: watch, rebuild, swap
    metrics.py    Prometheus metrics
    app.py        the aiohttp routes
    server.py     `Server`: start-up, threads, shutdown
"""
from .server import Server

__all__ = ["Server"]
