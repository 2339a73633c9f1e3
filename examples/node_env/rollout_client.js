'use strict';
/**
 * A session client of relayrl.rollout.v1.Rollout, built at run time from the repository's protos/*.proto
 * (no generated code: the .proto files are the only contract an environment in another language needs).
 *
 * Unary calls return promises; GenerateInSession is an async iterable of GenerateChunk messages. A failed
 * call rejects with RpcError, which names the method, the status code and the server's message.
 */
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

/** The repository root: protos/rollout.proto imports "protos/common.proto" relative to it. */
const REPO_ROOT = path.resolve(__dirname, '..', '..');

const LOADER_OPTIONS = {
  includeDirs: [REPO_ROOT],
  keepCase: true, // field names as in the .proto (session_id, not sessionId)
  longs: Number, // uint64 lengths and seeds: token counts fit a double
  enums: String, // "DTYPE_INT32", "FINISH_REASON_STOP"
  defaults: true,
  oneofs: true, // proto3 `optional` fields (turn_reward, seed) are sent only when set, even when 0
};

class RpcError extends Error {
  constructor(method, error) {
    const name = grpc.status[error.code] ?? String(error.code);
    super(`${method} failed: ${name} (${error.code}): ${error.details || error.message}`);
    this.method = method;
    this.code = error.code;
    this.codeName = name;
  }
}

class RolloutSessions {
  /** A client of the rollout service at `address` (host:port, plaintext); calls time out after `timeoutS`. */
  constructor(address, timeoutS) {
    const definition = protoLoader.loadSync('protos/rollout.proto', LOADER_OPTIONS);
    const { Rollout } = grpc.loadPackageDefinition(definition).relayrl.rollout.v1;
    this.stub = new Rollout(address, grpc.credentials.createInsecure());
    this.timeoutS = timeoutS;
  }

  deadline() {
    return new Date(Date.now() + this.timeoutS * 1000);
  }

  unary(method, request) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, { deadline: this.deadline() }, (error, response) => {
        if (error) reject(new RpcError(method, error));
        else resolve(response);
      });
    });
  }

  openSession(request) {
    return this.unary('OpenSession', request);
  }

  appendToSession(request) {
    return this.unary('AppendToSession', request);
  }

  closeSession(request) {
    return this.unary('CloseSession', request);
  }

  /** The turn's GenerateChunk messages, in order, as the server streams them. */
  async *generateInSession(request) {
    const call = this.stub.GenerateInSession(request, { deadline: this.deadline() });
    try {
      for await (const chunk of call) yield chunk;
    } catch (error) {
      if (error.code === undefined) throw error;
      throw new RpcError('GenerateInSession', error);
    }
  }

  close() {
    this.stub.close();
  }
}

module.exports = { RolloutSessions, RpcError, status: grpc.status };
