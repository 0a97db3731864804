"""Experiment tracking in MLflow (`log.mlflow=true`; the `mlflow` extra, or `mlflow`), from rank 0.

Where runs go is MLflow's business: MLFLOW_TRACKING_URI (a server, `sqlite:///path.db`, Databricks),
else MLflow's default (`sqlite:///mlflow.db` in the working directory); MLFLOW_RUN_ID continues an
existing run (a requeued job), MLFLOW_EXPERIMENT_NAME or `log.mlflow_experiment` picks the
experiment. A run gets the resolved config as params (`train.epochs`, ...), every numeric series of
the run log as metrics (`train/loss`, `eval/accuracy`, `adaptive/B`, `memory/peak`, ...) at its
optimizer step, and the final checkpoint as artifacts; `hvdtrain train` adds the report.
"""

from __future__ import annotations

import math
from typing import Any

from hvdtrain.errors import ConfigError

METRIC_KINDS = ("train", "eval", "adaptive", "memory")


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = str(value)
    return out


class MlflowRun:
    """One MLflow run, fed by `RunLog` on rank 0. Metrics are sent without waiting (MLflow's async
    logging): a logging step costs the loop no round trip to the tracking store."""

    def __init__(self, experiment: str) -> None:
        try:
            import mlflow
        except ImportError:
            raise ConfigError("log.mlflow=true needs MLflow: pip install 'hvdtrain[mlflow]' "
                              "(or mlflow-skinny with sqlalchemy and alembic)") from None
        self.mlflow = mlflow
        try:
            if mlflow.active_run() is None:
                import os

                if not os.environ.get("MLFLOW_EXPERIMENT_NAME") and not os.environ.get("MLFLOW_EXPERIMENT_ID"):
                    mlflow.set_experiment(experiment)
                mlflow.start_run()
            self.run_id: str = mlflow.active_run().info.run_id  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - a bad URI, an unreachable server: one line, on every rank
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise ConfigError(f"log.mlflow=true: MLflow could not start a run at {mlflow.get_tracking_uri()} "
                              f"({first}); check MLFLOW_TRACKING_URI") from None
        self._params_logged = False

    def record(self, step: int, kind: str, values: dict[str, Any]) -> None:
        if kind == "event" and values.get("event") == "start" and not self._params_logged:
            self.mlflow.log_params(_flat(values.get("config") or {}))
            self._params_logged = True  # an elastic run's later worlds have the same config
        elif kind == "event" and values.get("event") == "end" and values.get("checkpoint"):
            self.mlflow.log_artifacts(values["checkpoint"], artifact_path="checkpoint")
        elif kind in METRIC_KINDS:
            metrics = {f"{kind}/{k}": float(v) for k, v in values.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                       and k not in ("step", "time", "epoch")}
            if metrics:
                self.mlflow.log_metrics(metrics, step=step, synchronous=False)

    def close(self) -> None:
        self.mlflow.flush_async_logging()
        self.mlflow.end_run()
