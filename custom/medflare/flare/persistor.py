"""FLARE's own PyTorch model persistor under a ``medflare.flare.`` class path, its initial model from the job's plan."""

from __future__ import annotations

from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import ModelLearnable
from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor

from medflare.checkpoint import FACTS_KEY, checkpoint_facts
from medflare.errors import MedflareError
from medflare.flare.models import global_model_of
from medflare.flare.tasks import deployed_plan
from medflare.plan import PLAN_FILE


class MedflareModelPersistor(PTFileModelPersistor):
    """FLARE's PTFileModelPersistor (FL_global_model.pt and best_FL_global_model.pt in the job's folder), whose
    initial model and facts come from the job's plan.

    Sites then allow-list only ``medflare.flare.`` components, not FLARE's PT persistor, which takes a checkpoint
    path to read (``source_ckpt_file_full_name``, possibly pickled) and file names to write (absolute paths too): a
    job naming those here fails to build. Every file it saves carries the plan's facts
    (``medflare.checkpoint.checkpoint_facts``) as a top-level ``"medflare"`` entry beside the weights.

    Args:
        plan_file: the job's plan in its ``app/config`` folder (``medflare_plan.json``, :mod:`medflare.plan`).
    """

    def __init__(self, plan_file: str = PLAN_FILE) -> None:
        super().__init__()
        self.plan_file = plan_file
        self.facts: dict | None = None

    def _initialize(self, fl_ctx: FLContext) -> None:
        try:
            plan = deployed_plan(fl_ctx, self.plan_file)[0]
            self.model = global_model_of(plan)
        except MedflareError as exc:
            self.system_panic(f"medflare: the persistor cannot build the job's initial model: {exc}", fl_ctx)
            return
        self.facts = checkpoint_facts(plan)
        super()._initialize(fl_ctx)

    def load_model(self, fl_ctx: FLContext) -> ModelLearnable:
        learnable = super().load_model(fl_ctx)
        if self.facts and self.persistence_manager is not None:
            self.persistence_manager.other_props[FACTS_KEY] = self.facts  # saved with every model file
        return learnable
