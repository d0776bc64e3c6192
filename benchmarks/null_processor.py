"""An ext_proc server that decides nothing: every message of Envoy's is answered at once
with what the endpoint picker would answer when nothing is to be changed (the request's
headers go on, its body goes on with a fixed pick, the response's headers go on). Behind the
picker's own Envoy bootstrap (the ``envoy-null`` peer of ``benchmarks.overhead``) it shows
what the ext_proc exchange costs Envoy itself, and what gRPC in Python costs a server,
whatever the server decides.

    python -m benchmarks.null_processor --port GRPC_PORT --endpoint HOST:PORT
"""

from __future__ import annotations

import argparse

import grpc
import uvloop

from gateway.epp import messages, wire
from gateway.epp.server import ext_proc_handler, grpc_server

SEEN = "x-null-processor"


def answers(endpoint: str) -> dict[str, wire.ProcessingResponse]:
    """The one answer to each kind of message, built once. (The response says it passed
    here: ``x-null-processor``.)"""
    return {"request_headers": wire.go_on(),
            "request_body": wire.pick_with_body([endpoint], None),
            "response_headers": wire.response_headers([(SEEN, "1")]),
            "response_body": wire.response_body(),
            "request_trailers": wire.ProcessingResponse(
                request_trailers=messages.TrailersResponse()),
            "response_trailers": wire.ProcessingResponse(
                response_trailers=messages.TrailersResponse())}


async def serve(port: int, endpoint: str) -> None:
    replies = answers(endpoint)

    async def process(_: object, context: grpc.aio.ServicerContext) -> None:
        while (message := await context.read()) is not grpc.aio.EOF:
            await context.write(replies[message.WhichOneof("request")])

    server = grpc_server()  # the picker's own server and service, without the picker
    server.add_generic_rpc_handlers((ext_proc_handler(process),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="gRPC port, on loopback")
    parser.add_argument("--endpoint", required=True, help="the replica, HOST:PORT")
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.endpoint))  # the picker's event loop too


if __name__ == "__main__":
    main()
