// The public API from Node.js: @grpc/grpc-js with the .proto files loaded at run time by
// @grpc/proto-loader (no code generation). Runs against a live scheduler whose address is in
// PLANSERVE_ADDRESS; tests/e2e/test_node_client.py starts the servers and runs `node --test`.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { fileURLToPath } from 'node:url';
import path from 'node:path';

import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

const PROTOS = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../protos');
const ADDRESS = process.env.PLANSERVE_ADDRESS;

let client;

before(() => {
  assert.ok(ADDRESS, 'set PLANSERVE_ADDRESS=host:port of a running planserve scheduler');
  const definition = protoLoader.loadSync('planserve/v1/generate.proto', {
    includeDirs: [PROTOS],
    keepCase: true, // field names as in the .proto (request_id, not requestId)
    longs: String,
    enums: String, // finish_reason: 'FINISH_REASON_LENGTH'
    defaults: true,
    oneofs: true, // a oneof's set member is named in e.g. response.kind
  });
  const { GenerationService } = grpc.loadPackageDefinition(definition).planserve.v1;
  client = new GenerationService(ADDRESS, grpc.credentials.createInsecure());
});

after(() => client?.close());

// Greedy, a fixed number of tokens, no stop at end-of-sequence: the outcome is exact.
function greedyRequest(ids, maxNewTokens, requestId = '') {
  return {
    request_id: requestId,
    token_ids: { ids },
    sampling: { temperature: 0 },
    stopping: { max_new_tokens: maxNewTokens, ignore_eos: true },
  };
}

function collect(call) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    call.on('data', (chunk) => chunks.push(chunk));
    call.on('error', reject);
    call.on('end', () => resolve(chunks));
  });
}

test('Generate streams chunks and ends with the finish reason and usage', async () => {
  const chunks = await collect(client.Generate(greedyRequest([10, 11, 12, 13, 14, 15], 8)));
  assert.ok(chunks.length >= 1);
  const tokens = chunks.flatMap((c) => c.token_ids);
  assert.equal(tokens.length, 8);
  const last = chunks.at(-1);
  assert.equal(last.finish_reason, 'FINISH_REASON_LENGTH');
  assert.equal(last.usage.prompt_tokens, 6);
  assert.equal(last.usage.completion_tokens, 8);
  assert.ok(chunks.slice(0, -1).every((c) => c.finish_reason === 'FINISH_REASON_UNSPECIFIED'));
  assert.ok(chunks.every((c) => c.request_id === chunks[0].request_id && c.request_id !== ''));
  // Greedy decoding is deterministic: a second call gives the same tokens.
  const again = await collect(client.Generate(greedyRequest([10, 11, 12, 13, 14, 15], 8)));
  assert.deepEqual(again.flatMap((c) => c.token_ids), tokens);
});

test('Session multiplexes two requests and aborts one of them', async () => {
  const session = client.Session();
  const tokens = { short: [], long: [] };
  const order = [];
  const finals = {};
  const errors = [];
  let aborted = false;
  const done = new Promise((resolve, reject) => {
    session.on('data', (response) => {
      if (response.kind === 'error') {
        errors.push(response.error);
        return;
      }
      const chunk = response.chunk;
      order.push(chunk.request_id);
      tokens[chunk.request_id].push(...chunk.token_ids);
      if (chunk.request_id === 'long' && tokens.long.length >= 2 && !aborted) {
        aborted = true;
        session.write({ abort: { request_id: 'long' } });
      }
      if (chunk.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
        finals[chunk.request_id] = chunk.finish_reason;
        if (Object.keys(finals).length === 2) session.end(); // half-close: we are done
      }
    });
    session.on('error', reject);
    session.on('end', resolve);
  });
  session.write({ generate: greedyRequest([20, 21, 22, 23], 6, 'short') });
  session.write({ generate: greedyRequest([30, 31, 32, 33, 34], 400, 'long') });
  // A bad request on the same stream gets a per-request error; the stream goes on.
  session.write({ generate: greedyRequest([1, 2], 0, 'bad') });
  await done;

  assert.deepEqual(finals, { short: 'FINISH_REASON_LENGTH', long: 'FINISH_REASON_CANCELLED' });
  assert.equal(tokens.short.length, 6);
  assert.ok(tokens.long.length >= 2 && tokens.long.length < 400);
  // Interleaved on one stream: a chunk of `long` came before the last chunk of `short`.
  assert.ok(order.indexOf('long') < order.lastIndexOf('short'), `chunk order: ${order}`);
  assert.equal(errors.length, 1);
  assert.equal(errors[0].request_id, 'bad');
  assert.equal(errors[0].code, grpc.status.INVALID_ARGUMENT);
  assert.match(errors[0].message, /stopping\.max_new_tokens/);
});

test('a bad request ends Generate with INVALID_ARGUMENT naming the field', async () => {
  const error = await collect(client.Generate(greedyRequest([1, 2, 3], 0))).then(
    () => assert.fail('the call succeeded'),
    (e) => e,
  );
  assert.equal(error.code, grpc.status.INVALID_ARGUMENT);
  assert.match(error.details, /stopping\.max_new_tokens/);
});

test('Abort of an unknown request id is NOT_FOUND', async () => {
  const error = await new Promise((resolve) =>
    client.Abort({ request_id: 'no-such-request' }, (e) => resolve(e)),
  );
  assert.equal(error?.code, grpc.status.NOT_FOUND);
});
