"""`relayrl doctor EXPERIMENT.yaml`: what would stop a run, found before it starts, each with its fix.

Checks the config, the model folder (config, weights, tokenizer; the tokenizer fits the embedding), that the
trainer, the rollout and distillation's teachers share one tokenizer and vocabulary, the chat template when asked
for, the data's fields (and images, deploy/inspect/doctor_images.py), the reward (importable, its arguments fit; a judge answers) or with `env` the environment
(its tasks, the policy's turn), fixed ports, disk space for the buffer and checkpoints, and the versions of torch /
transformers / vllm. A sweep file is checked as a sweep, and any other YAML file named (deploy/inspect/doctor_files.py).
Exit 1 on any error, 0 otherwise (warnings included).
"""

import importlib
import pathlib
import shutil
import socket
import sys
from dataclasses import dataclass
from importlib import metadata

from deploy.experiment.forms import OFFLINE, teacher_folders
from deploy.experiment.schema import ExperimentConfig
from deploy.inspect.doctor_files import not_an_experiment, prepared_by
from deploy.inspect.doctor_images import check_images
from deploy.inspect.findings import Finding, report
from deploy.inspect.vocabulary import beyond_embedding

# ---------------------------------------------------------------- the model and its tokenizer


@dataclass
class ModelFacts:
    vocab_size: int  # rows of the embedding (config.vocab_size)
    tokenizer_size: int  # len(tokenizer), added tokens included
    vocab: dict[str, int]
    special: dict[str, str | None]
    chat_template: str | None
    weight_bytes: int


def _model_facts(path: pathlib.Path, role: str, findings: list[Finding], made_by: str | None = None) -> ModelFacts | None:
    """The facts of the model folder at `path`; `made_by`: the command that makes it, named when it is missing."""
    from transformers import AutoConfig, AutoTokenizer

    check = f"model ({role})"
    if not path.is_dir():
        findings.append(Finding("error", check, f"{path} is not a folder", f"make it: {made_by}" if made_by else
                                "point model.path at a Hugging Face folder (config.json, *.safetensors, tokenizer "
                                "files)"))
        return None
    if not (path / "config.json").exists():
        findings.append(Finding("error", check, f"{path} has no config.json", "save the model with "
                                "model.save_pretrained(folder)"))
        return None
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        findings.append(Finding("error", check, f"{path} has no *.safetensors weights", "save with "
                                "model.save_pretrained(folder, safe_serialization=True)"))
        return None
    try:
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        findings.append(Finding("error", check, f"{path} does not load with transformers: {exc}",
                                "save the model and tokenizer with save_pretrained (transformers "
                                f"{metadata.version('transformers')} must know its model_type)"))
        return None
    facts = ModelFacts(
        vocab_size=int(config.get_text_config().vocab_size), tokenizer_size=len(tokenizer), vocab=tokenizer.get_vocab(),
        special={name: getattr(tokenizer, name) for name in ("bos_token", "eos_token", "pad_token")},
        chat_template=tokenizer.chat_template, weight_bytes=sum(w.stat().st_size for w in weights))
    if facts.tokenizer_size > facts.vocab_size:
        beyond, fix = beyond_embedding(tokenizer, path, facts.vocab_size)
        findings.append(Finding("error", check, f"the tokenizer has {facts.tokenizer_size} tokens but the model's "
                                f"embedding has {facts.vocab_size} rows: token ids past it cannot be embedded "
                                f"({beyond})", fix))
        return facts
    if tokenizer.eos_token_id is None:
        findings.append(Finding("warn", check, "the tokenizer has no eos token: completions end only at max_tokens",
                                "set tokenizer.eos_token and save the tokenizer again"))
    findings.append(Finding("ok", check, f"{path.name}: {config.model_type}, vocabulary {facts.tokenizer_size} of "
                            f"{facts.vocab_size} embedding rows, {facts.weight_bytes / 1e6:.1f} MB of weights"))
    return facts


