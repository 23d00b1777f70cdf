"""The HTTP side: KServe v2 routes on aiohttp, bearer-token check, errors as `{"error": ...}`.

Routes (all but /v2/health/* need the bearer token when the server has one):

    GET  /v2                                   server metadata
    GET  /v2/health/live | /v2/health/ready
    GET  /v2/models/{name}[/versions/{v}]      model metadata: inputs, outputs (name, datatype, shape)
    GET  /v2/models/{name}[/versions/{v}]/ready
    POST /v2/models/{name}[/versions/{v}]/infer
    POST /v2/repository/index
    POST /v2/repository/models/{name}/load | unload
    GET  /metrics                              Prometheus text format

An inference request is parsed and checked on the event loop, queued in the
scheduler, run on the compute pool (ctypes releases the GIL while a library
runs) and answered from the loop. A model name from a URL is only a key into
the configured models. Any error a handler did not expect becomes a 500 with
a fixed message; its traceback goes to the server's log, not to the client.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import threading
import time
import traceback

from aiohttp import web

from .. import __version__
from .protocol import RequestError, encode_infer_response, parse_infer_request
from .scheduler import Refused

EXTENSIONS = ["binary_tensor_data", "model_repository"]


def _error(status: int, message: str, headers=None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


class Dispatcher:
    """Runs scheduler jobs on the compute pool.

    A compute thread that finishes a job starts the next ones itself (under
    the scheduler's lock), without a round trip through the event loop, which
    is busy parsing requests under load; only the answer goes back to the loop.
    """

    def __init__(self, scheduler, executor, metrics, lower_executor=None):
        self.scheduler, self.executor, self.metrics = scheduler, executor, metrics
        # the jobs of the lower classes run on threads of their own when given (at a lower OS priority)
        self.lower_executor = lower_executor or executor
        self.lock = threading.Lock()  # guards the scheduler: the loop and the compute threads call it

    def precheck(self, model: str):
        """Raise Refused if a request of `model` arriving now would be refused (scheduler.precheck)."""
        with self.lock:
            self.scheduler.precheck(model, time.monotonic())

    async def run(self, model: str, fn):
        """Queue `fn` as a job of `model`; wait for its result (or Refused)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.lock:
            now = time.monotonic()
            job = self.scheduler.new_job(model, now, payload=(fn, loop, future))
            shed = self.scheduler.offer(job, now)  # raises Refused for the newcomer itself
            retry_after = self.scheduler.drain_time(now) if shed else 0
        for victim in shed:
            _, _, victim_future = victim.payload
            if not victim_future.done():
                victim_future.set_exception(Refused(f"model '{victim.model}': shed from the queue to make room "
                                                    f"for a more urgent request", 503, retry_after))
        self._pump()
        try:
            return await future
        except asyncio.CancelledError:
            with self.lock:
                self.scheduler.discard(job)  # still queued: nobody waits for it any more
            raise

    def _pump(self):
        with self.lock:
            now = time.monotonic()
            jobs = self.scheduler.dispatch(now)
        for job in jobs:
            self.metrics.queue_seconds.labels(job.model).observe(now - job.arrival)
            (self.executor if job.rank == 0 else self.lower_executor).submit(self._work, job)

    def _work(self, job):
        """On a compute thread: run the job, free its slots, start what comes next, then answer."""
        fn, loop, future = job.payload
        compute_s, work_s, outcome, failed = None, None, None, False
        try:
            outcome = fn()
            compute_s, work_s = outcome[2], outcome[3]
        except BaseException as error:  # noqa: BLE001  handed to the waiting request
            outcome, failed = error, True
        with self.lock:
            # a critical run is planned on its CPU time (its own slot, the event loop's cores spared
            # by the niced lower classes); the others' on the wall time they get at their priority
            self.scheduler.finish(job, work_s if job.rank == 0 else compute_s)
        if compute_s is not None:
            self.metrics.compute_seconds.labels(job.model).observe(compute_s)
            if time.monotonic() > job.deadline:
                self.metrics.deadline_misses.labels(job.model).inc()
        try:
            self._pump()
            loop.call_soon_threadsafe(_settle, future, outcome, failed)
        except RuntimeError:  # the server is stopping: its pool and loop are closed
            pass


def _settle(future, outcome, failed):
    if future.done():  # the client went away
        return
    if failed:
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def make_app(server, max_body_bytes: int) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_errors(server), _auth(server.token)])
    routes = Routes(server)
    model = "/v2/models/{name}"
    versioned = "/v2/models/{name}/versions/{version}"
    app.add_routes([
        web.get("/v2", routes.server_metadata),
        web.get("/v2/health/live", routes.live),
        web.get("/v2/health/ready", routes.ready),
        web.get(model, routes.model_metadata), web.get(versioned, routes.model_metadata),
        web.get(model + "/ready", routes.model_ready), web.get(versioned + "/ready", routes.model_ready),
        web.post(model + "/infer", routes.infer), web.post(versioned + "/infer", routes.infer),
        web.post("/v2/repository/index", routes.repository_index),
        web.post("/v2/repository/models/{name}/load", routes.load),
        web.post("/v2/repository/models/{name}/unload", routes.unload),
        web.get("/metrics", routes.metrics),
    ])
    return app


def _auth(token: str | None):
    @web.middleware
    async def check_token(request, handler):
        if token is not None and not request.path.startswith("/v2/health/"):
            given = request.headers.get("Authorization", "")
            scheme, _, value = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
                return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                              {"WWW-Authenticate": 'Bearer realm="cuvil"'})
        return await handler(request)
    return check_token


