"""lightning_bfpp.data without processes: records tokenized once into a token cache that reruns reuse (and that an
interrupted or concurrent preparation never corrupts), windows packed with document boundaries, prompt tokens never
trained, a training order that resumes at the next sample at any data-parallel size, and every bad input named."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("datasets", reason="lightning_bfpp.data needs the [data] extra: pip install -e '.[dev,hf,data]'")

import text_fixtures as fixtures
from launch import ROOT, clean_env

from lightning_bfpp.contract.documents import document_positions
from lightning_bfpp.data import DataError, TextSettings, TokenCache, prepare_tokens
from lightning_bfpp.data import cache as cache_module
from lightning_bfpp.data.packing import PaddedDocuments, TokenWindows, document_split, packed
from lightning_bfpp.data.sampler import ResumableSampler

BLOCK = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Documents, a tokenizer trained on them, and the documents as .jsonl, .txt and prompt/completion/chat records."""
    root = tmp_path_factory.mktemp("corpus")
    docs = fixtures.documents(120)
    fixtures.train_tokenizer(root / "tokenizer", docs, vocab_size=400)
    fixtures.write_jsonl(root / "docs.jsonl", [{"text": d} for d in docs])
    fixtures.write_jsonl(root / "sft.jsonl", [{"prompt": d[:30], "completion": d[30:70]} for d in docs[:40]])
    fixtures.write_jsonl(root / "chat.jsonl", [{"messages": [{"role": "system", "content": "Be brief."},
                                                             {"role": "user", "content": d[:30]},
                                                             {"role": "assistant", "content": d[30:60]},
                                                             {"role": "user", "content": d[60:70]},
                                                             {"role": "assistant", "content": d[70:90]}]}
                                               for d in docs[:40]])
    return root


def settings(corpus, tmp_path, name="docs.jsonl", **kw) -> TextSettings:
    return TextSettings(tokenizer=str(corpus / "tokenizer"), files=(str(corpus / name),), cache_dir=tmp_path, **kw)


def tokenizer(corpus):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(corpus / "tokenizer")


def test_records_are_tokenized_once_and_reused(corpus, tmp_path, monkeypatch):
    cache = prepare_tokens(settings(corpus, tmp_path))
    tok = tokenizer(corpus)
    docs = [json.loads(line)["text"] for line in (corpus / "docs.jsonl").read_text().splitlines()]
    assert cache.num_documents == len(docs) and cache.tokens.dtype == np.uint16  # 400 tokens: 2 bytes each
    for d in (0, 7, len(docs) - 1):  # each document: the tokenizer's ids (bos first) and the end-of-sequence token
        expected = tok(docs[d])["input_ids"] + [tok.eos_token_id]
        assert cache.tokens[cache.offsets[d]:cache.offsets[d + 1]].tolist() == expected
    assert cache.trained is None  # plain text: every target counts

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("a complete cache was prepared again")

    monkeypatch.setattr(cache_module, "write_cache", no_tokenizing)
    again = prepare_tokens(settings(corpus, tmp_path))
    assert again.path == cache.path and again.num_tokens == cache.num_tokens
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".") and p.name != "datasets"] == \
        [cache.path.name]


def test_the_cache_is_keyed_by_files_tokenizer_and_settings(corpus, tmp_path):
    first = prepare_tokens(settings(corpus, tmp_path)).path
    assert prepare_tokens(settings(corpus, tmp_path, append_eos=False)).path != first
    changed = tmp_path / "docs.jsonl"
    changed.write_text((corpus / "docs.jsonl").read_text())
    moved = TextSettings(tokenizer=str(corpus / "tokenizer"), files=(str(changed),), cache_dir=tmp_path)
    path = prepare_tokens(moved).path
    changed.write_text(changed.read_text() + json.dumps({"text": "one more document"}) + "\n")
    assert prepare_tokens(moved).path != path  # the file changed: a new cache


