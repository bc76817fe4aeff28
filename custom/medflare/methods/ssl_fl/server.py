"""SSL-FL server rule: the job's stages, and FedAvg weighted by every image in pre-training, by labels after."""

from __future__ import annotations

from medflare import contracts
from medflare.errors import PayloadError
from medflare.methods.base import RoundContext, ServerRule, SiteUpdate, Stage
from medflare.methods.ssl_fl.client import N_IMAGES
from medflare.methods.ssl_fl.model import UNLABELLED_STAGES


class SslFlRule(ServerRule):
    """FedAvg over the shared weights of each stage (the Payload decides which keys travel when).

    Pre-training learns from every image, labelled or not, so its sites are weighted by ``n_images`` (the
    paper's n_c, all images of a site); fine-tuning learns from labels, so by ``n_samples`` (labelled images).
    """

    def stages(self) -> list[Stage]:
        return self.cfg.stage_plan(self.total_rounds)

    def site_weight(self, update: SiteUpdate, ctx: RoundContext) -> float:
        if ctx.stage not in UNLABELLED_STAGES:
            return super().site_weight(update, ctx)
        images = update.meta.get(N_IMAGES)
        if images is None:
            raise PayloadError(f"a '{ctx.stage}' result must carry '{N_IMAGES}', its aggregation weight")
        labelled = float(update.meta.get(contracts.N_SAMPLES, 0))
        if float(images) < labelled:
            raise PayloadError(f"{N_IMAGES}={images:g} is fewer than the site's {labelled:g} labelled images")
        return float(images)
