"""FLARE's TensorBoard receiver under a ``medflare.flare.`` class path (the only ones pre-installed sites allow)."""

from __future__ import annotations

from medflare.flare.tracking import TB_FOLDER, receiver_base


class TensorBoardReceiver(
    receiver_base("nvflare.app_opt.tracking.tb.tb_receiver", "TBAnalyticsReceiver", "tensorboard")  # type: ignore[misc]
):
    """FLARE's ``TBAnalyticsReceiver``: one TensorBoard folder per sender under the server's ``tb_events/`` (a job
    may not choose where the server writes), the server's with the global curves, each site's with what it streams
    (:data:`medflare.flare.tracking.SITE_STREAMED_TAGS`). Without ``tensorboard`` it logs one line, records nothing.

    Args:
        events: the analytics events to record (FLARE's default: local and federated).
    """

    def __init__(self, events: list[str] | None = None) -> None:
        super().__init__(tb_folder=TB_FOLDER, events=events)
