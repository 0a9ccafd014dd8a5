// Stream a completion from planserve's public gRPC API in Go. Generate the stubs first (see
// README.md in this folder), then: go run . [HOST:PORT]
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "example.com/planserve-go-example/planservev1"
)

func main() {
	address := "127.0.0.1:50051"
	if len(os.Args) > 1 {
		address = os.Args[1]
	}
	conn, err := grpc.NewClient(address, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	client := pb.NewGenerationServiceClient(conn)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel() // cancelling the call aborts the request on the server
	stream, err := client.Generate(ctx, &pb.GenerateRequest{
		Prompt:   &pb.GenerateRequest_Text{Text: "The capital of France is"},
		Sampling: &pb.SamplingParams{Temperature: proto.Float32(0)},
		Stopping: &pb.StoppingCriteria{MaxNewTokens: proto.Uint32(32), Stop: []string{"\n\n"}},
	})
	if err != nil {
		log.Fatal(err)
	}
	var last *pb.GenerateResponse
	for {
		chunk, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil { // e.g. INVALID_ARGUMENT naming the field and bound
			s := status.Convert(err)
			log.Fatalf("%s: %s", s.Code(), s.Message())
		}
		fmt.Print(chunk.GetText())
		last = chunk
	}
	fmt.Printf("\n[%s, %d tokens, request %s]\n", last.GetFinishReason(),
		last.GetUsage().GetCompletionTokens(), last.GetRequestId())
}
