"""FLARE's own PyTorch model persistor, published under a ``medflare.`` class path, adding the model's facts."""

from __future__ import annotations

from typing import Any

from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import ModelLearnable
from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor

from medflare.checkpoint import FACTS_KEY


class MedflareModelPersistor(PTFileModelPersistor):
    """FLARE's PTFileModelPersistor (saves FL_global_model.pt and best_FL_global_model.pt), plus the model's facts.

    It exists so that a pre-installed site allow-lists one prefix, ``medflare.``, instead of also opening
    FLARE's PT persistor, which FLARE deliberately keeps off its default allow-list. Every file it saves also
    carries ``facts`` (``medflare.checkpoint.checkpoint_facts``: method, model, task, normalisation, version)
    as a top-level ``"medflare"`` entry, which FLARE's format manager keeps beside the weights.

    Args:
        facts: the job's checkpoint facts (written into the job config by ``flare.job``).
        **kwargs: PTFileModelPersistor's arguments (``model``, file names, ...).
    """

    def __init__(self, facts: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.facts = facts

    def load_model(self, fl_ctx: FLContext) -> ModelLearnable:
        learnable = super().load_model(fl_ctx)
        if self.facts and self.persistence_manager is not None:
            self.persistence_manager.other_props[FACTS_KEY] = self.facts  # saved with every model file
        return learnable
