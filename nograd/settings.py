"""Every nograd setting, in one validated class.

Settings are read once, when the app is built (never at import time), from the environment with the
``NOGRAD_`` prefix. A bad value fails at startup with a message naming the field and the value.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from nograd.core.engines import engine_choices

LogLevel = Literal["critical", "error", "warning", "info", "debug"]
LogFormat = Literal["json", "text"]
ModelControlMode = Literal["none", "explicit", "poll", "on_demand"]
OPERATOR_API_GROUPS: tuple[str, ...] = ("model-repository", "shared-memory", "trace", "logging")
"""The API groups that change the server, by Triton's names (``--http-restricted-api``); what
each holds: ``nograd.serving.calls.access``."""
MESSAGE_FRAMING_BYTES = 1024 * 1024
"""Room above the largest request body for a gRPC message's own framing."""
SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(value: object) -> object:
    """A byte count given as ``268435456`` or ``256MiB`` (KiB, MiB, GiB, TiB; case ignored)."""
    if not isinstance(value, str):
        return value
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = SIZE_UNITS.get(text[len(number) :])
    if unit is None or not number:
        raise ValueError(f"{value!r} is not a size: write bytes, or a number with KiB, MiB or GiB")
    return int(float(number) * unit)


ByteSize = Annotated[int, BeforeValidator(parse_size)]


