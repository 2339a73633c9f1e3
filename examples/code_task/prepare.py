"""Write the code task example's model and data into a folder beside this file (seeded; nothing downloaded).

    python examples/code_task/prepare.py            # -> examples/code_task/work/{model, train.jsonl, eval.jsonl}
    relayrl run examples/code_task/experiment.yaml

Each row is a templated spec of a linear function ("Write f(x) that returns x times 3 plus 2.") with a reference
solution ("def f(x): return 3 * x + 2", the SFT target) and its own tests in the field `tests`
([{"call": "f(4)", "expected": 14}, ...]), which the experiment hands to the built-in sandboxed `code_exec`
reward as metadata (data.metadata_fields). The score is the fraction of tests the completion's code passes.
The model is a small randomly initialised Llama with a word-level tokenizer: "def f ( x ): return 3 * x + 2"
is 11 tokens, and decodes (a space between tokens) to valid Python.
"""

import argparse
import json
import pathlib
import random

NAMES = ["f", "g", "h"]
ARGS = ["x", "n"]
# (spec template, sign): {name}, {arg}, {a} (the coefficient, 2..9), {b} (the constant, 1..9)
SPECS = [
    ("Write {name}({arg}) that returns {arg} times {a} plus {b}.", "+"),
    ("Write {name}({arg}) that returns {a} times {arg} plus {b}.", "+"),
    ("Write {name}({arg}) that adds {b} to {a} times {arg}.", "+"),
    ("Write {name}({arg}) that returns {arg} times {a} minus {b}.", "-"),
    ("Write {name}({arg}) that returns {a} times {arg} minus {b}.", "-"),
    ("Write {name}({arg}) that takes {b} from {a} times {arg}.", "-"),
]
TEST_INPUTS = [0, 1, 4, -3]


def solution(name: str, arg: str, a: int, b: int, sign: str) -> str:
    return f"def {name}({arg}): return {a} * {arg} {sign} {b}"


def word_tokenizer():
    """One token per word, number and punctuation run of the specs and solutions; decoded with spaces between."""
    from tokenizers import pre_tokenizers

    from rollout.model.tiny import word_tokenizer as tokenizer_over

    pre = pre_tokenizers.Whitespace()  # \w+ and runs of punctuation: "f(x):" -> "f", "(", "x", "):"
    texts = [spec.format(name=n, arg=x, a=2, b=1) + " " + solution(n, x, 2, 1, sign)
             for spec, sign in SPECS for n in NAMES for x in ARGS]
    words = sorted({word for text in texts for word, _ in pre.pre_tokenize_str(text)} - {"1", "2"})
    return tokenizer_over([*map(str, range(10)), *words], pre)


def write_model(folder: pathlib.Path, seed: int) -> None:
    """A small randomly initialised Llama and its tokenizer, as a Hugging Face folder."""
    from rollout.model.tiny import write_llama

    write_llama(folder, word_tokenizer(), seed=seed)


def tasks(seed: int) -> list[dict]:
    """Every spec once, in a seeded order: {id, spec, solution, tests}."""
    rows = []
    for spec, sign in SPECS:
        for name in NAMES:
            for arg in ARGS:
                for a in range(2, 10):
                    for b in range(1, 10):
                        offset = b if sign == "+" else -b
                        rows.append({"spec": spec.format(name=name, arg=arg, a=a, b=b),
                                     "solution": solution(name, arg, a, b, sign),
                                     "tests": [{"call": f"{name}({x})", "expected": a * x + offset} for x in TEST_INPUTS]})
    random.Random(seed).shuffle(rows)
    return [{"id": f"t{index}", **row} for index, row in enumerate(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "work")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval", type=int, default=96, help="held-out specs (never trained on)")
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    write_model(args.out / "model", args.seed)
    rows = tasks(args.seed)
    for name, part in [("eval", rows[:args.eval]), ("train", rows[args.eval:])]:
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))
    print(f"wrote {args.out}/model, train.jsonl ({len(rows) - args.eval} rows), eval.jsonl ({args.eval} rows)")


if __name__ == "__main__":
    main()
