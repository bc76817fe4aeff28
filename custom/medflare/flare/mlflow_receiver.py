"""FLARE's MLflow receiver, published under a ``medflare.flare.`` class path, that also records the server.

FLARE's receiver opens one MLflow run per client site and records federated events only; medflare's controller
reports the pooled, per-site and site-mean metrics from the server itself, so this receiver adds a run for the
server and records local events too. Metrics go to FLARE's default store, ``mlflow.db`` (SQLite) in the
server's job folder. Without ``mlflow`` on the server the job still runs: one log line, no records.
"""

from __future__ import annotations

from typing import Any

from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE
from nvflare.apis.fl_context import FLContext

from medflare.flare.tracking import receiver_base


class MlflowReceiver(
    receiver_base("nvflare.app_opt.tracking.mlflow.mlflow_receiver", "MLflowReceiver", "mlflow")  # type: ignore[misc]
):
    """FLARE's ``MLflowReceiver`` with one more MLflow run: the server's own metrics.

    It takes no tracking URI: a job may not choose where, or to which remote server, the server writes (always
    FLARE's SQLite file in the job folder).

    Args:
        events: events to record (default: the server's own and the sites' federated analytics events).
    """

    def __init__(self, events: list[str] | None = None) -> None:
        super().__init__(tracking_uri=None, events=events or [ANALYTIC_EVENT_TYPE, f"fed.{ANALYTIC_EVENT_TYPE}"])
        self._server_name = ""

    # FLARE's receiver names its runs after the connected clients; the server's own run is added to both steps.
    def _mlflow_setup(
        self, art_full_path: str, experiment_name: str, experiment_tags: dict, site_names: list[str], fl_ctx: FLContext
    ) -> Any:
        self._server_name = fl_ctx.get_identity_name()
        return super()._mlflow_setup(
            art_full_path, experiment_name, experiment_tags, [*site_names, self._server_name], fl_ctx
        )

    def _init_buffer(self, site_names: list[str]) -> None:
        super()._init_buffer([*site_names, self._server_name])