def check_models(config: ExperimentConfig, findings: list[Finding], maker=lambda path: None) -> ModelFacts | None:
    """The trainer's model, and each folder that must share its tokenizer: the rollout's copy, distillation's
    teachers. Returns the trainer's facts. `maker(path)`: the command that makes a missing model.path, or None."""
    if config.model.tiny is not None:  # built in code at the run's start: build it here too, and check that
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            trainer = _model_facts(config.model.tiny.write(pathlib.Path(folder) / "model-init", config.seed), "tiny",
                                   findings)
    else:
        trainer = _model_facts(pathlib.Path(config.model.path), "trainer", findings, maker(config.model.path))
    fix = "give model.rollout_path a copy of the same model and tokenizer as model.path (or drop rollout_path)"
    others = [("rollout", config.model.rollout_path, None, fix)] if config.model.rollout_path else []
    others += [(name, teacher.path, teacher.made_by, f"give {name}.path a model with the student's tokenizer")
               for name, teacher in teacher_folders(config)]
    if config.reference is not None:  # the KL reference scores the policy's tokens: the same ids must mean the same
        others.append(("reference", config.reference.path, config.reference.made_by,
                       "give reference.path a model with the policy's tokenizer (or drop it: the start is the reference)"))
    for role, path, made_by, fix in others:
        other = _model_facts(pathlib.Path(path), role, findings, made_by)
        if trainer is not None and other is not None:
            _same_tokenizer(trainer, other, role, fix, findings)
    return trainer


def _same_tokenizer(trainer: ModelFacts, other: ModelFacts, role: str, fix: str, findings: list[Finding]) -> None:
    differences = []
    if trainer.vocab != other.vocab:
        only_trainer = len(trainer.vocab.keys() - other.vocab.keys())
        only_other = len(other.vocab.keys() - trainer.vocab.keys())
        moved = sum(trainer.vocab[t] != other.vocab[t] for t in trainer.vocab.keys() & other.vocab.keys())
        differences.append(f"vocabularies differ ({only_trainer} tokens only in the trainer's, {only_other} only "
                           f"in the {role}'s, {moved} with other ids)")
    if trainer.vocab_size != other.vocab_size:
        differences.append(f"embedding rows {trainer.vocab_size} (trainer) vs {other.vocab_size} ({role})")
    if trainer.special != other.special:
        differences.append(f"special tokens {trainer.special} (trainer) vs {other.special} ({role})")
    check = f"tokenizer (trainer vs {role})"
    if differences:
        findings.append(Finding("error", check, "; ".join(differences) + f": the {role}'s token ids would mean other "
                                "tokens to the trainer", fix))
    else:
        findings.append(Finding("ok", check, "same vocabulary and special tokens"))


# ---------------------------------------------------------------- data, reward, ports, disk, versions


def check_data(config: ExperimentConfig, facts: ModelFacts | None, findings: list[Finding], maker=lambda path: None) -> int:
    """The rows and fields of each source; returns the number of train rows (0 when unreadable)."""
    from deploy.experiment.data import DataError, missing_fields, read_rows

    data = config.data
    if data.chat_template and facts is not None and not facts.chat_template:
        findings.append(Finding("error", "chat template", "data.chat_template is on but the tokenizer has none",
                                "set data.chat_template: false, or add a template (tokenizer.chat_template = ...; "
                                "tokenizer.save_pretrained(model folder))"))
    train_rows = 0
    for name, source in (("train", data.train), ("eval", data.eval)):
        if source is None:
            continue
        check = f"data ({name})"
        try:
            rows = read_rows(source)
        except DataError as exc:
            findings.append(Finding("error", check, str(exc), f"make it: {maker(source.path)}" if maker(source.path)
                                    else ""))
            continue
        if not rows:
            findings.append(Finding("error", check, f"{source.path} holds no rows", "write the prompts there"))
            continue
        missing = missing_fields(rows, data)
        for field_name, count in missing.items():
            findings.append(Finding("error", check, f"{count} of {len(rows)} rows have no field {field_name!r} "
                                    f"(the first row has {sorted(rows[0])})",
                                    "name the right field in data.prompt_field / answer_field / id_field / "
                                    "metadata_fields / chosen_field / rejected_field, or add it to the data"))
        if name == "train":
            train_rows = len(rows)
        if not missing:
            findings.append(Finding("ok", check, f"{len(rows)} rows with every named field{_use(data, name, len(rows))}"))
    held_out = data.eval_count(train_rows)
    if data.eval is None and train_rows and train_rows <= held_out:
        findings.append(Finding("error", "data (eval)", f"data.num_eval={held_out} would hold out all "
                                f"{train_rows} train rows", "lower data.num_eval or give data.eval"))
    return train_rows


def _use(data, name: str, rows: int) -> str:
    """What the run makes of a source's `rows`: how many it evaluates on and trains on."""
    count = data.eval_count(rows)
    if name == "eval":
        return (f"; all {rows} evaluated" if count == rows else
                f"; only the first {count} evaluated (data.num_eval={data.num_eval}; unset it to use all {rows})")
    if data.eval is None:
        return f"; {count} held out for evaluation (data.num_eval), {max(rows - count, 0)} trained on"
    return ""


