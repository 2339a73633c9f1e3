"""Each algorithm family learns (issue 11, deliverable 5): every example in examples/algorithms/ runs here and
its metric must move the right way by a margin a run that does not learn stays inside (docs/algorithms.md,
"Each family shown learning", gives the figures and the noise band).

One SFT warm-up (examples/algorithms/sft.yaml, an experiment file's own warm-up: deploy.runs.experiment_run.warm_up on
its train rows) is the SFT family's run and the start of all the others: each RL family is its experiment file run
from that checkpoint (`model.path=CHECKPOINT model.tiny=null sft.steps=0`, as `--set` gives them), and so is each
DPO example, on answer pairs made in code and written to JSONL. Distillation is tests/test_distill_e2e.py (marked
`families` too).
Run with `make test-families`; `make test` leaves these out.
"""

import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from family_kit import greedy_accuracy, greedy_image_accuracy, preference_pairs, read_jsonl, windows
from rich.console import Console

from deploy.experiment.schema import ExperimentConfig, load_experiment
from deploy.experiment.tasks import Task

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "algorithms"
RL_FAMILIES = ["ppo", "grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "rloo", "reinforce_pp",
               "reinforce_pp_baseline"]
# Mean training reward, last quarter of the steps minus the first quarter. A run that does not learn (lr 1e-12,
# 400 steps) moved it by -0.021; its steps' rewards shuffled give sd 0.013, 99.9th percentile 0.043. The
# families' examples rise by 0.10-0.16 (docs/algorithms.md).
REWARD_RISE = 0.05

pytestmark = [pytest.mark.families, pytest.mark.slow]  # slow: `make test-fast` leaves them out too


@dataclass
class SFTRun:
    config: ExperimentConfig
    checkpoint: Path
    train_tasks: list[Task]
    eval_tasks: list[Task]
    accuracy_before: float
    accuracy_after: float
    metrics: list[dict]


