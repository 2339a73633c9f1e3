"""Write the math word problem example's model and data into a folder beside this file (seeded; nothing downloaded).

    python examples/math_word/prepare.py            # -> examples/math_word/work/{model, train.jsonl, eval.jsonl}
    relayrl run examples/math_word/experiment.yaml

Each row is a templated word problem ("Ann has 7 pens and buys 5 more. How many pens does Ann have now?") with
its answer as a number ("12"), scored by the built-in `math_verify` reward (a final number is an answer it
parses). The model is a small randomly initialised Llama with a word-level tokenizer of the problems' words, so
a prompt is ~15 tokens and an answer one number token; it learns the sums from the SFT warm-up and GRPO.
"""

import argparse
import json
import pathlib
import random

NAMES = ["Ann", "Bob", "Cal", "Dee", "Eve", "Fay", "Gus", "Hal"]
THINGS = ["pens", "apples", "cards", "books", "coins", "shells"]
GAINS = ["buys {b} more", "finds {b} more", "gets {b} more"]  # a + b
LOSSES = ["gives away {b}", "loses {b}", "sells {b}"]  # a - b
QUESTION = "How many {thing} does {name} have now?"
MAX_NUMBER = 9  # operands 1..9; answers 0..18


def word_tokenizer():
    """One token per word, number and punctuation mark of the problems; decoded with spaces between tokens."""
    from rollout.model.tiny import word_tokenizer as tokenizer_over

    words = {word for text in [*GAINS, *LOSSES, QUESTION, "has and ."] for word in text.replace("?", " ?").split()}
    words = sorted(w for w in words if not w.startswith("{")) + NAMES + THINGS
    return tokenizer_over([*(str(n) for n in range(2 * MAX_NUMBER + 1)), *words])


def write_model(folder: pathlib.Path, seed: int) -> None:
    """A small randomly initialised Llama and its tokenizer, as a Hugging Face folder."""
    from rollout.model.tiny import write_llama

    write_llama(folder, word_tokenizer(), seed=seed)


def problems(seed: int) -> list[dict]:
    """Every problem once, in a seeded order: {id, question, answer}."""
    rows = []
    for a in range(1, MAX_NUMBER + 1):
        for b in range(1, MAX_NUMBER + 1):
            for name in NAMES:
                for thing in THINGS:
                    stories = [(g, a + b) for g in GAINS] + ([(l, a - b) for l in LOSSES] if b <= a else [])
                    for story, answer in stories:
                        text = f"{name} has {a} {thing} and {story.format(b=b)}. {QUESTION.format(thing=thing, name=name)}"
                        rows.append({"question": text, "answer": str(answer)})
    random.Random(seed).shuffle(rows)
    return [{"id": f"p{index}", **row} for index, row in enumerate(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "work")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=6000, help="training rows")
    parser.add_argument("--eval", type=int, default=128, help="held-out rows (other wordings of the same sums)")
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    write_model(args.out / "model", args.seed)
    rows = problems(args.seed)
    for name, part in [("eval", rows[:args.eval]), ("train", rows[args.eval:args.eval + args.train])]:
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))
    print(f"wrote {args.out}/model, train.jsonl ({min(args.train, len(rows) - args.eval)} rows), "
          f"eval.jsonl ({args.eval} rows)")


if __name__ == "__main__":
    main()
