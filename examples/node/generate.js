// Stream a completion from planserve's public gRPC API in Node.js:
//   npm install @grpc/grpc-js@1.14.7 @grpc/proto-loader@0.8.1
//   node generate.js [HOST:PORT] [PROTOS_DIR]   (PROTOS_DIR: the repository's protos/)
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const address = process.argv[2] || '127.0.0.1:50051';
const protos = process.argv[3] || path.join(__dirname, '../../protos');
const definition = protoLoader.loadSync('planserve/v1/generate.proto', {
  includeDirs: [protos], keepCase: true, longs: String, enums: String, defaults: true, oneofs: true,
});
const { GenerationService } = grpc.loadPackageDefinition(definition).planserve.v1;
const client = new GenerationService(address, grpc.credentials.createInsecure());

const call = client.Generate({
  text: 'The capital of France is',
  sampling: { temperature: 0 },
  stopping: { max_new_tokens: 32, stop: ['\n\n'] },
});
let last;
call.on('data', (chunk) => { process.stdout.write(chunk.text); last = chunk; });
call.on('error', (error) => { // e.g. INVALID_ARGUMENT naming the field and bound
  console.error(`${grpc.status[error.code]}: ${error.details}`);
  process.exitCode = 1;
});
call.on('end', () => {
  console.log(`\n[${last.finish_reason}, ${last.usage.completion_tokens} tokens, request ${last.request_id}]`);
  client.close();
});
