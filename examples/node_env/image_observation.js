#!/usr/bin/env node
'use strict';
/**
 * An environment that answers with a picture (a vision-language policy): open a session on a prompt, let the
 * policy take a turn, append an observation that holds an image (the PNG file given, sent as an ImagePart with
 * its bytes; the one <|image_pad|> token in the observation is expanded by the server), let the policy take
 * another turn, close the session, and print what the closed sample records: its images and token counts.
 *
 *   node image_observation.js HOST:PORT IMAGE.png PROMPT_IDS OBSERVATION_IDS
 *
 * PROMPT_IDS and OBSERVATION_IDS are comma-separated token ids (the observation's image placeholder among them).
 */
const fs = require('fs');
const { encodeArray, decodeArray } = require('./arrays');
const { RolloutSessions } = require('./rollout_client');

async function turn(client, sessionId) {
  const tokens = [];
  const params = { temperature: 0, max_tokens: 4, ignore_eos: true, logprobs: true };
  for await (const chunk of client.generateInSession({ session_id: sessionId, params, whole_turn: true })) {
    tokens.push(...decodeArray(chunk.token_ids, 'DTYPE_INT32'));
  }
  return tokens;
}

async function main([address, imagePath, promptIds, observationIds]) {
  const client = new RolloutSessions(address, 60);
  const ids = (text) => text.split(',').map(Number);
  try {
    const opened = await client.openSession({ prompt_ids: encodeArray(ids(promptIds), 'DTYPE_INT32') });
    const first = await turn(client, opened.session_id);
    const image = fs.readFileSync(imagePath);
    const appended = await client.appendToSession({
      session_id: opened.session_id, token_ids: encodeArray(ids(observationIds), 'DTYPE_INT32'),
      images: [{ data: image, media_type: 'image/png' }],
    });
    const second = await turn(client, opened.session_id);
    const closed = await client.closeSession({ session_id: opened.session_id });
    console.log(JSON.stringify({
      turns: [first, second],
      observation: decodeArray(appended.token_ids, 'DTYPE_INT32'),
      images: closed.sample.images.map((ref) => ({
        sha256: Buffer.from(ref.sha256).toString('hex'), media_type: ref.media_type,
        grid_thw: ref.grid_thw, num_tokens: ref.num_tokens, bytes: ref.data.length,
      })),
    }));
  } finally {
    client.close();
  }
}

main(process.argv.slice(2)).catch((error) => {
  console.error(error.message);
  process.exit(1);
});
