"""FLARE's own PyTorch model persistor, published under a ``medflare.flare.`` class path with one argument."""

from __future__ import annotations

from typing import Any

from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor


class MedflareModelPersistor(PTFileModelPersistor):
    """FLARE's PTFileModelPersistor (saves FL_global_model.pt and best_FL_global_model.pt in the job's folder),
    with only the initial model to choose.

    It exists so that a pre-installed site allow-lists only medflare's own job components (one namespace,
    ``medflare.flare.``) instead of FLARE's PT persistor, which FLARE keeps off its default list: that one takes
    a checkpoint path to read (``source_ckpt_file_full_name``, optionally with ``load_weights_only=False``, i.e.
    pickle) and file names to write (``global_model_file_name``, absolute paths included). A job naming any of
    those here fails to build instead.

    Args:
        model: the initial network (FLARE builds it from the job's nested ``build_global_model`` config).
    """

    def __init__(self, model: Any = None) -> None:
        super().__init__(model=model)
