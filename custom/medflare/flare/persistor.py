"""FLARE's own PyTorch model persistor, published under a ``medflare.`` class path."""

from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor


class MedflareModelPersistor(PTFileModelPersistor):
    """Exactly FLARE's PTFileModelPersistor (saves FL_global_model.pt and best_FL_global_model.pt).

    It exists so that a pre-installed site allow-lists only medflare's own job components (one namespace,
    ``medflare.flare.``) instead of also opening FLARE's PT persistor, which FLARE keeps off its default list.
    """
