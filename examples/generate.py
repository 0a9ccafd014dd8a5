"""Stream one chat completion from a running planserve (`make serve` or `planserve serve`)."""
import asyncio

import grpc

from planserve.v1 import generate_pb2, generate_pb2_grpc


async def main() -> None:
    async with grpc.aio.insecure_channel("127.0.0.1:50051") as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            messages=generate_pb2.ChatMessages(messages=[
                generate_pb2.ChatMessage(role="user", content="Name three colours.")]),
            sampling={"temperature": 0.0}, stopping={"max_new_tokens": 64})
        async for chunk in stub.Generate(request):
            print(chunk.text, end="", flush=True)
        print("\n", generate_pb2.FinishReason.Name(chunk.finish_reason), chunk.usage)


if __name__ == "__main__":
    asyncio.run(main())
