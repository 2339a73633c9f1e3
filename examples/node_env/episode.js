'use strict';
/**
 * What the environment itself saw of a session, token by token: the initial context as the server
 * tokenized it, then per turn the streamed policy tokens (with logprobs and weight versions) and the
 * observation tokens AppendToSession reported. problemsWith(sample) checks the CloseSession sample
 * against it: "token in, token out" means the trajectory is exactly these tokens, nothing re-tokenized.
 */
const { decodeArray } = require('./arrays');

class Episode {
  constructor(promptIds) {
    this.promptIds = promptIds;
    this.turns = []; // {tokens, logprobs, versions, finishReason, text, observation}
  }

  /** Record one generated turn from its GenerateChunk messages. */
  addTurn(chunks) {
    const turn = { tokens: [], logprobs: [], versions: [], finishReason: null, text: '', observation: [] };
    for (const chunk of chunks) {
      turn.tokens.push(...decodeArray(chunk.token_ids, 'DTYPE_INT32'));
      turn.logprobs.push(...decodeArray(chunk.logprobs, 'DTYPE_FLOAT32'));
      turn.versions.push(...decodeArray(chunk.weight_versions, 'DTYPE_INT64'));
      turn.text += chunk.text;
      turn.finishReason = chunk.finish_reason;
    }
    this.turns.push(turn);
    return turn;
  }

  /** Record the observation tokens appended after the last turn. */
  addObservation(tokenIds) {
    this.turns[this.turns.length - 1].observation = tokenIds;
  }

  policyTokens() {
    return this.turns.reduce((n, turn) => n + turn.tokens.length, 0);
  }

  maskedTokens() {
    return this.turns.reduce((n, turn) => n + turn.observation.length, 0);
  }

  /** Where the returned sample differs from what was seen (empty: it is token-exact). */
  problemsWith(sample) {
    const problems = [];
    const expect = (name, got, want) => {
      if (got.length !== want.length || got.some((value, i) => value !== want[i])) {
        const at = got.findIndex((value, i) => value !== want[i]);
        problems.push(`${name}: ${got.length} values, expected ${want.length} (first difference at ${at})`);
      }
    };
    const response = [];
    const mask = [];
    const logprobs = [];
    for (const turn of this.turns) {
      response.push(...turn.tokens, ...turn.observation);
      mask.push(...turn.tokens.map(() => 1), ...turn.observation.map(() => 0));
      logprobs.push(...turn.logprobs, ...turn.observation.map(() => 0));
    }
    expect('prompt_ids', decodeArray(sample.prompt_ids, 'DTYPE_INT32'), this.promptIds);
    expect('response_ids', decodeArray(sample.response_ids, 'DTYPE_INT32'), response);
    expect('loss_mask', decodeArray(sample.loss_mask, 'DTYPE_UINT8'), mask);
    // Streamed and stored logprobs are the same float32 values, so they compare exactly.
    expect('rollout_logprobs', decodeArray(sample.rollout_logprobs, 'DTYPE_FLOAT32'), logprobs);
    const versions = decodeArray(sample.weight_versions, 'DTYPE_INT64');
    if (versions.length !== response.length) {
      problems.push(`weight_versions: ${versions.length} values for ${response.length} response tokens`);
    } else {
      let offset = 0;
      for (const turn of this.turns) {
        expect(`weight_versions of turn ${this.turns.indexOf(turn) + 1}`,
          versions.slice(offset, offset + turn.tokens.length), turn.versions);
        offset += turn.tokens.length + turn.observation.length;
      }
    }
    return problems;
  }
}

module.exports = { Episode };