def check_stop(config: ExperimentConfig, findings: list[Finding]) -> None:
    """What ends RL: the time budget, and training.max_steps when set (a small model can make 1,000 steps a minute)."""
    training, phase = config.training, "DPO" if config.algorithm.name in OFFLINE else "RL"
    if training.max_steps is None:
        findings.append(Finding("ok", "training", f"{phase} ends when its time budget of {training.time_budget_s:g}s is "
                                "spent (training.max_steps unset)"))
    else:
        findings.append(Finding("ok", "training", f"{phase} ends after {training.time_budget_s:g}s or at optimizer step "
                                f"{training.max_steps}, whichever comes first (unset training.max_steps to let the "
                                "budget alone end it)"))


def check_lora(config: ExperimentConfig, findings: list[Finding]) -> None:
    """A LoRA policy served unmerged by the native engine keeps engine.lora.versions_resident adapter versions: at
    least training.max_staleness + 1, or a rollout may outlive the version it started on (docs/lora.md)."""
    from deploy.experiment.trainer_fit import nested

    engine = nested(config.services.rollout.settings).get("engine", {})
    if config.model.lora is None or engine.get("type", "native") != "native":
        return
    lora = engine.get("lora", {})
    mode, resident = lora.get("mode", "unmerged"), int(lora.get("versions_resident", 2))
    needed = config.training.max_staleness + 1
    if mode == "merged":
        findings.append(Finding("ok", "lora", "the rollout merges each adapter version into its weights (engine.lora."
                                "mode merged): one version served, rollouts in flight go on under each new one"))
    elif resident < needed:
        findings.append(Finding("warn", "lora", f"engine.lora.versions_resident = {resident} < training.max_staleness "
                                f"+ 1 = {needed}: a rollout that started on a version the engine has dropped goes on "
                                "under the newest adapter (its tokens say so), not the policy it started with",
                                f"set services.rollout.settings: {{engine.lora.versions_resident: {needed}}}"))
    else:
        findings.append(Finding("ok", "lora", f"the rollout serves adapters unmerged with {resident} versions "
                                f"resident (>= training.max_staleness + 1 = {needed}): every rollout finishes on the "
                                "version it started on"))


def check_env(config: ExperimentConfig, findings: list[Finding]) -> None:
    """The environment's tasks (train, held out) and how long a policy turn may be; it scores its own episodes."""
    from deploy.runs.agentic import describe_env

    findings.append(Finding("ok", "env", describe_env(config)))


def check_reward(config: ExperimentConfig, findings: list[Finding]) -> None:
    from reward.registry import BUILTINS, BadFunction, RewardSpec, check_args, load

    reward = config.reward
    if reward.model is not None:
        if not (pathlib.Path(reward.model) / "config.json").exists():
            findings.append(Finding("error", "reward", f"reward model {reward.model} has no config.json",
                                    "point reward.model at a sequence-classification model folder"))
        else:
            findings.append(Finding("ok", "reward", f"reward model {reward.model}"))
        return
    if reward.judge is not None:
        check_judge(reward.judge, findings)
        return
    spec = BUILTINS.get(reward.function) or RewardSpec(reward.function, reward.function)
    added = [p for p in reward.python_path if p not in sys.path]
    sys.path[:0] = added
    try:
        importlib.invalidate_caches()
        fn = load(spec)
        check_args(spec, fn, reward.args)
    except BadFunction as exc:
        findings.append(Finding("error", "reward", str(exc), "make the module importable from reward.python_path "
                                f"({', '.join(reward.python_path)}) and the function take (sample, **args)"))
        return
    finally:
        for path in added:
            sys.path.remove(path)
    findings.append(Finding("ok", "reward", f"{reward.function} imports ({spec.target})"))


def check_judge(judge, findings: list[Finding]) -> None:
    """The judge answers GET {url}/models and serves `judge.model` (the run would score every sample FAILED)."""
    import httpx

    url = judge.url.rstrip("/") + "/models"
    fix = "start the judge's server (vLLM, SGLang, a relayrl rollout with `openai:`) or fix reward.judge.url"
    try:
        reply = httpx.get(url, timeout=min(judge.timeout_s, 10.0))
        reply.raise_for_status()
        served = [m.get("id") for m in reply.json().get("data", [])]
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        findings.append(Finding("error", "reward", f"judge at {url} unreachable: {type(exc).__name__}: {exc}", fix))
        return
    if judge.model not in served:
        findings.append(Finding("error", "reward", f"judge at {judge.url} does not serve {judge.model!r} "
                                f"(it serves {served})", "set reward.judge.model to one of those"))
        return
    findings.append(Finding("ok", "reward", f"judge {judge.model!r} answers at {judge.url} ({judge.mode} mode)"))


