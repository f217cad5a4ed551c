"""data=text: how fast the token cache is prepared, and the data loader's share of a training step at `make train`'s
size.

1. Preparation: a .jsonl of documents (written from the standard library's docstrings) tokenized by a BPE tokenizer
   trained on them (tests/text_fixtures.py), into a fresh cache with 1 process and with one per core, side by side:
   tokens/s of each (the whole `prepare_tokens`: reading with datasets, tokenizing, writing the memory-mapped file and
   its checksums), beside the tokenizer's own batch encoding of the same texts in this process.
2. Loader share: `make train` (conf/train.yaml: gpt_tiny, cpu_4: pp=2 x loops=2 x dp=2, data.batch_size=32) with
   data=text and with the byte corpus, side by side, under Lightning's SimpleProfiler: the mean time of the training
   loader's `next` per step over the mean time of a training step. The step time is the difference of two runs' totals
   (STEPS and STEPS/4 steps), so the first step's setup (shape inference, FSDP) is not counted. The tokenizer has 512
   tokens, so both runs use model.vocab_size=512 (gpt_tiny has 256: bytes).

    python benchmarks/text_data.py                # writes benchmarks/results/text_data.json
    python benchmarks/text_data.py --docs 2000 --steps 40   # quicker
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, clean_env


def prepare_rates(work: Path, docs: int) -> dict:
    """Tokens/s of prepare_tokens on `docs` documents with 1 process and with one per core."""
    import text_fixtures as fixtures  # tests/ (on sys.path by common)

    from lightning_bfpp.data import TextSettings, prepare_tokens

    texts = fixtures.documents(docs)
    fixtures.train_tokenizer(work / "tokenizer", texts[:2000], vocab_size=512)
    data = fixtures.write_jsonl(work / "docs.jsonl", [{"text": t} for t in texts])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / "tokenizer")
    started = time.perf_counter()  # the tokenizer alone, batches of 1,000 texts: what preparation adds to it
    count = sum(len(ids) for i in range(0, len(texts), 1000) for ids in tokenizer(texts[i:i + 1000])["input_ids"])
    seconds = time.perf_counter() - started
    rows = {"tokenizer_alone": {"tokens": count, "seconds": round(seconds, 2), "tokens_per_s": round(count / seconds)}}
    print(f"  the tokenizer alone: {count / seconds:,.0f} tokens/s", flush=True)
    cores = len(os.sched_getaffinity(0))
    for processes in sorted({1, cores}):
        cache = work / f"cache-{processes}"
        shutil.rmtree(cache, ignore_errors=True)
        started = time.perf_counter()
        prepared = prepare_tokens(TextSettings(tokenizer=str(work / "tokenizer"), files=(str(data),),
                                               cache_dir=cache, num_proc=processes))
        seconds = time.perf_counter() - started
        rows[f"processes_{processes}"] = {"tokens": prepared.num_tokens, "documents": prepared.num_documents,
                                          "seconds": round(seconds, 2),
                                          "tokens_per_s": round(prepared.num_tokens / seconds)}
        print(f"  prepare, {processes} process(es): {prepared.num_tokens} tokens in {seconds:.1f} s = "
              f"{prepared.num_tokens / seconds:,.0f} tokens/s", flush=True)
    return rows


def profile(work: Path, data: list[str], steps: int, tag: str) -> dict[str, tuple[float, int, float]]:
    """`make train` with `data` for `steps` steps under SimpleProfiler: {action: (mean s, calls, total s)}."""
    args = [sys.executable, str(ROOT / "examples" / "train.py"), *data, "model.vocab_size=512",
            f"trainer.max_steps={steps}", "trainer.limit_val_batches=0", "trainer.val_check_interval=100000",
            "trainer.enable_progress_bar=false", "logger=none", "checkpoint.last=false", "+trainer.profiler=simple",
            f"hydra.run.dir={work / tag}"]
    proc = subprocess.run(args, cwd=work, env=clean_env(), capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    table = {}
    for line in (proc.stdout + proc.stderr).splitlines():
        cells = [c.strip() for c in line.split("|") if c.strip()]
        if len(cells) == 5 and cells[0] in ("[_TrainingEpochLoop].train_dataloader_next", "run_training_batch"):
            table[cells[0]] = (float(cells[1]), int(cells[2]), float(cells[3]))
    if len(table) != 2:
        raise RuntimeError(f"no profiler table in the output of {tag}:\n{proc.stdout[-3000:]}")
    return table


def loader_share(work: Path, data: list[str], steps: int, tag: str) -> dict:
    """The loader's mean `next` time over the step time (the difference of a long and a short run's totals)."""
    short, long = (profile(work, data, n, f"{tag}-{n}") for n in (steps // 4, steps))
    step = "run_training_batch"
    step_s = (long[step][2] - short[step][2]) / (long[step][1] - short[step][1])
    loader_s = long["[_TrainingEpochLoop].train_dataloader_next"][0]
    print(f"  {tag}: loader {loader_s * 1e3:.3f} ms per batch, step {step_s * 1e3:.1f} ms: "
          f"{100 * loader_s / step_s:.2f} % of a step", flush=True)
    return {"loader_ms": round(loader_s * 1e3, 4), "step_ms": round(step_s * 1e3, 2),
            "loader_share": round(loader_s / step_s, 5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=20000, help="documents to prepare")
    ap.add_argument("--steps", type=int, default=120, help="training steps of the long profiled run")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "text_data.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result = {"prepare": prepare_rates(work, args.docs)}
        text = ["data=text", f"data.tokenizer={work / 'tokenizer'}", f"data.files=[{work / 'docs.jsonl'}]",
                f"data.cache_dir={work / 'cache-1'}"]
        result["loader"] = {"text": loader_share(work, text, args.steps, "text"),
                            "byte_corpus": loader_share(work, [], args.steps, "byte-corpus")}
    result["config"] = {"docs": args.docs, "steps": args.steps, "cores": len(os.sched_getaffinity(0)),
                        "make_train": "gpt_tiny (model.vocab_size=512), cpu_4, breadth_first pp=2 x loops=2, "
                                      "data.batch_size=32"}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
