"""FLARE's own PyTorch model persistor, published under a ``medflare.flare.`` class path, adding the model's facts."""

from __future__ import annotations

from typing import Any

from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import ModelLearnable
from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor

from medflare.checkpoint import FACTS_KEY


class MedflareModelPersistor(PTFileModelPersistor):
    """FLARE's PTFileModelPersistor (saves FL_global_model.pt and best_FL_global_model.pt in the job's folder),
    with only the initial model and its facts to choose.

    It exists so that a pre-installed site allow-lists only medflare's own job components (one namespace,
    ``medflare.flare.``) instead of FLARE's PT persistor, which FLARE keeps off its default list: that one takes
    a checkpoint path to read (``source_ckpt_file_full_name``, optionally with ``load_weights_only=False``, i.e.
    pickle) and file names to write (``global_model_file_name``, absolute paths included). A job naming any of
    those here fails to build instead. Every file it saves also carries ``facts``
    (``medflare.checkpoint.checkpoint_facts``: method, model, task, normalisation, version) as a top-level
    ``"medflare"`` entry, which FLARE's format manager keeps beside the weights.

    Args:
        model: the initial network (FLARE builds it from the job's nested ``build_global_model`` config).
        facts: the job's checkpoint facts (plain values, written into the job config by ``job_export``).
    """

    def __init__(self, model: Any = None, facts: dict[str, Any] | None = None) -> None:
        super().__init__(model=model)
        self.facts = facts

    def load_model(self, fl_ctx: FLContext) -> ModelLearnable:
        learnable = super().load_model(fl_ctx)
        if self.facts and self.persistence_manager is not None:
            self.persistence_manager.other_props[FACTS_KEY] = self.facts  # saved with every model file
        return learnable