def test_an_interrupted_preparation_is_never_taken_for_a_cache(corpus, tmp_path, monkeypatch):
    real = cache_module.write_cache

    def interrupted(folder, *args):
        real(folder, *args)  # everything written, then killed before the folder takes its name
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_module, "write_cache", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_tokens(settings(corpus, tmp_path))
    assert [p.name.split(".tmp-")[0] for p in tmp_path.glob(".*.tmp-*")]  # only the hidden folder is left
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".") and p.name != "datasets"]
    monkeypatch.setattr(cache_module, "write_cache", real)
    cache = prepare_tokens(settings(corpus, tmp_path))  # prepared anew; the interrupted folder removed
    assert not list(tmp_path.glob(".*.tmp-*")) and TokenCache.open(cache.path, checksums=True).num_documents == 120


CONCURRENT = """
import logging, sys, time
from lightning_bfpp.data import TextSettings, cache
logging.basicConfig(level=logging.INFO, format="%(message)s")
real = cache.write_cache
def slow(*args):  # a preparation that takes a while: the other process comes while it runs
    time.sleep(4)
    return real(*args)
cache.write_cache = slow
s = TextSettings(tokenizer=sys.argv[1], files=(sys.argv[2],), cache_dir=sys.argv[3])
c = cache.prepare_tokens(s)
print("RESULT", c.path, c.num_tokens)
"""


def test_two_processes_preparing_the_same_cache_make_it_once(corpus, tmp_path):
    args = [str(corpus / "tokenizer"), str(corpus / "docs.jsonl"), str(tmp_path)]
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, *args], cwd=ROOT, env=clean_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    results = {line for out in outputs for line in out.splitlines() if line.startswith("RESULT")}
    assert len(results) == 1, outputs  # both read the same cache
    assert sum("data: tokenizing" in out for out in outputs) == 1, outputs  # made once; the other waited or reused
    TokenCache.open(tmp_path / results.pop().split()[1].rsplit("/", 1)[1], checksums=True)


def test_a_corrupted_cache_is_named(corpus, tmp_path):
    s = settings(corpus, tmp_path)
    path = prepare_tokens(s).path
    tokens = path / "tokens.bin"
    data = bytearray(tokens.read_bytes())
    data[100] ^= 0xFF  # one flipped byte: only the checksum sees it
    tokens.write_bytes(bytes(data))
    TokenCache.open(path)  # sizes and index still right
    with pytest.raises(DataError, match=rf"the token cache {path} is corrupted \(tokens.bin does not match its sha256"
                                        rf".*remove it \(rm -r {path}\)"):
        prepare_tokens(s)  # checksums on: what the app does before launch
    tokens.write_bytes(bytes(data[:-3]))  # truncated
    with pytest.raises(DataError, match=r"corrupted \(tokens.bin holds \d+ bytes, not \d+ tokens of 2 bytes\)"):
        prepare_tokens(s, checksums=False)
    (path / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match=r"corrupted \(meta.json unreadable"):
        prepare_tokens(s)


def test_bad_files_are_named_with_the_fix(corpus, tmp_path):
    with pytest.raises(DataError, match=r"data.files: /nowhere/docs.jsonl does not exist"):
        prepare_tokens(TextSettings(tokenizer=str(corpus / "tokenizer"), files=("/nowhere/docs.jsonl",),
                                    cache_dir=tmp_path))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"data.files: .*empty.jsonl is empty"):
        prepare_tokens(settings(corpus, tmp_path, name="../" + tmp_path.name + "/empty.jsonl"))
    fixtures.write_jsonl(tmp_path / "body.jsonl", [{"body": "a document"}])
    with pytest.raises(DataError, match=r"the records of .*body.jsonl have no field 'text' \(they have body\); set "
                                        r"data.text_field"):
        prepare_tokens(TextSettings(tokenizer=str(corpus / "tokenizer"), files=(str(tmp_path / "body.jsonl"),),
                                    cache_dir=tmp_path))
    (tmp_path / "table.csv").write_text("text\na\n")
    with pytest.raises(DataError, match=r"table.csv is not a .txt, .jsonl, .json or .parquet file"):
        prepare_tokens(TextSettings(tokenizer=str(corpus / "tokenizer"), files=(str(tmp_path / "table.csv"),),
                                    cache_dir=tmp_path))
    with pytest.raises(DataError, match=r"data.tokenizer='/nowhere/tok' is not a directory with a tokenizer"):
        prepare_tokens(TextSettings(tokenizer="/nowhere/tok", files=(str(corpus / "docs.jsonl"),), cache_dir=tmp_path))
    with pytest.raises(DataError, match=r"data=text needs its data"):
        TextSettings(tokenizer=str(corpus / "tokenizer"))


