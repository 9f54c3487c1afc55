"""Closed-loop load over gRPC: the digits workload's samples as ``ModelInfer`` calls.

The counterpart of wrk for nograd's gRPC port, so digits over gRPC and over HTTP can be compared
on the same server: ``--concurrency`` callers, each on a channel of its own (its own HTTP/2
connection, as each of wrk's callers has its own connection, so two workers sharing the port get
connections the way the kernel spreads wrk's; ``--connections`` lets fewer channels carry them),
each sending its next call as soon as the last one is answered, for ``--duration`` seconds.
Requests carry the same images as the HTTP bodies (``bench.workloads``), encoded as tritonclient
encodes them (``raw_input_contents``), and are serialised once before the clock starts; answers
are checked once, before it, and then only for their status, so the generator's own CPU per call
is the gRPC runtime's.

It runs in its own process (``python -m bench.grpcload``) and prints one line, ``GRPC_JSON
{...}``, with the fields of wrk's (``bench/wrk/post.lua``) plus its own CPU share: Python costs
more CPU per call than wrk, and on two cores that CPU is taken from the server, so the report
shows it beside the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from typing import Any

import grpc
import numpy as np
import orjson

from bench import workloads

METHOD = "/inference.GRPCInferenceService/ModelInfer"
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED


def requests(name: str, count: int = workloads.BODIES_PER_WORKLOAD) -> list[bytes]:
    """The workload's requests as serialised ``ModelInferRequest`` messages (digits only)."""
    from tritonclient.grpc import service_pb2

    if name != "digits":
        raise ValueError(f"the gRPC load drives digits only, not {name!r}")
    out = []
    for image in workloads.digits_images(count):
        request = service_pb2.ModelInferRequest(model_name="digits")
        request.inputs.add(name="image", datatype="FP32", shape=[1, 1, 8, 8])
        request.raw_input_contents.append(np.ascontiguousarray(image, dtype="<f4").tobytes())
        out.append(request.SerializeToString())
    return out


def check_answer(answer: bytes) -> None:
    """One answer decoded: nograd must return digits' three outputs, one row each."""
    from tritonclient.grpc import service_pb2

    response = service_pb2.ModelInferResponse.FromString(answer)
    names = sorted(output.name for output in response.outputs)
    if names != ["label", "logits", "probabilities"] or len(response.raw_output_contents) != 3:
        raise RuntimeError(f"unexpected ModelInfer answer: outputs {names}")


async def drive(
    address: str,
    bodies: list[bytes],
    concurrency: int,
    duration_s: float,
    timeout_s: float,
    connections: int | None = None,
) -> dict[str, Any]:
    # A local subchannel pool per channel: channels with the same target and options would
    # otherwise share one connection, and every call would reach the same worker.
    options = [("grpc.use_local_subchannel_pool", 1)]
    count = connections or concurrency
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(count)]
    # No serialiser: the bodies are sent as they are and answers come back as bytes.
    calls = [channel.unary_unary(METHOD) for channel in channels]
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = {"status": 0, "timeout": 0}
    try:
        for call in calls:  # connect every channel, and check one answer, before the clock
            check_answer(await call(bodies[0], timeout=timeout_s))
        cpu_before = _cpu_s()
        started = time.perf_counter()
        end = started + duration_s

        async def caller(index: int) -> None:
            call, mine = calls[index % count], latencies[index]
            position = index * 97 % len(bodies)  # callers start at different bodies, as in wrk
            while (sent := time.perf_counter()) < end:
                body = bodies[position]
                position = (position + 1) % len(bodies)
                try:
                    await call(body, timeout=timeout_s)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == _DEADLINE:
                        errors["timeout"] += 1
                        continue  # no answer: not a request, as a wrk timeout is not one
                    errors["status"] += 1
                mine.append(time.perf_counter() - sent)

        await asyncio.gather(*(caller(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
        cpu_share = (_cpu_s() - cpu_before) / elapsed
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))
    done = np.concatenate([np.asarray(x, dtype=np.float64) for x in latencies]) * 1e6

    def pct(q: float) -> float | None:
        return float(np.percentile(done, q)) if done.size else None

    return {
        "requests": int(done.size),
        "duration_us": int(elapsed * 1e6),
        "errors_status": errors["status"],
        "errors_timeout": errors["timeout"],
        "latency_mean_us": float(done.mean()) if done.size else None,
        "latency_max_us": float(done.max()) if done.size else None,
        "p50_us": pct(50),
        "p90_us": pct(90),
        "p99_us": pct(99),
        "p999_us": pct(99.9),
        "connections": count,
        # The process's CPU (every thread: gRPC's own included) over the measured time.
        "generator_cpu_share": cpu_share,
    }


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True, help="host:port of the gRPC server")
    parser.add_argument("--workload", default="digits")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument(
        "--connections", type=int, default=None, help="channels (default: one per caller)"
    )
    args = parser.parse_args(argv)

    bodies = requests(args.workload)
    result = asyncio.run(
        drive(
            args.address,
            bodies,
            args.concurrency,
            args.duration,
            args.timeout,
            connections=args.connections,
        )
    )
    sys.stdout.write("GRPC_JSON " + orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    main()
