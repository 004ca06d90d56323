// A Strata client in another language: streams one greedy completion from the gateway with
// @grpc/grpc-js, loading the public generate.proto at run time (no generated code).
//
//   node generate_client.js ADDRESS PROTO_ROOT PROMPT MAX_TOKENS
//
// Prints one JSON line per streamed GenerateResponse; exits 2 with the gRPC status on error.
'use strict';
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [address, protoRoot, prompt, maxTokens] = process.argv.slice(2);
const definition = protoLoader.loadSync('strata/v1/generate.proto', {
  includeDirs: [protoRoot], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true,
});
const strata = grpc.loadPackageDefinition(definition).strata.v1;
const client = new strata.Gateway(address, grpc.credentials.createInsecure());

const request = {
  prompt,
  params: { temperature: 0, max_tokens: Number(maxTokens), ignore_eos: true, output_kind: 'DELTA' },
};
const call = client.Generate(request, { deadline: Date.now() + 120000 });
call.on('data', (response) => {
  console.log(JSON.stringify({
    finished: response.finished,
    outputs: response.outputs.map((o) => ({ index: o.index, text: o.text, token_ids: o.token_ids,
                                            finish_reason: o.finish_reason })),
    usage: response.usage,
  }));
});
call.on('error', (error) => {
  console.error(`gRPC error ${grpc.status[error.code]}: ${error.details}`);
  process.exit(2);
});
call.on('end', () => client.close());
