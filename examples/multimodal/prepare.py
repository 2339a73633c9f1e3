"""Write the digits example's data into a folder beside this file: images of two digits drawn with Pillow, and
rows asking for their sum (seeded; nothing downloaded).

    python examples/multimodal/prepare.py          # -> examples/multimodal/work/{images/, train.jsonl, eval.jsonl}
    relayrl run examples/multimodal/digits.yaml

Each row is {id, prompt, answer, image}: the prompt is the same text for every row ("sum:"), the answer the sum of
the two digits in the row's image ("7"), and the image a PNG path relative to the data file. The answer is only
in the picture: given a blank image, a model can do no better than the most frequent sum (`chance`).
Each image is 56 x 56 pixels (the tiny Qwen2.5-VL's smallest: 2 x 2 image tokens, one per 28 x 28 pixels), the left
digit in its left half and the right digit in its right half, white on black, each drawn at a small random offset
and grey level, so no two renderings of a pair are alike and the held-out images are never trained on.
"""

import argparse
import json
import pathlib
import random
from collections import Counter

DIGITS = range(5)  # 0..4: 25 pairs, sums 0..8 (one character each)
SIZE = 56  # pixels a side
PROMPT = "sum:"
JITTER = 1  # each digit drawn up to this many pixels off its cell's centre
GREY = 235  # and at a grey level from this to white


def draw(left: int, right: int, rng: random.Random):
    """A SIZE x SIZE RGB image of the two digits, each centred in its half, moved by up to JITTER pixels."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (SIZE, SIZE))
    pen = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=36)
    for column, digit in enumerate((left, right)):
        grey = rng.randint(GREY, 255)
        x = SIZE // 4 + column * SIZE // 2 + rng.randint(-JITTER, JITTER)
        y = SIZE // 2 + rng.randint(-JITTER, JITTER)
        pen.text((x, y), str(digit), fill=(grey, grey, grey), font=font, anchor="mm")
    return image


def blank():
    """The image with no digits (what the blank-image check feeds the trained model)."""
    from PIL import Image

    return Image.new("RGB", (SIZE, SIZE))


def rows(count: int, seed: int, folder: pathlib.Path, prefix: str) -> list[dict]:
    """`count` rows of random pairs, their images written as folder/images/<id>.png."""
    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    out = []
    for index in range(count):
        left, right = rng.choice(DIGITS), rng.choice(DIGITS)
        row_id = f"{prefix}{index}"
        draw(left, right, rng).save(folder / "images" / f"{row_id}.png")
        out.append({"id": row_id, "prompt": PROMPT, "answer": str(left + right), "image": f"images/{row_id}.png"})
    return out


def chance(answers: list[str]) -> float:
    """The accuracy of always giving the most frequent answer: the best a model blind to the image can do."""
    return Counter(answers).most_common(1)[0][1] / len(answers)


def write(folder: pathlib.Path, seed: int = 0, train: int = 4000, held_out: int = 200) -> pathlib.Path:
    """train.jsonl and eval.jsonl (other renderings, never trained on) with their images in `folder`."""
    for name, count, part_seed, prefix in (("train", train, seed, "t"), ("eval", held_out, seed + 1, "e")):
        part = rows(count, part_seed, folder, prefix)
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "work")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=4000, help="training rows")
    parser.add_argument("--eval", type=int, default=200, help="held-out rows")
    args = parser.parse_args()
    write(args.out, args.seed, args.train, args.eval)
    print(f"wrote {args.out}/images, train.jsonl ({args.train} rows), eval.jsonl ({args.eval} rows)")


if __name__ == "__main__":
    main()
