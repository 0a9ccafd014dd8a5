"""Stream a completion from planserve's public gRPC API: python generate.py [HOST:PORT]
(with the planserve package installed, or PYTHONPATH=protos for the stubs)."""
import asyncio
import sys

import grpc

from planserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc


async def main(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            text="The capital of France is",
            sampling=common_pb2.SamplingParams(temperature=0.0),
            stopping=generate_pb2.StoppingCriteria(max_new_tokens=32, stop=["\n\n"]))
        try:
            async for chunk in stub.Generate(request):
                print(chunk.text, end="", flush=True)
        except grpc.aio.AioRpcError as error:  # e.g. INVALID_ARGUMENT naming the field and bound
            sys.exit(f"{error.code().name}: {error.details()}")
        reason = generate_pb2.FinishReason.Name(chunk.finish_reason)
        print(f"\n[{reason}, {chunk.usage.completion_tokens} tokens, request {chunk.request_id}]")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"))
