"""FLARE's MLflow receiver, published under a ``medflare.flare.`` class path: one named MLflow run per job.

FLARE's receiver opens one run per client site and logs no parameters. This one writes the whole job into one run,
``<run_name>-<short job id>``, with the job's settings as params and ``env``, ``job_id`` and ``medflare_version``
tags, so runs can be compared by method, model, lr or seed; a site's metrics are prefixed with the site
(``site-1/train/loss``). Without ``mlflow`` on the server the job still runs: one log line, no records.
"""

from __future__ import annotations

import os
from typing import Any

from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsData, AnalyticsDataType, TrackConst
from nvflare.apis.fl_context import FLContext

import medflare
from medflare.flare.tracking import SIMULATOR_JOB_ID, receiver_base

PARAMS_PER_BATCH = 100  # MLflow takes at most this many params in one log_batch call
SHARED_STORE_VARIABLE = "MEDFLARE_MLFLOW_URI"  # e.g. sqlite:////abs/runs/mlflow.db: every job of a server in one store


class MlflowReceiver(
    receiver_base("nvflare.app_opt.tracking.mlflow.mlflow_receiver", "MLflowReceiver", "mlflow")  # type: ignore[misc]
):
    """FLARE's ``MLflowReceiver`` writing one run per job, with the job's params, and the server's metrics too. It
    takes no tracking URI: a job may not choose where the server writes (``MEDFLARE_MLFLOW_URI`` may).

    Args:
        events: events to record (default: the server's own and the sites' federated analytics events).
        kw_args: FLARE's ``experiment_name``, ``run_name``, ``experiment_tags`` and ``run_tags``.
        params: the job's settings, logged once as MLflow params (text values).
        deployed_env: the ``env`` tag outside FLARE's simulator (``poc`` or ``prod``).
    """

    def __init__(self, events: list[str] | None = None, kw_args: dict[str, Any] | None = None,
                 params: dict[str, str] | None = None, deployed_env: str = "prod") -> None:
        super().__init__(tracking_uri=None, kw_args=kw_args,
                         events=events or [ANALYTIC_EVENT_TYPE, f"fed.{ANALYTIC_EVENT_TYPE}"])
        self.params = params or {}
        self.deployed_env = deployed_env
        self._server_name = ""

    # FLARE's receiver opens a run for each connected client; here one run, the server's, serves every sender.
    def _mlflow_setup(self, art_full_path: str, experiment_name: str, experiment_tags: dict, site_names: list[str],
                      fl_ctx: FLContext) -> None:
        from mlflow.entities import Param  # mlflow is there: FLARE's receiver, the base class, imports it

        self._server_name = fl_ctx.get_identity_name()
        env = "simulator" if fl_ctx.get_job_id() == SIMULATOR_JOB_ID else self.deployed_env
        tags = {**(self.kw_args.get(TrackConst.RUN_TAGS) or {}), "env": env, "medflare_version": medflare.__version__}
        self.kw_args[TrackConst.RUN_TAGS] = tags  # FLARE adds job_id and run_name
        super()._mlflow_setup(art_full_path, experiment_name, experiment_tags, [self._server_name], fl_ctx)
        client, run_id = self.mlflow_clients[self._server_name], self.run_ids[self._server_name]
        params = [Param(key, str(value)) for key, value in self.params.items()]
        for start in range(0, len(params), PARAMS_PER_BATCH):
            client.log_batch(run_id, params=params[start:start + PARAMS_PER_BATCH])
        for site in site_names:
            self._share_run(site)

    def _share_run(self, sender: str) -> None:
        self.mlflow_clients[sender] = self.mlflow_clients[self._server_name]
        self.run_ids[sender] = self.run_ids[self._server_name]

    def _init_buffer(self, site_names: list[str]) -> None:
        super()._init_buffer([*site_names, self._server_name])

    def _get_tracking_uri(self, fl_ctx: FLContext) -> str:
        """The server operator's shared store (``MEDFLARE_MLFLOW_URI`` in the server's environment), else FLARE's
        ``mlflow.db`` in the job folder. Not MLflow's own variable: FLARE's receiver sets that one for each job."""
        return os.environ.get(SHARED_STORE_VARIABLE) or super()._get_tracking_uri(fl_ctx)

    def _get_run_name(self, kwargs: dict, site_name: str, job_id_tag: str, job_name: str | None) -> str:
        """``<run_name>-<short job id>`` (a job id's first block; the simulator's is a timestamp, kept whole)."""
        prefix = kwargs.get(TrackConst.RUN_NAME) or job_name or "medflare"
        return f"{prefix}-{job_id_tag.split('-')[0]}"

    def buffer_data(self, data: AnalyticsData, record_origin: str) -> None:
        """Buffer as FLARE does, a site's metrics under ``<site>/`` (all senders share the run)."""
        if record_origin not in self.buffer:  # a site that joined after the job started
            self._share_run(record_origin)
            super()._init_buffer([record_origin])
        prefix = f"{record_origin}/" if record_origin != self._server_name else ""  # data: the receiver's own copy
        if prefix and data.data_type == AnalyticsDataType.METRIC:
            data.tag = prefix + data.tag
        elif prefix and data.data_type == AnalyticsDataType.METRICS:
            data.value = {prefix + key: value for key, value in data.value.items()}
        super().buffer_data(data, record_origin)
