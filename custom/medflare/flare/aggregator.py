"""The server-side FLARE aggregator: validates every incoming update, then applies the method's ServerRule."""

from __future__ import annotations

from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.aggregator import Aggregator

from medflare.errors import MedflareError
from medflare.flare.tasks import deployed_plan
from medflare.plan import PLAN_FILE, RunPlan
from medflare.server_round import INFO, SHARES, STREAM_INFO, RoundAggregation


class MedflareAggregator(Aggregator):
    """FLARE Aggregator adapter over :class:`RoundAggregation`, built when the job starts from ``plan_file`` (the
    job's plan in its ``app/config`` folder, :mod:`medflare.plan`); one instance serves every method."""

    holds_plaintext = True  # the server can read and save the global model (False: flare.he.EncryptedAggregator)
    core_cls: type[RoundAggregation] = RoundAggregation  # the FLARE-free round it drives

    def __init__(self, plan_file: str = PLAN_FILE) -> None:
        super().__init__()
        self.plan_file = plan_file
        self._core: RoundAggregation | None = None
        self._fallback_logged = False

    def use_plan(self, plan: RunPlan) -> MedflareAggregator:
        """Build the round core of ``plan`` (at START_RUN from the job's plan file; a test may hand one in)."""
        self._core = self.core_cls.of_plan(plan)
        return self

    @property
    def core(self) -> RoundAggregation:
        if self._core is None:
            raise MedflareError("the aggregator has no plan yet (it loads the job's plan when the job starts)")
        return self._core

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN and self._core is None:
            try:
                self.use_plan(deployed_plan(fl_ctx, self.plan_file)[0])
            except MedflareError as exc:
                self.system_panic(f"medflare: the aggregator cannot load the job's plan: {exc}", fl_ctx)

    def accept(self, shareable: Shareable, fl_ctx: FLContext) -> bool:
        site = shareable.get_peer_prop(ReservedKey.IDENTITY_NAME, default="?")
        if self.core.awaits_site_list():
            self._expect_registered_sites(fl_ctx)
        try:
            dxo = from_shareable(shareable)
            kind = "diff" if dxo.data_kind == DataKind.WEIGHT_DIFF else "weights"
            reason = self.core.accept(site, dxo.data or {}, dxo.meta or {}, kind)
        except Exception as exc:  # a result that is not even a DXO is a rejected update, not a crash
            reason = f"not a valid DXO: {exc}"
            self.core.rejected[site] = reason
        if reason:
            self.log_warning(fl_ctx, f"round {self.core.ctx.round + 1}: REJECTED update from {site}: {reason}. "
                                     "The round goes on without it; check that site's log.")
            return False
        return True

    def _expect_registered_sites(self, fl_ctx: FLContext) -> None:
        """The train task goes to every site registered when it is sent (FLARE's ``targets=None``), so those
        registered at the first result are its senders (a later registration only delays results to aggregation)."""
        try:
            self.core.expect_sites(client.name for client in fl_ctx.get_engine().get_clients())
        except Exception as exc:  # noqa: BLE001 - the results then wait for the aggregation: more memory, same sum
            self.log_warning(fl_ctx, f"stream_aggregation: cannot read FLARE's client list ({exc}); this round's "
                                     "results are held until its aggregation")

    def aggregate(self, fl_ctx: FLContext) -> Shareable:
        result = self.core.aggregate()
        streaming = result.info.get(STREAM_INFO, {})
        if streaming.get("mode") == "batch" and not self._fallback_logged:
            self._fallback_logged = True
            self.log_warning(fl_ctx, f"stream_aggregation is on, but this job aggregates in one batch: "
                                     f"{streaming['reason']} (each round's record says so too)")
        elif streaming.get("in_site_order") is False:
            self.log_warning(fl_ctx, f"round {self.core.ctx.round + 1}: a site outside the task's targets was "
                                     "added out of site order; this round's aggregate may not repeat bit for bit")
        return DXO(DataKind.WEIGHTS, data=result.params, meta={SHARES: result.shares, INFO: result.info}).to_shareable()