class Settings(BaseSettings):
    """Server-wide settings. Per-model knobs live in each model's config file.

    The fields stand in the sections of ``SETTING_GROUPS``, in its order: ``nograd --help`` and
    docs/configuration.md show them so (``nograd.settings_reference``).
    """

    model_config = SettingsConfigDict(
        env_prefix="NOGRAD_",
        extra="ignore",
        use_attribute_docstrings=True,
        validate_default=True,
        cli_kebab_case=True,
    )

    # --- Network ---

    host: str = "0.0.0.0"
    """Address the HTTP server binds to."""

    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port of the HTTP server; 0 turns HTTP off (gRPC only)."""

    grpc_port: int = Field(default=8001, ge=0, le=65535)
    """TCP port of the gRPC server (the Open Inference Protocol's gRPC service, on the same
    address as HTTP); 0 turns gRPC off. With several workers the supervisor listens on it and
    hands each connection to a worker, as for HTTP."""

    server_name: str = Field(default="nograd", min_length=1, max_length=64)
    """The name server metadata reports (``GET /v2``, gRPC ``ServerMetadata``); ``triton`` for
    clients and scripts that check the server is Triton."""

    # --- Models and repository ---

    model_repository: Path = Path("models")
    """Folder holding one sub-folder per model (config file, code, weights)."""

    model_control: ModelControlMode = "none"
    """How the set of served models changes while serving: ``none`` (every model loads at
    start-up; load/unload calls are refused), ``explicit`` (load/unload calls; the start-up set
    is ``load_models``), ``poll`` (the repository is watched: new or changed models and
    versions load, removed ones unload) or ``on_demand`` (a model loads on its first request
    and the least recently used are evicted to stay within ``memory_limit_bytes``; load and
    unload calls work as with ``explicit``)."""

    load_models: str = ""
    """With ``model_control = explicit``: comma-separated models to load at start-up, ``*`` for
    every model; empty loads none. With ``on_demand``: the models always resident (loaded at
    start-up, never evicted), as a config's ``resident = "always"``."""

    repository_poll_s: float = Field(default=5.0, gt=0.0, le=3600.0)
    """With ``model_control = poll``: seconds between two looks at the repository."""

    max_loaded_models: int | None = Field(default=None, ge=1)
    """With ``model_control = explicit``: most model versions loaded at once (each version of a
    model counts, the start-up set included); a load call that would pass it is refused with
    400 naming the cap, before it reads a weight. Unset: no cap beyond the repository's
    versions."""

    model_uploads: bool = False
    """With ``model_control = explicit``: load calls may carry the model's files (Triton's
    ``file:`` load parameters, with its config as ``config``), served in place of the
    repository's folder of that name until a load without files or an unload. Off by default:
    an uploaded model is code the caller chose: off loopback the server refuses to start with
    it unless load calls need a key (``operator_api_keys``)."""

    max_uploads: int = Field(default=32, ge=1)
    """With ``model_uploads``: most uploaded models kept at once (an upload is kept while its
    model serves; a failed one is removed at once); a load call that would keep more is refused
    with 400 naming this setting, before its files are written."""

    max_upload_bytes: ByteSize = Field(default=1 << 30, ge=1024)
    """With ``model_uploads``: most bytes the uploaded models kept take on disk together (those
    being written or loaded count too); a load call whose files would pass it is refused with
    400 naming this setting, before they are written."""

    max_archive_bytes: ByteSize = Field(default=4 * 1024**3, ge=1024)
    """Largest total a TorchServe archive (``.mar``) may unpack to (when a version loads from
    it): its members' declared sizes are summed before anything is written, and the bytes are
    counted again while unpacking, so an archive that lies about its sizes (a zip bomb) is
    refused past this bound too. Raise it for an archive of larger weights."""

    max_archive_members: int = Field(default=10_000, ge=1)
    """Most files and folders a TorchServe archive may hold; more refuses the archive unread."""

    engine: str = ""
    """Replaces the ``engine`` of every python and TorchScript model's config when set (a Triton
    model's ``nograd_engine`` parameter included: docs/triton.md#engine-choice-opted-in):
    ``eager`` skips building and timing engines at start-up; ``auto``, or one engine of
    ``nograd.core.engines``; empty keeps each config's own. Like every setting a model's config
    also has, see ``nograd.serving.calls.precedence``."""

    engine_cache: Path | None = None
    """Folder of the engine artifacts built at load (ONNX models, exported programs, AOTInductor
    packages), the engine choices and the memory profiles measured at load, reused by every later
    start while the model's code and weights are unchanged; under ``model_control = on_demand``
    also the mapped form of each ONNX file (``mapped/``: its weights beside its graph, one form
    per file there is), which its sessions map instead of copying.
    Unset: ``$XDG_CACHE_HOME/nograd/engines``, or ``~/.cache/nograd/engines``."""

    warmup: bool = True
    """Run warmup forwards before a model reports ready."""

    # --- Models loaded on demand ---

    memory_limit_bytes: ByteSize | None = Field(default=None, gt=0)
    """With ``model_control = on_demand``: bytes the resident models and their batches may hold
    (each model as measured at its load; batches share what they leave; resident models make
    room for a load's passing peak too), all workers together (each worker keeps its own
    resident set within an equal part); ``256MiB`` style accepted. Unset: what the memory plan
    measures as usable (``memory_fraction`` of the device's free memory at start-up)."""

    warm_evicted_bytes: ByteSize = Field(default=512 << 20, ge=0)
    """With ``model_control = on_demand``: the files of the models each worker evicted last, up
    to this many bytes together, are kept in the page cache (the kernel is asked to read back
    what it dropped), so loading one again reads memory rather than the disk; ``0``: none."""

    eviction_grace_ms: float = Field(default=1000.0, ge=0.0, le=3_600_000.0)
    """Under ``model_control = on_demand``: a model asked for within this time (from its last
    request's arrival or answer) is not evicted to make room for another asked for no more often
    than it (requests counted with a half-life of a minute; a model loaded for one request keeps
    out no other). A load that only such models could make room for waits, within the room wait
    (``max_queue_wait_s``), for a grace to pass; then the least asked for of them goes (unless a
    model asked for less is in use: it goes first once answered, and past the wait the load is
    refused 503): as the wait ends for a load alone, after ten times that model's last load for
    one other loads queue behind. 0: the least asked for, however recently."""

    max_pending_loads: int = Field(default=8, ge=1, le=1024)
    """Under ``model_control = on_demand``: most loads of different models one worker keeps
    under way or waiting their turn (they run one at a time); a request needing one more gets
    503 with Retry-After the time the loads ahead are expected to take."""

    # --- Batching and memory ---

    max_batch_size: int = Field(default=32, ge=1, le=65536)
    """Largest batch (samples). Set, it replaces every model's own ``max_batch_size`` (logged
    per model at load); unset, 32 is the default for models whose config sets none."""

    max_queue_delay_ms: float = Field(default=2.0, ge=0.0, le=10_000.0)
    """Time a batch waits for more requests once the model is busy. Set, it replaces every
    model's own (logged per model at load); unset, 2 ms is the default for models without
    one."""

    max_queue_size: int = Field(default=1024, ge=1)
    """Bound on requests queued per model; beyond it requests get 503. Set, it replaces
    every model's own (logged per model at load); unset, 1024 is the default for models
    without one."""

    memory_fraction: float = Field(default=0.9, gt=0.0, le=1.0)
    """Share of the memory free after loading that batches may use, per device (split evenly
    among the workers)."""

    memory_budget_bytes: int | None = Field(default=None, gt=0)
    """Explicit per-device activation budget in bytes, for all workers together; overrides
    ``memory_fraction``."""

    # --- Workers and processes ---

    workers: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"
    """Server processes sharing the port, each with its own copy of every model (with ``fronts``
    0). More than one spreads the HTTP and Python work of small, fast models over several cores;
    memory budgets are split among them and /metrics adds their series up. ``auto`` (where
    ``fronts = auto`` plans no fronts, or with ``fronts`` 0): two when the process may use at
    least two CPU cores (two times ``torch_threads`` when that is set) and no GPU is visible,
    the second started only if another copy of the models (as the first one holds them once
    warm) fits in the memory left; one otherwise."""

    fronts: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = "auto"
    """HTTP front processes beside one engine process: the engine loads every model once, runs
    every batch and serves gRPC; the fronts hold the HTTP connections and forward each call to
    it without loading torch. 0: ``workers`` processes, each with every model. ``auto``: with
    ``workers`` unset and at least two usable CPU cores, one engine and fronts: half the cores
    (2 to 8) when a GPU is visible (one CUDA context, the whole device, fed from several cores),
    two without one; one process on one core. Set it with ``workers`` unset."""

    front_nice: int = Field(default=5, ge=0, le=19)
    """How much lower the fronts' CPU priority is than the engine's: the increment to its nice
    value each front takes as it starts. Where they share cores, the engine, through which every
    call passes, runs first and the fronts take what it leaves. 0: the same priority."""

    torch_threads: int | None = Field(default=None, ge=1)
    """Intra-op threads for CPU forwards, fixed, per worker; unset: the cores this process may
    use (affinity and cgroup CPU quota), shared among the workers batch by batch
    (``share_cores``) or divided among them."""

    share_cores: bool = True
    """With several workers and ``torch_threads`` unset: each CPU batch runs on every core the
    other workers' batches leave free (all of them when those are idle), never more in total.
    Off: a fixed share each, cores divided by workers. Always off with ``model_control =
    on_demand``, where an ONNX model would hold a session (its weights included) per width."""

    cpu_batches: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"
    """CPU batches one process runs at once, each on a device thread of its own and at the width
    the cores left free grant it (a lone batch every core, batches under load an equal share);
    models whose own code runs their batches (Triton's Python backend, TorchServe handlers) and
    sequence models still run one batch at a time each. ``auto``: in an engine process beside
    fronts with cores shared batch by batch (``share_cores``), as many as ``workers = auto``
    would start; 1 elsewhere (each worker runs one). More than 1 keeps one process when
    ``workers`` is unset and is refused with several workers."""

    loop_batch_ms: float = Field(default=1.0, ge=0, le=10)
    """A torch model's CPU batch expected (from its measured batches) to take at most this long
    runs on the event loop's own thread, at one intra-op thread, when none of the model's
    batches is on a device thread: a short forward then costs no hop to the device thread and
    back, nor a wait there for the interpreter lock the loop holds. The loop serves nothing else
    meanwhile, so this bounds how long it pauses; 0 runs every batch on a device thread, as does
    ``model_control = on_demand`` (its memory limit counts the device thread's allocations)."""

    drain_timeout_s: float = Field(default=30.0, ge=0)
    """On SIGTERM or a first Ctrl+C, how long accepted requests may take to finish before the
    process exits."""

    # --- Requests and admission ---

    request_timeout_s: float | None = Field(default=None, gt=0)
    """Default deadline of an inference request; one still queued when it passes gets 504. A
    request sets its own with the V2 ``timeout`` parameter (microseconds) or the
    ``X-Request-Timeout`` header (seconds)."""

    max_requests_in_flight: int = Field(default=256, ge=1)
    """Most inference requests one server process holds at once, from their headers to their
    answer (reading and decoding included); more get 503 with Retry-After at once."""

    max_queue_wait_s: float | None = Field(default=2.0, gt=0)
    """Shed by expected wait: a request the model is not expected to answer within this from
    its arrival (its head read; reading, decoding, tokenising and a busy event loop count), or
    whose batch is not expected to start within its own deadline, gets 503 with Retry-After at
    once instead of queueing. The expectation comes from the model's measured speed. Unset:
    only the deadline counts."""

    max_request_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Largest request body accepted; larger bodies get 413 before they are read whole."""

    max_decoded_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Most memory one request's inputs may take while they are decoded, estimated before any
    of them is: a JSON body by its size and the values it holds (each number or text becomes a
    Python object, then an array slot), binary tensor data by the tensors it declares (a BYTES
    element costs an object). Past it the request gets 422 naming this setting, before its JSON
    is parsed or its binary part read. Large tensors travel as binary tensor data, which costs
    about its own size."""

    max_body_bytes_in_flight: int = Field(default=256 * 1024 * 1024, ge=2048)
    """Most bytes one server process holds for request bodies at once (each worker its own),
    counted from a body's Content-Length (as it arrives, for a chunked body or a gRPC message)
    until its request is answered, together with what decoding them is estimated to take (see
    ``max_decoded_bytes``); a request past it gets 503 with Retry-After at once. The default
    holds about two requests at both limits, or thousands of ordinary ones; it must hold one
    request at both limits (``max_request_bytes + max_decoded_bytes``, and 1 MiB of gRPC
    framing)."""

    max_request_rows: int = Field(default=4096, ge=1)
    """Most rows (samples) one inference request may carry; more get 422."""

    max_text_bytes: int = Field(default=64 * 1024, ge=1)
    """Longest single text (BYTES element) accepted; longer ones get 422."""

    max_queued_responses: int = Field(default=64, ge=1)
    """Most responses of one request to a decoupled model waiting to be sent: the model's
    ``send`` waits while this many are queued, until one is sent or the call ends."""

    max_sequences: int = Field(default=1024, ge=1)
    """Most sequences under way at once per sequence model (Triton's ``sequence_batching``);
    a request starting one more gets 503 until one ends or is released idle."""

    max_sequence_id_bytes: int = Field(default=256, ge=1, le=65536)
    """Longest string sequence id (correlation id, UTF-8 bytes) a request may name; a longer
    one gets 400. Triton documents no bound; nograd keeps each id as long as its sequence lives."""

    # --- Connections ---

    max_connections: int = Field(default=1024, ge=1)
    """Most connections one server process (each worker of several) holds open on each of
    its HTTP and gRPC ports; one more is answered at once (HTTP: 503 with Retry-After; gRPC: a
    GOAWAY, UNAVAILABLE to the client) and closed, before its request is read. Real
    clients keep pools of tens of keep-alive connections; the cap bounds the file descriptors
    and memory that many idle or slow ones can take (the process's open-file limit is raised
    to fit when it can be)."""

    header_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    """Longest a request's head (request line and headers) may take to arrive, from its first
    byte (from the connection's opening, for its first request); past it the connection gets
    408 and is closed, so clients sending headers a byte at a time (slowloris) cannot hold
    connections. Idle keep-alive connections close after uvicorn's own keep-alive timeout."""

    body_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """Longest pause allowed between two pieces of a request body (the time nograd itself
    stops reading is not counted); past it the request gets 408 and the connection is closed,
    so a body trickled in cannot hold a connection and a request slot forever."""

    max_header_bytes: int = Field(default=32 * 1024, ge=1024)
    """Largest request head (request line and headers) accepted; a larger one gets 431 and the
    connection is closed. 32 KiB holds long bearer tokens and cookies with room to spare, twice
    what Node.js and h11 allow by default."""

    grpc_max_concurrent_streams: int = Field(default=256, ge=1, le=2**31 - 1)
    """Most streams (calls) one gRPC connection holds open at once, advertised to the client as
    HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS; a stream past it is refused (REFUSED_STREAM).
    Above ``grpc_max_health_calls``, so a connection whose streams are health calls (a proxy's,
    shared by many clients) keeps room for inference."""

    grpc_max_health_calls: int = Field(default=64, ge=1)
    """Most gRPC health calls (grpc.health.v1 ``Check`` and ``Watch``, ``ServerLive``,
    ``ServerReady``) one server process holds at once, from their headers to their end, apart
    from inference's room; one more is answered RESOURCE_EXHAUSTED at once."""

    grpc_max_health_watches: int = Field(default=32, ge=1)
    """Most grpc.health.v1 ``Watch`` streams one server process holds open (they last as long
    as the client wants); one more is answered RESOURCE_EXHAUSTED at once. Below
    ``grpc_max_health_calls``, so a flood of watches leaves room for ``Check`` probes. Raise it
    when many clients health-check this server by ``Watch`` (one stream per connection)."""

    grpc_max_unsent_stream_bytes: int = Field(default=4 * 1024 * 1024, ge=16 * 1024)
    """High-water mark of answer bytes one gRPC stream holds waiting for its client (its HTTP/2
    window, or the socket): past it the call waits before its next answer and a
    ``ModelStreamInfer`` stream takes no new request, until the client takes some."""

    grpc_max_unsent_connection_bytes: int = Field(default=64 * 1024 * 1024, ge=16 * 1024)
    """The same mark for all the streams of one gRPC connection together; past it every call
    on the connection waits, and a new call starts only once it is back under."""

    grpc_unsent_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """Longest a gRPC stream's unsent answers may stand still; past it the stream is reset
    (``ENHANCE_YOUR_CALM``) and what it held freed. A connection whose client reads nothing
    from the socket this long is closed."""

    # --- Keys and access ---

    api_keys: SecretStr | None = None
    """Comma-separated API keys; when set, inference, metadata and management routes need
    ``Authorization: Bearer <key>`` (or an operator key); they do not open the operator groups
    (``operator_apis``). Never logged."""

    operator_api_keys: SecretStr | None = None
    """Comma-separated operator keys: the only keys the operator API groups (``operator_apis``)
    take, and accepted wherever an API key is. With API keys set and no operator key, the
    operator groups are refused to every caller (403, PERMISSION_DENIED). Never logged."""

    operator_apis: str = ",".join(OPERATOR_API_GROUPS)
    """Comma-separated API groups that need an operator key, by Triton's names:
    ``model-repository`` (load, unload, uploads, repository index, TorchServe's management API),
    ``shared-memory`` (registering, unregistering and status of regions), ``trace`` and
    ``logging`` (their settings). Empty: API keys open every group, as before operator keys
    existed."""

    auth_health: bool = False
    """Also require an API key on health: HTTP's ``/v2/health/*``; gRPC's ``ServerLive``,
    ``ServerReady`` and grpc.health.v1."""

    auth_metrics: bool = False
    """Also require an API key on /metrics (and on the metrics port)."""

    # --- Shared memory ---

    shared_memory: bool = True
    """Serve Triton's shared-memory extensions (system and CUDA regions). Off: their routes and
    RPCs, and any input or output placed in shared memory, answer 501 / UNIMPLEMENTED, and the
    server's metadata no longer lists them. Turn it off where clients do not share this
    machine: a region is a file of the server's machine the client names."""

    max_shared_memory_regions: int = Field(default=256, ge=1, le=65536)
    """Most shared-memory regions (system and CUDA, every caller together) the server holds;
    one more gets 422 / RESOURCE_EXHAUSTED until one is unregistered. Each region holds one file
    descriptor (a system region) or device handle (a CUDA one) in every worker; the default
    covers a client registering an input and an output region for each of 100 models with
    room to spare, and the process's open-file limit is raised by as much, so regions never
    take the descriptors connections need."""

    shared_memory_key_prefix: str = Field(default="", max_length=255, pattern=r"^/?[^/\x00]*$")
    """The start every system region's object name must have (``/dev/shm/<prefix>…``; a
    leading ``/`` is ignored), so clients can register only objects made for the server
    (``nograd_`` for instance); empty: any object in /dev/shm the server may open. A key
    outside it gets the same answer as a missing object."""

    # --- Logs, metrics and traces ---

    log_level: LogLevel = "info"
    """Log level of nograd and uvicorn. Below ``debug`` the libraries' own INFO lines and
    warnings are held back; ``debug`` brings them back."""

    log_format: LogFormat | None = None
    """Log line format: one JSON object per line (for log shippers; a table, such as the
    start-up summary, one object per row), or plain text (tables aligned). Unset: text when
    stderr is a terminal, JSON otherwise."""

    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Serve /metrics on this separate port as well (e.g. one not exposed outside the pod)."""

    trace_mode: Literal["triton", "opentelemetry"] = "triton"
    """Where sampled request traces go (Triton's ``--trace-config`` mode): ``triton`` writes
    Triton's JSON trace file (``trace_file``), ``opentelemetry`` sends OTLP/HTTP spans to
    ``otlp_endpoint``. Fixed at start-up; the trace extension changes the rest."""

    trace_file: Path | None = None
    """Triton's trace file, for the ``triton`` mode (each worker of several adds ``.w<pid>``)."""

    trace_level: Literal["OFF", "TIMESTAMPS"] = "OFF"
    """Tracing at start-up: ``TIMESTAMPS`` records each sampled request's timestamps."""

    trace_rate: int = Field(default=1000, ge=1, le=2**32 - 1)
    """One request in this many is traced."""

    trace_count: int = Field(default=-1, ge=-1, le=2**31 - 1)
    """How many requests to trace before tracing stops (-1: no limit)."""

    trace_log_frequency: int = Field(default=0, ge=0, le=2**32 - 1)
    """Write the trace file every this many traces (``<trace_file>.<n>``); 0: when stopping."""

    trace_file_max_bytes: ByteSize = Field(default=16 << 20, ge=4096)
    """Most bytes of traces a trace file (and a worker's memory) holds: reached, they go to the
    next indexed file whatever the log frequency; past as many unwritten, traces are dropped."""

    trace_max_files: int = Field(default=16, ge=1, le=1_000_000)
    """Most indexed trace files (``<trace_file>.<n>``) kept per worker; one more removes the
    oldest, whatever log frequency a client sets."""

    otlp_endpoint: str = "http://localhost:4318/v1/traces"
    """The OTLP/HTTP collector's traces URL, for the ``opentelemetry`` trace mode."""

    otlp_export_delay_ms: float = Field(default=5000.0, gt=0, le=3_600_000)
    """Longest time a finished span waits before it is sent to the collector (spans go in
    batches)."""

    otlp_max_queue_size: int = Field(default=2048, ge=1, le=1_000_000)
    """Most finished spans held for the collector (Triton's ``bsp_max_queue_size``); past it,
    while the collector is down or slow, the oldest are dropped."""

    otlp_timeout_s: float = Field(default=5.0, gt=0, le=300)
    """Longest one export to the collector takes, its retries included; also how long the
    server's stop waits for the last spans."""

    @property
    def worker_count(self) -> int:
        """``workers`` as a number. ``auto`` is resolved by the ``nograd`` command before it
        starts any server; an app built in-process (tests, an ASGI server's factory) is one."""
        return self.workers if isinstance(self.workers, int) else 1

    @property
    def front_count(self) -> int:
        """``fronts`` as a number; ``auto`` is resolved by the ``nograd`` command (0 for an app
        built in-process)."""
        return self.fronts if isinstance(self.fronts, int) else 0

    @property
    def max_message_bytes(self) -> int:
        """Largest gRPC request message accepted: a body's limit and room for its framing."""
        return self.max_request_bytes + MESSAGE_FRAMING_BYTES

    @property
    def api_key_list(self) -> tuple[str, ...]:
        if self.api_keys is None:
            return ()
        return tuple(k.strip() for k in self.api_keys.get_secret_value().split(",") if k.strip())

    @property
    def operator_key_list(self) -> tuple[str, ...]:
        value = self.operator_api_keys.get_secret_value() if self.operator_api_keys else ""
        return tuple(k.strip() for k in value.split(",") if k.strip())

    @property
    def operator_api_groups(self) -> frozenset[str]:
        return frozenset(g.strip() for g in self.operator_apis.split(",") if g.strip())

    @property
    def metrics_keys(self) -> tuple[str, ...]:
        """The keys a scrape must carry, on /metrics and the metrics port: none unless
        ``auth_metrics``."""
        return self.api_key_list if self.auth_metrics else ()

    @property
    def load_model_names(self) -> frozenset[str] | None:
        """The models ``load_models`` names; None for every model (``*``)."""
        names = frozenset(n.strip() for n in self.load_models.split(",") if n.strip())
        return None if "*" in names else names

    @property
    def cores_shared(self) -> bool:
        """Whether workers share CPU cores batch by batch (``share_cores``): not with
        ``torch_threads`` set, nor under on-demand residency, where an ONNX model would hold a
        session, weights included, per width a batch may get, and memory limits how many fit."""
        return self.share_cores and self.torch_threads is None and self.model_control != "on_demand"

    @property
    def max_loop_batch_s(self) -> float:
        """``loop_batch_ms`` in seconds; 0 under on-demand residency, whose memory limit holds
        what the models' batches allocate on their device thread: on the loop's thread they
        would allocate from another heap arena, growing the process past what is counted."""
        return 0.0 if self.model_control == "on_demand" else self.loop_batch_ms / 1000.0

    @property
    def engine_cache_dir(self) -> Path:
        if self.engine_cache is not None:
            return self.engine_cache
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "nograd" / "engines"

    @field_validator("model_repository")
    @classmethod
    def _repository_is_folder(cls, value: Path) -> Path:
        if value.exists() and not value.is_dir():
            raise ValueError(f"model_repository {str(value)!r} is not a folder")
        return value

    @field_validator("engine")
    @classmethod
    def _engine_known(cls, value: str) -> str:
        if value and value not in engine_choices():
            choices = ", ".join(engine_choices())
            raise ValueError(f"engine {value!r} must be empty or one of {choices}")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _something_to_serve(self) -> Settings:
        if self.port == 0 and self.grpc_port == 0:
            raise ValueError("port and grpc_port are both 0: turn on HTTP or gRPC (or both)")
        return self

    @field_validator("operator_apis")
    @classmethod
    def _operator_apis_known(cls, value: str) -> str:
        for group in (g.strip() for g in value.split(",") if g.strip()):
            if group not in OPERATOR_API_GROUPS:
                known = ", ".join(OPERATOR_API_GROUPS)
                raise ValueError(f"unknown API group {group[:64]!r}; expected some of {known}")
        return value

    @model_validator(mode="after")
    def _budget_holds_one_request(self) -> Settings:
        """A request alone at both limits must fit the budget, or no retry could ever pass."""
        one = self.max_message_bytes + self.max_decoded_bytes
        if self.max_body_bytes_in_flight < one:
            raise ValueError(
                f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) must hold one "
                f"request at both limits: max_request_bytes + max_decoded_bytes + 1 MiB of "
                f"gRPC framing ({one})"
            )
        return self

    @model_validator(mode="after")
    def _health_leaves_room(self) -> Settings:
        """Health calls must leave room on every connection for inference, and watches room for
        health checks, or a flood of either takes what the other needs."""
        watches, health = self.grpc_max_health_watches, self.grpc_max_health_calls
        streams = self.grpc_max_concurrent_streams
        if not watches < health < streams:
            raise ValueError(
                f"grpc_max_health_watches ({watches}) < grpc_max_health_calls ({health}) < "
                f"grpc_max_concurrent_streams ({streams}) must hold: watches leave room for "
                "health checks, and health calls for inference on every connection"
            )
        return self


