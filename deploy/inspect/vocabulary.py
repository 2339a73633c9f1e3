"""Why a tokenizer holds more tokens than its model's embedding has rows, and the fix that keeps the model
(`relayrl doctor EXPERIMENT.yaml`, deploy/inspect/doctor.py).

transformers gives a tokenizer class's default special tokens to a folder that names none: Qwen2Tokenizer adds
"<|endoftext|>" (its default unk, eos and pad) to a word-level tokenizer saved without an unk token, one id past a model
trained without it. Two shapes of the same fault:

    in memory       the folder's tokenizer_config.json names no unk_token: transformers adds the default as it loads
                    the folder; naming a token of the vocabulary there is the whole fix
    in the files    the tokenizer was loaded that way and saved again over the folder (AutoTokenizer, then
                    save_pretrained): tokenizer_config.json now names "<|endoftext|>" and tokenizer.json lists it among
                    its added_tokens, so both files change
"""

import inspect
import json
import pathlib

ROLES = ("unk_token", "eos_token", "pad_token", "bos_token")


def beyond_embedding(tokenizer, path: pathlib.Path, rows: int) -> tuple[str, str]:
    """(Which tokens lie past the embedding's `rows` and where they came from, the fix)."""
    declared = _json(path / "special_tokens_map.json") | _json(path / "tokenizer_config.json")
    defaults = _class_defaults(tokenizer)
    parts, defaulted, saved = [], [], []
    name = type(tokenizer).__name__
    for token_id in range(rows, len(tokenizer)):
        token = tokenizer.convert_ids_to_tokens(token_id)
        roles = [role for role in ROLES if getattr(tokenizer, role, None) == token]
        undeclared = [role for role in roles if declared.get(role) is None]
        if undeclared:
            defaulted.append(undeclared[0])
            parts.append(f"{token!r} (id {token_id}) is {name}'s default {undeclared[0]}, added by transformers "
                         f"because {path.name}/tokenizer_config.json names no {undeclared[0]}")
        elif roles and all(defaults.get(role) == token for role in roles):
            saved.append((token, token_id, roles))
            parts.append(f"{token!r} (id {token_id}) is {name}'s default {roles[0]}, saved into the tokenizer files "
                         f"(tokenizer_config.json names it {', '.join(roles)}, tokenizer.json lists it among its "
                         "added_tokens): the tokenizer was loaded by transformers, which added it, and saved again "
                         "over the model's folder")
        else:
            parts.append(f"{token!r} (id {token_id}) is an added token of the tokenizer files")
    if len(defaulted) + len(saved) < len(tokenizer) - rows:
        return "; ".join(parts), ("use the tokenizer the model was trained with, or resize the embeddings "
                                  "(model.resize_token_embeddings(len(tokenizer))) and save again")
    in_range = [token for token, token_id in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
                if token_id < rows]
    roles = defaulted + [role for _, _, named in saved for role in named]
    settings = ", ".join(f'"{role}": "{_stand_in(tokenizer, role, in_range)}"' for role in roles)
    fix = f"keep the model and its tokenizer: set {settings} (a token the vocabulary already has)"
    if saved:
        config = _json(path / "tokenizer_config.json")
        decoder = [str(token_id) for _, token_id, _ in saved if str(token_id) in config.get("added_tokens_decoder", {})]
        fix += (f" in {path / 'tokenizer_config.json'}" + (f" and remove {', '.join(map(repr, decoder))} from its "
                                                             "added_tokens_decoder" if decoder else "") +
                f", and remove the entr{'y' if len(saved) == 1 else 'ies'} of "
                f"{', '.join(f'{token!r} (id {token_id})' for token, token_id, _ in saved)}"
                f" from \"added_tokens\" in {path / 'tokenizer.json'}; the tokenizer then loads with {rows} tokens")
    else:
        fix += f" in {path / 'tokenizer_config.json'}; the tokenizer then loads with {rows} tokens"
    return "; ".join(parts), fix


def _stand_in(tokenizer, role: str, in_range: list[str]) -> str:
    """A token of the vocabulary to name as `role` instead: one whose name says it (<unk>), else the pad token."""
    word = role.removesuffix("_token")
    candidate = next((token for token in in_range if word in token.lower()), None)
    if candidate is not None:
        return candidate
    return tokenizer.pad_token if tokenizer.pad_token in in_range else in_range[-1]


def _class_defaults(tokenizer) -> dict[str, str]:
    """The special tokens the tokenizer's class gives a folder that names none (its __init__'s defaults)."""
    try:
        parameters = inspect.signature(type(tokenizer).__init__).parameters
    except (TypeError, ValueError):
        return {}
    return {role: parameters[role].default for role in ROLES
            if role in parameters and isinstance(parameters[role].default, str)}


def _json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    loaded = json.loads(path.read_text())
    return loaded if isinstance(loaded, dict) else {}