def _errors(server):
    @web.middleware
    async def as_v2_errors(request, handler):
        try:
            return await handler(request)
        except RequestError as error:
            return _error(error.status, error.message, error.headers)
        except Refused as error:
            return _error(error.status, str(error), {"Retry-After": str(int(math.ceil(error.retry_after)))})
        except web.HTTPException as error:  # aiohttp's own: 404 no route, 405, 413 body too large
            if error.status < 400:
                raise
            message = {404: f"no endpoint {request.method} {request.path}",
                       405: f"{request.method} is not allowed on {request.path}",
                       413: f"the request body is larger than the server's limit "
                            f"({server.max_body_bytes} bytes)"}.get(error.status, error.reason)
            return _error(error.status, message)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            server.say(f"internal error on {request.method} {request.path}: {type(error).__name__}: {error}\n"
                       + traceback.format_exc())
            return _error(500, "internal server error (the server's log has the details)")
    return as_v2_errors


class Routes:
    def __init__(self, server):
        self.server = server
        self.registry = server.registry

    async def server_metadata(self, request):
        return web.json_response({"name": "cuvil", "version": __version__, "extensions": EXTENSIONS})

    async def live(self, request):
        return web.json_response({"live": True})

    async def ready(self, request):
        ready = self.server.ready()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    def _version(self, request):
        """The entry and the version serving it; a version in the URL must be the one serving."""
        name = request.match_info["name"]
        entry = self.registry.entry(name)
        current = entry.current
        if current is None:
            raise RequestError(f"model '{name}' is not loaded ({entry.reason})", status=503)
        asked = request.match_info.get("version")
        if asked is not None and asked != current.version:
            raise RequestError(f"model '{name}' has no version {asked!r} loaded (serving: {current.version})",
                               status=404)
        return entry, current

    async def model_metadata(self, request):
        entry, current = self._version(request)
        return web.json_response({
            "name": entry.config.name, "versions": [current.version], "platform": "cuvil",
            "inputs": [t.as_dict() for t in current.signature.inputs],
            "outputs": [t.as_dict() for t in current.signature.outputs]})

    async def model_ready(self, request):
        entry = self.registry.entry(request.match_info["name"])
        asked = request.match_info.get("version")
        ready = entry.ready and asked in (None, entry.current.version)
        return web.json_response({"name": entry.config.name, "ready": ready}, status=200 if ready else 400)

    async def infer(self, request):
        start = time.monotonic()
        name = request.match_info["name"]
        entry = self.registry.entry(name)  # 404 before reading the body
        metrics = self.server.metrics
        metrics.requests.labels(name).inc()
        try:
            entry, current = self._version(request)
            self.server.dispatcher.precheck(name)  # under overload: refused before the body is read
        except Refused as error:
            metrics.failures.labels(name, "rejected" if error.status == 429 else "shed").inc()
            raise
        except RequestError as error:
            metrics.failures.labels(name, "unavailable" if error.status == 503 else "bad_request").inc()
            raise
        try:
            body = await request.read()
            parsed = parse_infer_request(body, request.headers.get("Inference-Header-Content-Length"),
                                         current.signature, name)
        except RequestError as error:
            metrics.failures.labels(name, "unavailable" if error.status == 503 else "bad_request").inc()
            raise
        except web.HTTPRequestEntityTooLarge:
            metrics.failures.labels(name, "bad_request").inc()
            raise
        marks = {"received": start, "parsed": time.monotonic()}

        def compute():
            marks["started"] = time.monotonic()
            try:
                return self.registry.run(name, parsed.feeds)
            finally:
                marks["computed"] = time.monotonic()
        try:
            version, outputs, *_ = await self.server.dispatcher.run(name, compute)
        except Refused as error:
            metrics.failures.labels(name, "rejected" if error.status == 429 else "shed").inc()
            raise
        except RequestError as error:
            metrics.failures.labels(name, "unavailable" if error.status == 503 else "bad_request").inc()
            raise
        except Exception:
            metrics.failures.labels(name, "error").inc()
            raise
        marks["resumed"] = time.monotonic()  # the event loop has the answer back
        body, headers = encode_infer_response(name, version, parsed, outputs, marks)
        metrics.request_seconds.labels(name).observe(time.monotonic() - start)
        return web.Response(body=body, headers=headers)

    async def repository_index(self, request):
        body = await request.read()
        only_ready = False
        if body.strip():
            try:
                options = json.loads(body)
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
                raise RequestError(f"repository index: the request body is not valid JSON ({error})") from None
            if not isinstance(options, dict) or not isinstance(options.get("ready", False), bool):
                raise RequestError("repository index: the body must be an object like {\"ready\": true}")
            only_ready = options.get("ready", False)
        models = []
        for name, entry in self.registry.entries.items():
            if only_ready and not entry.ready:
                continue
            item = {"name": name, "state": "READY" if entry.ready else "UNAVAILABLE"}
            if entry.ready:
                item["version"] = entry.current.version
            else:
                item["reason"] = entry.reason
            models.append(item)
        return web.json_response(models)

    async def load(self, request):
        name = request.match_info["name"]
        self.registry.entry(name)
        await request.read()  # a load request's body (config overrides) is not supported: ignored
        loop = asyncio.get_running_loop()
        outcome = await loop.run_in_executor(None, self.server.load_model, name)
        if outcome is not None:  # the reason it failed
            raise RequestError(outcome, status=400)
        return web.json_response({})

    async def unload(self, request):
        name = request.match_info["name"]
        self.registry.entry(name)
        self.registry.unload(name)
        self.server.metrics.ready.labels(name).set(0)
        self.server.say(f"[{name}] unloaded")
        return web.json_response({})

    async def metrics(self, request):
        return web.Response(body=self.server.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
