"""Records to token ids: the tokenizer (``load_tokenizer``, identified by ``tokenizer_key``) and what each record
format trains (``encode_batch``): plain text all of it, prompt/completion the completion only, chat the assistant's
turns only (the conversation rendered by the tokenizer's own chat template). Each document ends with the
end-of-sequence token (``append_eos``)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .settings import DataError


def load_tokenizer(name: str, setting: str = "data.tokenizer") -> Any:
    """``AutoTokenizer.from_pretrained(name)``: a directory, or a hub name where the network allows."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        where = "is not a directory with a tokenizer" if not Path(name).is_dir() else "holds no tokenizer it can read"
        raise DataError(f"{setting}={name!r} {where} ({type(err).__name__}: {str(err)[:300]}); give a directory "
                        "written by tokenizer.save_pretrained (tokenizer.json / tokenizer_config.json), or a hub "
                        "name where the network allows.") from err


def tokenizer_key(tokenizer: Any) -> str:
    """A hash of what the tokenizer does: its class, vocabulary and merges (the whole fast tokenizer), special tokens
    and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    parts = [type(tokenizer).__name__, model, json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str),
             str(getattr(tokenizer, "chat_template", None)), str(len(tokenizer))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _ids(tokenizer: Any, text: str, special: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def _check_text(value: Any, field: str, index: int) -> str:
    if not isinstance(value, str):
        raise DataError(f"record {index}: field {field!r} holds {type(value).__name__}, not text.")
    return value


def chat_pieces(tokenizer: Any, messages: list[dict], index: int) -> list[tuple[str, bool]]:
    """The conversation rendered by the chat template as (text, trained) pieces: each assistant turn trained, the
    rest (system, user, the template's own tokens) not. The template must render each conversation's beginning
    as the beginning of the whole (every common template does)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("data.format=chat: the tokenizer has no chat template; use a tokenizer with one "
                        "(tokenizer.chat_template), or prompt/completion records.")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"record {index}: field 'messages' must be a non-empty list of {{role, content}}.")

    def render(upto: int, prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=prompt)

    pieces, done = [], ""
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, after = render(i, True), render(i + 1, False)
        if not before.startswith(done) or not after.startswith(before):
            raise DataError(f"record {index}: the tokenizer's chat template does not render the conversation's "
                            "beginning as the beginning of the whole, so the assistant's turns cannot be found in it; "
                            "use prompt/completion records.")
        pieces += [(before[len(done):], False), (after[len(before):], True)]
        done = after
    rest = render(len(messages), False)
    pieces.append((rest[len(done):], False))
    return [(text, trained) for text, trained in pieces if text]


def encode_batch(records: dict[str, list], indices: list[int], tokenizer: Any, fmt: str, text_field: str,
                 append_eos: bool) -> dict[str, list]:
    """``datasets.map`` function (batched, with indices): ``input_ids`` and ``trained`` (1 where the token is a
    target the loss counts, 0 for prompt tokens) of each record."""
    eos = tokenizer.eos_token_id if append_eos else None
    out_ids, out_trained = [], []
    for row, index in enumerate(indices):
        if fmt == "text":
            ids = _ids(tokenizer, _check_text(records[text_field][row], text_field, index), True)
            trained = [1] * len(ids)
        elif fmt == "prompt_completion":
            prompt = _ids(tokenizer, _check_text(records["prompt"][row], "prompt", index), True)
            completion = _ids(tokenizer, _check_text(records["completion"][row], "completion", index), False)
            ids, trained = prompt + completion, [0] * len(prompt) + [1] * len(completion)
        else:
            ids, trained = [], []
            for text, counted in chat_pieces(tokenizer, records["messages"][row], index):
                piece = _ids(tokenizer, text, False)
                ids += piece
                trained += [int(counted)] * len(piece)
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
            trained.append(trained[-1] if trained else 1)  # trained after a trained token (a completion's end)
        out_ids.append(ids)
        out_trained.append(trained)
    return {"input_ids": out_ids, "trained": out_trained}