def _console() -> Console:
    return Console(file=io.StringIO(), width=120)


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory) -> SFTRun:
    """The SFT example's warm-up, once, as its experiment run does it: the tiny model built from the seed
    (experiment_run.base_model), then experiment_run.warm_up on the train rows of examples/algorithms/data/."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deploy.experiment import data as experiment_data
    from deploy.record.progress import Progress
    from deploy.runs.experiment_run import base_model, warm_up

    root = tmp_path_factory.mktemp("sft")
    config = load_experiment(EXAMPLES / "sft.yaml", [f"run_dir={root}"])
    init_dir = base_model(config, root, resume=False)
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    train_rows, eval_rows = experiment_data.split(config.data, tokenizer, config.seed)
    checkpoint = warm_up(config, init_dir, root, tokenizer, train_rows, Progress(root, _console()), resume=False)
    train_tasks, eval_tasks = ([Task(row.prompt_id, row.prompt, row.metadata["answer"]) for row in rows]
                               for rows in (train_rows, eval_rows))
    before, after = (greedy_accuracy(AutoModelForCausalLM.from_pretrained(folder), tokenizer, eval_tasks,
                                     config.training.max_tokens) for folder in (init_dir, checkpoint))
    return SFTRun(config, checkpoint, train_tasks, eval_tasks, before, after, read_jsonl(root / "sft_metrics.jsonl"))


def test_sft_lowers_loss_and_raises_accuracy(sft_run):
    first, last = windows(sft_run.metrics, "nll", fraction=0.05)
    report = (f"SFT nll {first:.3f} -> {last:.3f}, held-out accuracy {sft_run.accuracy_before:.3f} -> "
              f"{sft_run.accuracy_after:.3f} over {len(sft_run.metrics)} steps")
    print(report)
    assert len(sft_run.metrics) == sft_run.config.sft.steps
    assert last < 0.5 * first, report
    assert sft_run.accuracy_after >= sft_run.accuracy_before + 0.15, report


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", RL_FAMILIES)
def test_rl_family_raises_reward(family, sft_run, tmp_path):
    """The family's experiment file from the SFT checkpoint; its held-out metric is the mean exact-match reward of
    greedy completions, i.e. held-out accuracy."""
    from deploy.runs.experiment_run import run_experiment

    config = load_experiment(EXAMPLES / f"{family}.yaml", [f"run_dir={tmp_path / family}",
                                                           f"model.path={sft_run.checkpoint}", "model.tiny=null",
                                                           "sft.steps=0"])
    summary = run_experiment(config, console=_console())
    steps = read_jsonl(tmp_path / family / "trainer_metrics.jsonl")
    early, late = windows(steps, "reward_mean")
    report = (f"{family}: mean reward {early:.3f} -> {late:.3f} over {len(steps)} steps in {summary.rl_seconds:.0f} s; "
              f"held-out accuracy {summary.sft_accuracy:.3f} -> {summary.final_accuracy:.3f}")
    print(report)
    assert len(steps) >= 0.75 * config.training.max_steps, f"too few steps in the time budget: {report}"
    assert late >= early + REWARD_RISE, report


@pytest.mark.timeout(600)
def test_grpo_with_a_kl_term_learns_against_its_start_and_logs_the_kl(sft_run, tmp_path):
    """examples/algorithms/grpo_kl.yaml (kl_coef 0.04, no reference named) from the SFT checkpoint: the reference is that
    checkpoint, frozen; the trainer computes its logprobs itself. The training reward and the held-out accuracy rise by
    the families' margin, and every step records its KL (0 at the first: the policy starts as its reference). Before
    issue 41 the trainer died on its first batch ("needs reference logprobs") and the run took no step."""
    from deploy.runs.experiment_run import run_experiment

    run_dir = tmp_path / "grpo_kl"
    config = load_experiment(EXAMPLES / "grpo_kl.yaml", [f"run_dir={run_dir}", f"model.path={sft_run.checkpoint}",
                                                         "model.tiny=null", "sft.steps=0"])
    summary = run_experiment(config, console=_console())
    steps = read_jsonl(run_dir / "trainer_metrics.jsonl")
    early, late = windows(steps, "reward_mean")
    kl_early, kl_late = windows(steps, "kl")
    report = (f"grpo_kl: mean reward {early:.3f} -> {late:.3f}, kl {kl_early:.4f} -> {kl_late:.4f} over {len(steps)} "
              f"steps in {summary.rl_seconds:.0f} s; held-out accuracy {summary.sft_accuracy:.3f} -> "
              f"{summary.final_accuracy:.3f}")
    print(report)
    assert summary.failure is None and len(steps) >= 0.75 * config.training.max_steps, report
    assert all("kl" in step for step in steps) and steps[0]["kl"] < 1e-6 < kl_late, report
    assert late >= early + REWARD_RISE and summary.final_accuracy >= summary.sft_accuracy + REWARD_RISE, report


# GRPO's recorded held-out gain (docs/algorithms.md, "Each family shown learning": 0.505 -> 0.690).
GRPO_HELD_OUT_GAIN = 0.185


@pytest.mark.timeout(600)
def test_lora_quickstart_learns_most_of_what_grpo_does(sft_run, tmp_path):
    """examples/lora/quickstart_lora.yaml (rank-8 adapters on every linear layer, the base frozen, adapter-only
    publishes) from the SFT checkpoint, in GRPO's 400 steps: the held-out accuracy gains at least 0.8 of GRPO's
    recorded gain (issue 36's bar), the mean training reward rises, most versions send the adapter alone, and the
    export holds the PEFT adapter folder."""
    from deploy.runs.experiment_run import run_experiment

    run_dir = tmp_path / "lora"
    config = load_experiment(EXAMPLES.parent / "lora" / "quickstart_lora.yaml", [
        f"run_dir={run_dir}", f"model.path={sft_run.checkpoint}", "model.tiny=null", "sft.steps=0"])
    summary = run_experiment(config, console=_console())
    steps = read_jsonl(run_dir / "trainer_metrics.jsonl")
    early, late = windows(steps, "reward_mean")
    ratios = [step["publish_bytes_ratio"] for step in steps if "publish_bytes_ratio" in step]
    report = (f"lora: mean reward {early:.3f} -> {late:.3f} over {len(steps)} steps in {summary.rl_seconds:.0f} s; "
              f"held-out accuracy {summary.sft_accuracy:.3f} -> {summary.final_accuracy:.3f}; publish bytes vs whole "
              f"{sorted(ratios)[len(ratios) // 2] if ratios else float('nan'):.3f} (median)")
    print(report)
    # The issue's bar is the held-out gain; the training reward must rise, though by less than the families' margin
    # here (2026-12-07, 400 steps from the SFT checkpoint: reward 0.405 -> 0.442, held-out 0.505 -> 0.730).
    assert summary.failure is None and late > early, report
    assert summary.final_accuracy - summary.sft_accuracy >= 0.8 * GRPO_HELD_OUT_GAIN, report
    assert ratios and sorted(ratios)[len(ratios) // 2] < 0.2, report  # most versions: the adapter alone
    assert (run_dir / "export" / "adapter" / "adapter_config.json").exists(), report


@pytest.mark.timeout(600)
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_raises_preference_accuracy_and_margin(loss_type, sft_run, tmp_path):
    """The example experiment file from the SFT checkpoint on (correct, wrong) pairs of the training prompts, the
    wrong answer the SFT model's own greedy mistake (a near miss where it is right), written to JSONL here; the run
    measures such pairs of the held-out prompts. Held-out greedy accuracy is reported, not asserted: DPO lowers the
    chosen answers' likelihood too, and here greedy accuracy fell."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deploy.experiment.schema import load_experiment
    from deploy.runs.experiment_run import run_experiment

    tokenizer = AutoTokenizer.from_pretrained(sft_run.checkpoint)
    reference = AutoModelForCausalLM.from_pretrained(sft_run.checkpoint)
    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", f"model.path={sft_run.checkpoint}", "model.tiny=null", "sft.steps=0"]
    for split, tasks, seed in (("train", sft_run.train_tasks, 0), ("eval", sft_run.eval_tasks, 1)):
        _, pairs = preference_pairs(reference, tokenizer, tasks, seed=seed)
        path = tmp_path / f"pairs_{split}.jsonl"
        path.write_text("".join(json.dumps({"prompt_id": task.prompt_id, "prompt": task.prompt, "chosen": task.answer,
                                            "rejected": wrong}) + "\n" for task, wrong in pairs))
        overrides.append(f"data.{split}.path={path}")
    run_experiment(load_experiment(EXAMPLES / f"dpo_{loss_type}.yaml", overrides),
                   console=Console(file=io.StringIO(), width=120))

    steps = read_jsonl(run_dir / "trainer_metrics.jsonl")
    start, end = read_jsonl(run_dir / "metrics.jsonl")  # the held-out pairs before and after DPO
    held_accuracy, held_margin = end["reward_accuracy"], end["reward_margin"]
    prefer = start["preference_accuracy"], end["preference_accuracy"]
    train_accuracy, train_margin = windows(steps, "reward_accuracy"), windows(steps, "reward_margin")
    policy = AutoModelForCausalLM.from_pretrained(run_dir / "export")
    greedy = (greedy_accuracy(reference, tokenizer, sft_run.eval_tasks), greedy_accuracy(policy, tokenizer, sft_run.eval_tasks))
    report = (f"dpo {loss_type}: training reward accuracy {train_accuracy[0]:.3f} -> {train_accuracy[1]:.3f}, margin "
              f"{train_margin[0]:.3f} -> {train_margin[1]:.3f} over {len(steps)} steps; held-out pairs: reward accuracy "
              f"{start['reward_accuracy']:.3f} -> {held_accuracy:.3f}, margin {start['reward_margin']:.3f} -> "
              f"{held_margin:.3f}, the policy prefers the correct answer {prefer[0]:.3f} -> {prefer[1]:.3f}; held-out "
              f"greedy accuracy {greedy[0]:.3f} -> {greedy[1]:.3f}")
    print(report)
    # Without learning the policy is its reference: every margin 0, no pair counted right, preference unchanged.
    assert train_accuracy[1] >= train_accuracy[0] + 0.05 and train_margin[1] >= train_margin[0] + 0.05, report
    assert held_accuracy >= 0.7 and held_margin >= 0.1, report
    assert prefer[1] >= prefer[0] + 0.15, report


@dataclass
class DigitsRun:
    config: ExperimentConfig
    run_dir: Path
    summary: object  # deploy.record.run_state.Summary
    steps: list[dict]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> DigitsRun:
    """examples/multimodal/digits.yaml as a user runs it: its prepare.py writes the images and rows beside a copy of
    the file, then the whole run (the tiny Qwen2.5-VL built in code, the SFT warm-up, GRPO)."""
    from test_examples_byo import prepare

    from deploy.runs.experiment_run import run_experiment

    folder = tmp_path_factory.mktemp("digits")
    config = load_experiment(prepare("multimodal", folder, "digits.yaml"), [f"run_dir={folder / 'run'}"])
    summary = run_experiment(config, console=_console())
    return DigitsRun(config, folder / "run", summary, read_jsonl(folder / "run" / "trainer_metrics.jsonl"))


@pytest.mark.timeout(1200)
def test_the_digits_example_learns_to_read_the_image(digits_run):
    """Two digits drawn in an image, the prompt asks for their sum (the answer is only in the picture): GRPO from the
    SFT warm-up raises the held-out accuracy (other renderings, never trained on) by 0.15 within its 4 minutes."""
    summary, steps = digits_run.summary, digits_run.steps
    early, late = windows(steps, "reward_mean")
    report = (f"digits: mean reward {early:.3f} -> {late:.3f} over {len(steps)} steps in {summary.rl_seconds:.0f} s; "
              f"held-out accuracy {summary.sft_accuracy:.3f} -> {summary.final_accuracy:.3f}")
    print(report)
    assert summary.failure is None and summary.rl_seconds <= 240 + 30, report
    assert summary.final_accuracy >= summary.sft_accuracy + 0.15, report


@pytest.mark.timeout(1200)
def test_the_digits_model_given_a_blank_image_does_no_better_than_chance(digits_run):
    """The trained model's held-out accuracy with each image replaced by a blank one is at most chance (always the
    most frequent sum) + 0.05: what it answers comes from the picture, not the prompt's text."""
    from collections import Counter

    from PIL import Image
    from transformers import AutoTokenizer

    from deploy.experiment import data as experiment_data

    export = digits_run.run_dir / "export"
    _, held_out = experiment_data.split(digits_run.config.data, AutoTokenizer.from_pretrained(export),
                                            digits_run.config.seed)
    blank = io.BytesIO()
    Image.new("RGB", (56, 56)).save(blank, "PNG")
    answers = Counter(row.metadata["answer"] for row in held_out)
    chance = answers.most_common(1)[0][1] / len(held_out)
    with_images = greedy_image_accuracy(export, held_out)
    blind = greedy_image_accuracy(export, held_out, images=[blank.getvalue()] * len(held_out))
    report = f"digits: held-out accuracy {with_images:.3f} with the images, {blind:.3f} with blank ones; chance {chance:.3f}"
    print(report)
    assert blind <= chance + 0.05, report
    assert with_images >= chance + 0.15, report  # the same model reads the digits when it sees them
