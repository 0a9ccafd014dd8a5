module example.com/planserve-go-example

go 1.22

require (
	google.golang.org/grpc v1.67.1
	google.golang.org/protobuf v1.35.1
)
