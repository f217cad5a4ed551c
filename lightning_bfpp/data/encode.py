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


def _ids(tokenizer: Any, texts: list[str], special: bool) -> list[list[int]]:
    """Token ids of many texts in one call (a fast tokenizer encodes them in parallel, in Rust)."""
    return tokenizer(texts, add_special_tokens=special)["input_ids"] if texts else []


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
    if fmt == "text":
        texts = [_check_text(t, text_field, i) for t, i in zip(records[text_field], indices)]
        ids = _ids(tokenizer, texts, True)
        trained = [[1] * len(x) for x in ids]
    elif fmt == "prompt_completion":
        prompts = _ids(tokenizer, [_check_text(t, "prompt", i) for t, i in zip(records["prompt"], indices)], True)
        answers = _ids(tokenizer, [_check_text(t, "completion", i) for t, i in zip(records["completion"], indices)],
                       False)
        ids = [p + a for p, a in zip(prompts, answers)]
        trained = [[0] * len(p) + [1] * len(a) for p, a in zip(prompts, answers)]
    else:
        ids, trained = [], []
        for messages, index in zip(records["messages"], indices):
            pieces = chat_pieces(tokenizer, messages, index)
            encoded = _ids(tokenizer, [text for text, _ in pieces], False)
            ids.append([t for piece in encoded for t in piece])
            trained.append([int(counted) for piece, (_, counted) in zip(encoded, pieces) for _ in piece])
    eos = tokenizer.eos_token_id if append_eos else None
    if eos is not None:
        for x, mask in zip(ids, trained):
            if not x or x[-1] != eos:
                x.append(eos)
                mask.append(mask[-1] if mask else 1)  # trained after a trained token (a completion's end)
    return {"input_ids": ids, "trained": trained}