class SettingGroup(NamedTuple):
    """One section of the settings, as ``nograd --help`` and docs/configuration.md show it."""

    title: str
    about: str
    """What the section's settings decide, in a sentence; pages named as ``docs/<page>.md``."""
    fields: tuple[str, ...]


SETTING_GROUPS: tuple[SettingGroup, ...] = (
    SettingGroup(
        "Network",
        "Where the server listens, and the name it reports.",
        ("host", "port", "grpc_port", "server_name"),
    ),
    SettingGroup(
        "Models and repository",
        "What is served (docs/models.md), how the set changes while serving "
        "(docs/protocols.md#model-control-load-unload-hot-reload), and the engines the models run "
        "on (docs/engines.md).",
        (
            "model_repository",
            "model_control",
            "load_models",
            "repository_poll_s",
            "max_loaded_models",
            "model_uploads",
            "max_uploads",
            "max_upload_bytes",
            "max_archive_bytes",
            "max_archive_members",
            "engine",
            "engine_cache",
            "warmup",
        ),
    ),
    SettingGroup(
        "Models loaded on demand",
        "With ``model_control = on_demand``: the memory the resident models share, and what is "
        "evicted when (docs/residency.md).",
        ("memory_limit_bytes", "warm_evicted_bytes", "eviction_grace_ms", "max_pending_loads"),
    ),
    SettingGroup(
        "Batching and memory",
        "Server-wide batch limits, each replacing every model's own when set "
        "(docs/configuration.md#server-wide-settings-and-a-models-own), and the memory batches may "
        "use (docs/batching.md#batches-sized-to-fit-device-memory).",
        (
            "max_batch_size",
            "max_queue_delay_ms",
            "max_queue_size",
            "memory_fraction",
            "memory_budget_bytes",
        ),
    ),
    SettingGroup(
        "Workers and processes",
        "The server processes, the cores their forwards use, and the stop (docs/workers.md).",
        (
            "workers",
            "fronts",
            "front_nice",
            "torch_threads",
            "share_cores",
            "cpu_batches",
            "loop_batch_ms",
            "drain_timeout_s",
        ),
    ),
    SettingGroup(
        "Requests and admission",
        "What one request may carry, and when the server refuses one more at once "
        "(docs/reliability.md#what-a-client-can-make-the-server-hold).",
        (
            "request_timeout_s",
            "max_requests_in_flight",
            "max_queue_wait_s",
            "max_request_bytes",
            "max_decoded_bytes",
            "max_body_bytes_in_flight",
            "max_request_rows",
            "max_text_bytes",
            "max_queued_responses",
            "max_sequences",
            "max_sequence_id_bytes",
        ),
    ),
    SettingGroup(
        "Connections",
        "What a client's connections may hold, and how long they may stall, over HTTP and gRPC "
        "(docs/reliability.md#slow-clients-and-connection-limits).",
        (
            "max_connections",
            "header_timeout_s",
            "body_timeout_s",
            "max_header_bytes",
            "grpc_max_concurrent_streams",
            "grpc_max_health_calls",
            "grpc_max_health_watches",
            "grpc_max_unsent_stream_bytes",
            "grpc_max_unsent_connection_bytes",
            "grpc_unsent_timeout_s",
        ),
    ),
    SettingGroup(
        "Keys and access",
        "The bearer keys of the APIs and of the operator API groups "
        "(docs/protocols.md#operator-keys).",
        ("api_keys", "operator_api_keys", "operator_apis", "auth_health", "auth_metrics"),
    ),
    SettingGroup(
        "Shared memory",
        "Triton's shared-memory extensions (docs/reliability.md#shared-memory).",
        ("shared_memory", "max_shared_memory_regions", "shared_memory_key_prefix"),
    ),
    SettingGroup(
        "Logs, metrics and traces",
        "What the server logs (docs/deployment.md#logs) and exports (docs/metrics.md); the trace "
        "settings are the start-up values the trace extension changes at run time "
        "(docs/protocols.md#trace-and-logging-extensions).",
        (
            "log_level",
            "log_format",
            "metrics_port",
            "trace_mode",
            "trace_file",
            "trace_level",
            "trace_rate",
            "trace_count",
            "trace_log_frequency",
            "trace_file_max_bytes",
            "trace_max_files",
            "otlp_endpoint",
            "otlp_export_delay_ms",
            "otlp_max_queue_size",
            "otlp_timeout_s",
        ),
    ),
)
"""Every setting in exactly one section, in the order of the class body (a test holds both)."""
