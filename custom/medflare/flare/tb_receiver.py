"""FLARE's TensorBoard receiver, published under a ``medflare.flare.`` class path.

Pre-installed sites allow-list only ``medflare.flare.`` classes, so a job names this class rather than FLARE's.
Without ``tensorboard`` on the server the job still runs: the receiver logs one line and records nothing.
"""

from __future__ import annotations

from medflare.flare.tracking import TB_FOLDER, receiver_base


class TensorBoardReceiver(
    receiver_base("nvflare.app_opt.tracking.tb.tb_receiver", "TBAnalyticsReceiver", "tensorboard")  # type: ignore[misc]
):
    """FLARE's ``TBAnalyticsReceiver``: one TensorBoard folder per sender under the server's ``tb_events/``.

    The server's folder holds the global curves (pooled, per-site and site-mean validation and test metrics, shares,
    round times); each site's folder its own: training loss per local epoch and per round, training seconds, lr and
    the validation metrics of each model it received (:data:`medflare.flare.tracking.SITE_STREAMED_TAGS`).

    It takes no folder: a job may not choose where the server writes (always ``tb_events/`` in the job folder).

    Args:
        events: the analytics events to record (FLARE's default: local and federated).
    """

    def __init__(self, events: list[str] | None = None) -> None:
        super().__init__(tb_folder=TB_FOLDER, events=events)
