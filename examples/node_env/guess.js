'use strict';
/**
 * The game "guess a number" as an environment: reset() gives the rules, step(text) reads the model's
 * guess and answers "higher", "lower" or "correct". It knows nothing of tokens or gRPC.
 *
 * A reply with no number in range is not an error: it gets an observation saying so (and a small
 * penalty), and the episode goes on, as a real environment must treat malformed actions.
 */

const LOW = 1;
const HIGH = 100;
const MALFORMED_REWARD = -0.1;

/** A seeded PRNG (mulberry32) in [0, 1): the same --seed always hides the same number. */
function mulberry32(seed) {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** The first integer written in `text`, or null when there is none. */
function parseGuess(text) {
  const match = /-?\d+/.exec(text);
  return match ? Number(match[0]) : null;
}

class GuessNumber {
  constructor(seed, maxTurns) {
    this.secret = LOW + Math.floor(mulberry32(seed)() * (HIGH - LOW + 1));
    this.maxTurns = maxTurns;
  }

  /** The rules, the first observation of an episode. */
  reset() {
    this.turns = 0;
    this.solved = false;
    this.malformed = 0;
    this.guesses = [];
    return `I am thinking of a whole number from ${LOW} to ${HIGH}. Guess it: reply with one number. `
      + `After each guess I answer "higher", "lower" or "correct". You have ${this.maxTurns} guesses.`;
  }

  /** Score one reply: {observation, reward, done}; done once the number is found or the guesses run out. */
  step(text) {
    this.turns += 1;
    const guess = parseGuess(text);
    this.guesses.push(guess);
    let observation;
    let reward = 0;
    if (guess === null || guess < LOW || guess > HIGH) {
      this.malformed += 1;
      reward = MALFORMED_REWARD;
      observation = `I could not read a number from ${LOW} to ${HIGH} in your reply; reply with one number.`;
    } else if (guess === this.secret) {
      this.solved = true;
      reward = 1;
      observation = 'correct';
    } else {
      observation = guess < this.secret ? 'higher' : 'lower';
    }
    return { observation, reward, done: this.solved || this.turns >= this.maxTurns };
  }

  /** The episode's final reward: 1 when solved, less for each guess it took beyond the first. */
  finalReward() {
    return this.solved ? 1 - (this.turns - 1) / (2 * this.maxTurns) : 0;
  }
}

module.exports = { GuessNumber, parseGuess, LOW, HIGH };
