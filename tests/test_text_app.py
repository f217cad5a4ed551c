"""data=text from the command line, offline: a tiny Llama saved with save_pretrained and a tokenizer trained in seconds
on local text fine-tune on a .jsonl of documents on 2 processes (the validation loss falls); a second run reuses the
token cache and resumes the data position at another data-parallel size; bad data settings stop before launch."""
from __future__ import annotations

import csv
import subprocess
import sys

import pytest
from app_config import compose_app
from test_app import TRAIN

pytest.importorskip("datasets", reason="data=text needs the [data] extra: pip install -e '.[dev,hf,data]'")
pytest.importorskip("transformers", reason="model=hf_pretrained needs the [hf] extra")

import text_fixtures as fixtures
from procenv import clean_env

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
COMMON = ["model=hf_pretrained", "data=text", "schedule.micro_batches=2", "data.batch_size=8",
          "trainer.limit_val_batches=4", "trainer.enable_progress_bar=false", "logger=csv", "optim.lr=3e-3",
          "optim.warmup_steps=2"]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The model directory (a tiny Llama and its tokenizer, trained on the documents) and docs.jsonl."""
    root = tmp_path_factory.mktemp("text-app")
    docs = fixtures.documents(400)
    fixtures.train_tokenizer(root / "model", docs, vocab_size=512)
    fixtures.save_llama(root / "model", vocab_size=512, block_size=64)
    fixtures.write_jsonl(root / "docs.jsonl", [{"text": d} for d in docs])
    return root


def cli(args: list[str], cwd) -> subprocess.CompletedProcess:
    """examples/train.py with the hub unreachable by setting (as on a machine without network)."""
    env = clean_env(**OFFLINE)
    proc = subprocess.run([sys.executable, str(TRAIN), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def metrics(run_dir, key: str) -> dict[int, float]:
    (path,) = run_dir.glob("csv/*/metrics.csv")
    return {int(r["step"]): float(r[key]) for r in csv.DictReader(path.open()) if r.get(key)}


def test_a_saved_model_fine_tunes_on_local_text_and_a_rerun_reuses_the_cache(local, tmp_path):
    data = [f"model.path={local / 'model'}", f"data.files=[{local / 'docs.jsonl'}]", f"data.cache_dir={tmp_path}/c"]
    first = cli([*COMMON, *data, "cluster=cpu_2", "schedule.pipeline_parallel=2", "schedule.loops=2",
                 "trainer.max_steps=12", "trainer.val_check_interval=6", "checkpoint.every_n_steps=6",
                 f"hydra.run.dir={tmp_path}/one"], cwd=tmp_path)
    log = first.stdout + first.stderr
    assert "data: tokenizing 400 text records" in log
    val = metrics(tmp_path / "one", "val_loss")
    assert sorted(val) == [5, 11] and val[11] < val[5] < 6.2  # ln(512) = 6.24 at the start
    # the same data again, resumed mid-epoch at pp=1 x dp=2: the cache is reused, the data continues at the next sample
    second = cli([*COMMON, *data, "cluster=cpu_2", "schedule.pipeline_parallel=1", "schedule.loops=2",
                  "trainer.max_steps=12", "trainer.val_check_interval=6",
                  f"ckpt_path={tmp_path}/one/checkpoints/step-6.ckpt", f"hydra.run.dir={tmp_path}/two"], cwd=tmp_path)
    log = second.stdout + second.stderr
    assert "data: reusing the token cache" in log and "data: tokenizing" not in log
    once, resumed = metrics(tmp_path / "one", "train_loss"), metrics(tmp_path / "two", "train_loss")
    assert sorted(resumed) == list(range(6, 12))
    assert all(resumed[s] == pytest.approx(once[s], rel=1e-3) for s in resumed), (once, resumed)


def compose_text(*overrides: str):
    from app import run_dir

    run_dir.register_resolvers()  # ${bfpp_hf_config:...}, as examples/train.py does at import
    return compose_app(["data=text", "cluster=cpu_2", "schedule.pipeline_parallel=2", "data.batch_size=8", *overrides])


def test_bad_text_data_is_named_before_launch(local, tmp_path):
    from app.checks import ConfigError, check_config
    from data import prepare_text

    docs, cache = f"data.files=[{local / 'docs.jsonl'}]", f"data.cache_dir={tmp_path}"
    llama = [f"model.path={local / 'model'}", "model=hf_pretrained"]

    def prepare(*overrides: str) -> None:
        cfg = compose_text(cache, *overrides)
        check_config(cfg)
        prepare_text(cfg)

    with pytest.raises(ConfigError, match=r"data=text needs a tokenizer: data.tokenizer=.*\(model=gpt_tiny has none\)"):
        prepare(docs)
    with pytest.raises(ConfigError, match=rf"the tokenizer of data.tokenizer={local / 'model'} has 512 tokens, more "
                                          r"than the model's model.vocab_size=256.*model.vocab_size >= 512"):
        prepare(docs, f"data.tokenizer={local / 'model'}")
    with pytest.raises(ConfigError, match=r"data.files: /nowhere.jsonl does not exist"):
        prepare("data.files=[/nowhere.jsonl]", *llama)
    with pytest.raises(ConfigError, match=r"data.packing=pad: document \d+ of .*docs.jsonl has \d+ tokens, more than "
                                          r"the window holds \(data.block_size \+ 1 = 65"):
        prepare(docs, *llama, "data.packing=pad")
    with pytest.raises(ConfigError, match=r"the validation split holds \d+ rows .* fewer than one batch of "
                                          r"data.batch_size=128.*trainer.limit_val_batches=0"):
        prepare(docs, *llama, "data.batch_size=128", "schedule.micro_batches=2")
    with pytest.raises(ConfigError, match=r"data.packing='tight' is not one of documents, concat, pad"):
        check_config(compose_text(docs, *llama, "data.packing=tight"))
    prepare(docs, *llama, "data.packing=concat")  # fits
    # the command line stops before any process starts, exit 2, naming the file
    proc = subprocess.run([sys.executable, str(TRAIN), *llama, "data=text", "data.files=[/nowhere.jsonl]", cache,
                           f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, env=clean_env(**OFFLINE),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "error: data.files: /nowhere.jsonl does not exist" in proc.stderr, proc.stderr
