"""Examples/train.py's CSV metrics: one `<run dir>/csv/version_0/metrics.csv` per run directory, across resumes.
Lightning's CSVLogger starts a `version_N` folder per run, and, given a fixed version, deletes the metrics.csv it
finds there; a run resumed into its own directory (ckpt_path=auto, a SLURM requeue) continues that file instead:
the rows of the steps before the checkpoint's are kept, the steps after it (trained again) are logged anew."""
from __future__ import annotations

import csv
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class ContinuedWriter(ExperimentWriter):
    """Lightning's CSV writer over an existing metrics.csv: the rows logged before `resumed_step` are kept (with
    their header's columns), the later ones dropped; without `resumed_step` (a fresh run) the file starts anew."""

    def __init__(self, log_dir: str, resumed_step: int | None) -> None:
        self.resumed_step = resumed_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if self.resumed_step is None or not path.is_file():
            path.unlink(missing_ok=True)
            return
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            kept = [row for row in reader if row.get("step") and float(row["step"]) < self.resumed_step]
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header)
            writer.writeheader()
            writer.writerows(kept)
        self.metrics_keys = header  # the next rows add columns to these (Lightning rewrites the header then)


class RunDirCSVLogger(CSVLogger):
    """CSVLogger(save_dir=<run dir>, name="csv", version=0) writing through ``ContinuedWriter``."""

    def __init__(self, run_dir: Path, resumed_step: int | None) -> None:
        super().__init__(save_dir=str(run_dir), name="csv", version=0)
        self.resumed_step = resumed_step

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:  # CSVLogger's, with the writer above
        if self._experiment is None:
            Path(self.root_dir).mkdir(parents=True, exist_ok=True)
            self._experiment = ContinuedWriter(log_dir=self.log_dir, resumed_step=self.resumed_step)
        return self._experiment
