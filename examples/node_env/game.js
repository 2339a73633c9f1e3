'use strict';
/**
 * Play one episode of "guess a number" on a relayrl rollout service and print one JSON line.
 *
 *   node game.js --address 127.0.0.1:50051 --seed 3 [--max-turns 8] [--max-tokens 16]
 *                [--format messages|text] [--submit --group-id G --group-size N] [--trace]
 *   node game.js --address 127.0.0.1:50051 --close SESSION_ID
 *
 * The session: OpenSession with the rules, then per turn GenerateInSession (streamed) and
 * AppendToSession with the feedback and the turn's reward, then CloseSession with the final reward
 * (submitted to the server's replay buffer with --submit). A full context (OUT_OF_RANGE) ends the
 * episode early; any other gRPC error is printed to stderr and exits 1 (bad flags exit 2).
 */
const { parseArgs } = require('node:util');
const { decodeArray } = require('./arrays');
const { Episode } = require('./episode');
const { GuessNumber } = require('./guess');
const { RolloutSessions, RpcError, status } = require('./rollout_client');

const FLAGS = {
  address: { type: 'string' },
  seed: { type: 'string', default: '0' },
  'max-turns': { type: 'string', default: '8' },
  'max-tokens': { type: 'string', default: '16' },
  temperature: { type: 'string', default: '1' },
  format: { type: 'string', default: 'messages' },
  'session-id': { type: 'string', default: '' },
  submit: { type: 'boolean', default: false },
  'group-id': { type: 'string' },
  'group-size': { type: 'string', default: '0' },
  timeout: { type: 'string', default: '60' },
  close: { type: 'string' },
  trace: { type: 'boolean', default: false },
};

class UsageError extends Error {}

function number(values, name, { integer = true, min = 0 } = {}) {
  const value = Number(values[name]);
  if (!Number.isFinite(value) || (integer && !Number.isInteger(value)) || value < min) {
    const kind = integer ? 'an integer' : 'a number';
    throw new UsageError(`--${name}: expected ${kind} >= ${min}, got ${values[name]}`);
  }
  return value;
}

function parseOptions(argv) {
  let values;
  try {
    ({ values } = parseArgs({ args: argv, options: FLAGS, strict: true }));
  } catch (error) {
    throw new UsageError(error.message);
  }
  if (!values.address) throw new UsageError('--address host:port is required');
  if (!['messages', 'text'].includes(values.format)) {
    throw new UsageError(`--format: expected messages or text, got ${values.format}`);
  }
  const seed = number(values, 'seed');
  return {
    address: values.address,
    seed,
    maxTurns: number(values, 'max-turns', { min: 1 }),
    maxTokens: number(values, 'max-tokens', { min: 1 }),
    temperature: number(values, 'temperature', { integer: false }),
    format: values.format,
    sessionId: values['session-id'],
    submit: values.submit,
    groupId: values['group-id'] ?? `guess-seed-${seed}`,
    groupSize: number(values, 'group-size'),
    timeoutS: number(values, 'timeout', { integer: false, min: 0.001 }),
    close: values.close,
    trace: values.trace,
  };
}

/** OpenSession request: the rules as chat messages, or as plain text for a model without a chat template. */
function openRequest(opts, rules) {
  if (opts.format === 'messages') {
    const messages = [{ role: 'system', content: rules }, { role: 'user', content: 'Your guess?' }];
    return { session_id: opts.sessionId, messages };
  }
  return { session_id: opts.sessionId, prompt_text: `${rules}\nguess: `, add_bos: true };
}

/** The observation after a turn, in the session's format (text continues the plain-text transcript). */
function observationFields(opts, turn, observation) {
  if (opts.format === 'messages') return { messages: [{ role: 'user', content: observation }] };
  return { text: `${turn.text.endsWith('\n') ? '' : '\n'}${observation}\nguess: ` };
}

function samplingParams(opts, turnIndex) {
  return {
    temperature: opts.temperature,
    max_tokens: opts.maxTokens,
    seed: opts.seed * 1000 + turnIndex,
    logprobs: true,
    stop: opts.format === 'text' ? ['\n'] : [],
  };
}

/** Generate turns and append feedback until the game ends or the context is full; returns whether it was. */
async function playTurns(client, sessionId, env, episode, opts) {
  try {
    for (let done = false; !done;) {
      const chunks = [];
      for await (const chunk of client.generateInSession({
        session_id: sessionId, params: samplingParams(opts, episode.turns.length),
      })) chunks.push(chunk);
      const turn = episode.addTurn(chunks);
      const step = env.step(turn.text);
      done = step.done;
      const appended = await client.appendToSession({
        session_id: sessionId, turn_reward: step.reward, ...observationFields(opts, turn, step.observation),
      });
      episode.addObservation(decodeArray(appended.token_ids, 'DTYPE_INT32'));
    }
    return false;
  } catch (error) {
    if (error instanceof RpcError && error.code === status.OUT_OF_RANGE) return true;
    throw error;
  }
}