def check_ports(config: ExperimentConfig, findings: list[Finding]) -> None:
    for name in ("buffer", "reward", "rollout"):
        placement = getattr(config.services, name)
        if not placement.port or placement.group is not None:  # a group's port is on its own nodes
            continue
        port = placement.port
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError as exc:
                findings.append(Finding("error", f"port ({name})", f"127.0.0.1:{port} is taken ({exc.strerror})",
                                        f"stop what listens there or set services.{name}.port: 0 (any free port)"))
                continue
        findings.append(Finding("ok", f"port ({name})", f"127.0.0.1:{port} is free"))


def check_disk(config: ExperimentConfig, facts: ModelFacts | None, findings: list[Finding]) -> None:
    training = config.training
    # A checkpoint holds the weights and Adam's two moments in float32; a buffer sample ~20 bytes a token.
    weights = facts.weight_bytes if facts else 0
    checkpoints = (config.checkpoint.keep_last + 1) * 3 * weights
    exports = weights * (1 + bool(config.checkpoint.export_dir) + bool(config.sft.steps))
    buffer = training.buffer_capacity_batches * training.batch_size * (training.max_tokens + 512) * 20 * 2
    need = checkpoints + exports + buffer
    where = pathlib.Path(config.run_dir)
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    message = f"{free / 1e9:.1f} GB free at {where}, the run needs about {need / 1e9:.2f} GB"
    if free < need:
        findings.append(Finding("error", "disk", message, "free space, point run_dir elsewhere, or lower "
                                "checkpoint.keep_last / training.buffer_capacity_batches"))
    else:
        findings.append(Finding("warn" if free < 2 * need else "ok", "disk", message))


def check_versions(findings: list[Finding]) -> None:
    found = {}
    for name in ("torch", "transformers", "vllm"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    if found["torch"] is None or found["transformers"] is None:
        findings.append(Finding("error", "versions", f"{found}", "pip install -e . (torch and transformers)"))
        return
    vllm = found["vllm"] or "not installed (the native engine serves; fine on CPU)"
    findings.append(Finding("ok", "versions", f"torch {found['torch']}, transformers {found['transformers']}, "
                            f"vllm {vllm}"))


def check_loggers(config: ExperimentConfig, findings: list[Finding]) -> None:
    """W&B and MLflow, when on: their library installed; W&B online with a key to log in with."""
    import os

    for name, section, package in (("wandb", config.logging.wandb, "wandb"), ("mlflow", config.logging.mlflow,
                                                                              "mlflow-skinny")):
        if section is None:
            continue
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            try:
                version = metadata.version(name)
            except metadata.PackageNotFoundError:
                findings.append(Finding("error", f"logging ({name})", f"logging.{name} is on but {name} is not "
                                        "installed", "pip install -e '.[loggers]'"))
                continue
        netrc = pathlib.Path.home() / ".netrc"
        if name == "wandb" and section.mode == "online" and not os.environ.get("WANDB_API_KEY") and not (
                netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace")):
            findings.append(Finding("warn", "logging (wandb)", "mode online, but no WANDB_API_KEY nor a `wandb login` "
                                    "(~/.netrc) is found: the run cannot start its W&B run without one",
                                    "wandb login, or set logging.wandb.mode: offline (`wandb sync` uploads it later)"))
            continue
        findings.append(Finding("ok", f"logging ({name})", f"{package} {version}"))


def diagnose(path: str | pathlib.Path, overrides: list[str] | None = None) -> list[Finding]:
    """Every finding about the experiment file at `path` (or the sweep file, or what another file is: doctor_files)."""
    from deploy.experiment.schema import load_experiment
    from services.config import ConfigError

    if (answer := not_an_experiment(path, overrides or [], diagnose)) is not None:
        return answer
    try:
        config = load_experiment(path, overrides or [])
    except (ConfigError, FileNotFoundError) as exc:
        return [Finding("error", "config", str(exc), "fix the field named (deploy/experiment/schema.py documents each)")]
    findings = [Finding("ok", "config", f"{path} is a valid experiment file")]
    maker = prepared_by(path)
    facts = check_models(config, findings, maker)
    if config.data is not None:
        check_data(config, facts, findings, maker)
        check_images(config, findings)
    check_stop(config, findings)
    check_lora(config, findings)
    if config.env is not None:
        check_env(config, findings)
    elif config.algorithm.name not in OFFLINE:  # an offline run learns from its pairs: no reward runs
        check_reward(config, findings)
    check_ports(config, findings)
    check_disk(config, facts, findings)
    check_loggers(config, findings)
    check_versions(findings)
    return findings


def main(path: str, overrides: list[str] | None = None) -> int:
    return report(diagnose(path, overrides))
