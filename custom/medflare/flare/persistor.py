"""FLARE's own PyTorch model persistor, published under a ``medflare.flare.`` class path, building the job's initial
model from its plan and saving the model's facts with every file."""

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
    """FLARE's PTFileModelPersistor (saves FL_global_model.pt and best_FL_global_model.pt in the job's folder),
    whose initial model and facts come from the job's plan.

    It exists so that a pre-installed site allow-lists only medflare's own job components (one namespace,
    ``medflare.flare.``) instead of FLARE's PT persistor, which FLARE keeps off its default list: that one takes
    a checkpoint path to read (``source_ckpt_file_full_name``, optionally with ``load_weights_only=False``, i.e.
    pickle) and file names to write (``global_model_file_name``, absolute paths included). A job naming any of
    those here fails to build instead. Every file it saves also carries the plan's facts
    (``medflare.checkpoint.checkpoint_facts``: method, model, task, normalisation, version) as a top-level
    ``"medflare"`` entry, which FLARE's format manager keeps beside the weights.

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