def test_a_document_longer_than_the_window_is_named_with_packing_pad(corpus, tmp_path):
    cache = prepare_tokens(settings(corpus, tmp_path))
    longest = int(np.diff(cache.offsets).argmax())
    with pytest.raises(DataError, match=rf"data.packing=pad: document \d+ of .*docs.jsonl has \d+ tokens, more than "
                                        rf"the window holds \(data.block_size \+ 1 = {BLOCK + 1}"):
        PaddedDocuments(cache, range(cache.num_documents), BLOCK)
    fits = int(np.diff(cache.offsets).max()) - 1
    rows = PaddedDocuments(cache, range(cache.num_documents), fits)
    row = rows[int(np.flatnonzero(rows.documents == longest)[0])]
    assert (row["labels"] != -100).all()  # the longest document fills its row exactly
    shortest = rows[int(np.diff(cache.offsets)[rows.documents].argmin())]
    assert (shortest["labels"] == -100).any() and (shortest["input_ids"][shortest["labels"] == -100] == 0).all()


def test_a_dataset_name_offline_says_how_to_get_it(corpus, tmp_path, monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 (and no network) make it
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    s = TextSettings(tokenizer=str(corpus / "tokenizer"), dataset="someone/some-corpus", cache_dir=tmp_path)
    with pytest.raises(DataError, match=r"data.dataset='someone/some-corpus' is not in the local cache and the Hugging "
                                        r"Face hub cannot be reached .*Run the same command once where the network "
                                        r"reaches the hub.*or give local files: data.files="):
        prepare_tokens(s)


def test_packed_windows_keep_documents_apart(corpus, tmp_path):
    cache = prepare_tokens(settings(corpus, tmp_path))
    train, val = document_split(cache, 0.1)
    assert (len(train), len(val)) == (108, 12) and train.stop == val.start  # split by documents
    windows = TokenWindows(cache, train, BLOCK)
    stream = np.concatenate([windows[i]["input_ids"].numpy() for i in range(len(windows))])
    assert stream.tolist() == cache.tokens[:len(stream)].tolist()  # the documents one after another
    boundaries = 0
    for i in range(len(windows)):
        row = windows[i]
        docs, labels = row["document_ids"], row["labels"]
        assert docs[0] == 0 and bool((docs.diff() >= 0).all())
        change = torch.nonzero(docs.diff()).flatten()  # the last token of a document: its target is not counted
        ignored = torch.nonzero(labels == -100).flatten().tolist()
        assert set(change.tolist()) <= set(ignored) <= {*change.tolist(), BLOCK - 1}  # (or the next window's first)
        boundaries += len(change)
        starts = torch.cat([torch.tensor([0]), change + 1])
        assert bool((document_positions(docs[None])[0][starts] == 0).all())
    assert boundaries > 50
    concat = TokenWindows(cache, train, BLOCK, with_documents=False)
    assert "document_ids" not in concat[3] and bool((concat[3]["labels"] != -100).all())  # every next token counts
    assert torch.equal(concat[3]["input_ids"], windows[3]["input_ids"])
    assert len(packed(cache, val, BLOCK, "documents")) == (cache.offsets[-1] - cache.offsets[108] - 1) // BLOCK


@pytest.mark.parametrize("name", ["sft.jsonl", "chat.jsonl"])
def test_prompt_tokens_are_not_trained(corpus, tmp_path, name):
    cache = prepare_tokens(settings(corpus, tmp_path, name=name))
    assert cache.meta["format"] == ("prompt_completion" if name == "sft.jsonl" else "chat")
    tok = tokenizer(corpus)
    record = json.loads((corpus / name).read_text().splitlines()[0])
    rows = PaddedDocuments(cache, range(cache.num_documents), 200)
    row = rows[0]
    trained = tok.decode(row["labels"][row["labels"] != -100])
    if name == "sft.jsonl":  # the completion, then the end of the document
        assert trained == record["completion"] + "</s>"
    else:  # the assistant's two turns, each with the template's end of turn
        answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert trained == f"{answers[0]}<|end|>{answers[1]}<|end|></s>"  # and the document's end after the last
        assert "<|user|>" in tok.decode(row["input_ids"]) and "Be brief." in tok.decode(row["input_ids"])


def test_the_training_order_is_the_same_at_every_data_parallel_size_and_resumes_at_the_next_sample():
    data = list(range(50))
    orders = {}
    for replicas in (1, 2, 4):
        shares = [list(ResumableSampler(data, 8, replicas, r, seed=3)) for r in range(replicas)]
        share = 8 // replicas
        orders[replicas] = [i for b in range(6) for r in range(replicas) for i in shares[r][b * share:(b + 1) * share]]
    assert orders[1] == orders[2] == orders[4] and len(set(orders[1])) == 48  # 6 global batches; the rest dropped
    for replicas in (1, 2):  # a resume after 3 global batches, at another data-parallel size: the next samples
        resumed = []
        for r in range(replicas):
            sampler = ResumableSampler(data, 8, replicas, r, seed=3)
            sampler.resume_at(0, 24)
            resumed.append(list(sampler))
        share = 8 // replicas
        got = [i for b in range(3) for r in range(replicas) for i in resumed[r][b * share:(b + 1) * share]]
        assert got == orders[1][24:]
    sampler = ResumableSampler(data, 8, seed=3)
    sampler.resume_at(0, 24)
    sampler.set_epoch(1)  # another epoch: from its start
    assert len(list(sampler)) == 48


class Batches:
    """A callback keeping every training batch's input ids."""

    def __init__(self) -> None:
        from lightning.pytorch import Callback

        seen = self.seen = []

        class Record(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                seen.append(batch["input_ids"].clone())

        self.callback = Record()


def fit(corpus, cache_dir, steps: int, batch_size: int = 4, ckpt_path=None, save_every: int = 0) -> list[torch.Tensor]:
    """A tiny example GPT trained `steps` steps on the corpus by plain Lightning (one process), saving
    `cache_dir`/step=N.ckpt every `save_every` steps (mid-epoch); its batches."""
    from gpt import GPT, GPTConfig
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_bfpp.data import TextDataModule

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=BLOCK, vocab_size=400))
    data = TextDataModule(settings(corpus, cache_dir), block_size=BLOCK, batch_size=batch_size, seed=5)
    record = Batches()
    saves = [ModelCheckpoint(dirpath=cache_dir, filename="{step}", every_n_train_steps=save_every, save_top_k=-1)] \
        if save_every else []
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, logger=False,
                      enable_checkpointing=bool(saves), enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[record.callback, *saves])
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return record.seen


def test_a_resume_continues_at_the_next_sample(corpus, tmp_path):
    """The data position (epoch, samples consumed, seed) is in the checkpoint: a run stopped mid-epoch resumes with the
    next global batch (plain Lightning would restart the epoch's loader); a changed global batch is refused."""
    whole = fit(corpus, tmp_path, 6, save_every=3)
    state = torch.load(tmp_path / "step=3.ckpt", weights_only=False)["TextDataModule"]
    assert {k: state[k] for k in ("epoch", "samples", "seed", "global_batch_size")} == \
        {"epoch": 0, "samples": 12, "seed": 5, "global_batch_size": 4}
    rest = fit(corpus, tmp_path, 6, ckpt_path=tmp_path / "step=3.ckpt")
    assert len(rest) == 3 and all(torch.equal(a, b) for a, b in zip(rest, whole[3:]))
    with pytest.raises(DataError, match=r"counts global batches of data.batch_size=4, this run's are 8: resume with "
                                        r"data.batch_size=4"):
        fit(corpus, tmp_path, 6, batch_size=8, ckpt_path=tmp_path / "step=3.ckpt")