async function play(client, opts) {
  const env = new GuessNumber(opts.seed, opts.maxTurns);
  const opened = await client.openSession(openRequest(opts, env.reset()));
  const sessionId = opened.session_id;
  const episode = new Episode(decodeArray(opened.token_ids, 'DTYPE_INT32'));
  let truncated;
  let closed;
  try {
    truncated = await playTurns(client, sessionId, env, episode, opts);
    closed = await client.closeSession({
      session_id: sessionId,
      reward: env.finalReward(),
      submit: opts.submit,
      group_id: opts.groupId,
      group_size: opts.groupSize,
      prompt_id: opts.groupId,
      reward_details: { solved: env.solved ? 1 : 0, turns: env.turns, malformed: env.malformed },
    });
  } catch (error) {
    // Free the session's KV now rather than at its idle expiry (a refused submit leaves it open);
    // the first error is the one to report.
    await client.closeSession({ session_id: sessionId }).catch(() => {});
    throw error;
  }
  const { sample } = closed;
  const problems = episode.problemsWith(sample);
  const versions = decodeArray(sample.weight_versions, 'DTYPE_INT64');
  const result = {
    session_id: sessionId,
    secret: env.secret,
    solved: env.solved,
    turns: episode.turns.length,
    guesses: env.guesses,
    malformed: env.malformed,
    reward: sample.reward,
    truncated,
    prompt_tokens: episode.promptIds.length,
    response_tokens: decodeArray(sample.response_ids, 'DTYPE_INT32').length,
    policy_tokens: episode.policyTokens(),
    masked_tokens: episode.maskedTokens(),
    weight_versions: [...new Set(versions)].sort((a, b) => a - b),
    finish_reasons: episode.turns.map((turn) => turn.finishReason),
    sample_ok: problems.length === 0,
    sample_problems: problems,
    submitted: closed.submitted,
    stats: closed.stats,
  };
  if (opts.trace) Object.assign(result, trace(episode, sample));
  return result;
}

/** The episode as seen and the sample as returned, for a test or a human to compare. */
function trace(episode, sample) {
  return {
    episode: episode.turns.map((turn) => ({
      tokens: turn.tokens, logprobs: turn.logprobs, weight_versions: turn.versions,
      text: turn.text, observation: turn.observation,
    })),
    sample: {
      prompt_ids: decodeArray(sample.prompt_ids, 'DTYPE_INT32'),
      response_ids: decodeArray(sample.response_ids, 'DTYPE_INT32'),
      loss_mask: decodeArray(sample.loss_mask, 'DTYPE_UINT8'),
      rollout_logprobs: decodeArray(sample.rollout_logprobs, 'DTYPE_FLOAT32'),
      weight_versions: decodeArray(sample.weight_versions, 'DTYPE_INT64'),
      turn_rewards: decodeArray(sample.turn_rewards, 'DTYPE_FLOAT32'),
      status: sample.status,
      temperature: sample.temperature,
    },
  };
}

/** Close a session left open (e.g. by an environment that crashed) and report its trajectory's size. */
async function closeOnly(client, sessionId) {
  const { sample } = await client.closeSession({ session_id: sessionId });
  return {
    session_id: sessionId,
    closed: true,
    prompt_tokens: decodeArray(sample.prompt_ids, 'DTYPE_INT32').length,
    response_tokens: decodeArray(sample.response_ids, 'DTYPE_INT32').length,
  };
}

async function main() {
  let opts;
  try {
    opts = parseOptions(process.argv.slice(2));
  } catch (error) {
    if (!(error instanceof UsageError)) throw error;
    process.stderr.write(`game.js: ${error.message}\n`);
    return 2;
  }
  const client = new RolloutSessions(opts.address, opts.timeoutS);
  try {
    const result = opts.close === undefined ? await play(client, opts) : await closeOnly(client, opts.close);
    process.stdout.write(`${JSON.stringify(result)}\n`);
    return 0;
  } catch (error) {
    if (!(error instanceof RpcError)) throw error;
    process.stderr.write(`game.js: ${error.message}\n`);
    return 1;
  } finally {
    client.close();
  }
}

main().then((code) => { process.exitCode = code; });
