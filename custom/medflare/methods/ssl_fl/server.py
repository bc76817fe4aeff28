"""SSL-FL server rule: the job's stages, and FedAvg weighted by every image in pre-training, by labels after."""

from __future__ import annotations

from typing import Any, Mapping

from medflare import contracts
from medflare.errors import ConfigError, PayloadError
from medflare.methods.base import RoundContext, ServerRule, SiteUpdate, Stage
from medflare.methods.ssl_fl.client import CODE_PERPLEXITY, CODES_USED, N_IMAGES
from medflare.methods.ssl_fl.model import PRETRAIN, UNLABELLED_STAGES
from medflare.ops.influence import Weighting, bound

MEAN_PERPLEXITY = "code_perplexity_mean"  # round record: the sites' perplexities, weighted by their images
# exp of an entropy over n codes is at most n; float rounding of a uniform histogram may overshoot by ~1e-13
PERPLEXITY_ROUNDING = 1e-9


def code_statistics_refusal(meta: Mapping[str, Any], codebook: int) -> str:
    """Why a site's code statistics are none a histogram over ``codebook`` codes can have ("" when they can, or
    when it sent none): both or neither of them, 1 <= codes used <= codebook (a whole number), and
    1 <= perplexity <= codes used (exp of the entropy of a histogram over that many codes)."""
    sent = [key for key in (CODES_USED, CODE_PERPLEXITY) if key in meta]
    if not sent:
        return ""
    if len(sent) == 1:
        return f"fed-beit: a result carries '{sent[0]}' without its pair; a site sends {CODES_USED} and {CODE_PERPLEXITY}"
    used, perplexity = float(meta[CODES_USED]), float(meta[CODE_PERPLEXITY])
    if not used.is_integer() or not 1 <= used <= codebook:
        return f"fed-beit: '{CODES_USED}' is {used:g}, not a whole number of codes in 1..{codebook} (method.vocab_size)"
    if not 1.0 <= perplexity <= used * (1 + PERPLEXITY_ROUNDING):
        return (f"fed-beit: '{CODE_PERPLEXITY}' is {perplexity:g}, outside 1..{used:g} (the codes it used of the "
                f"{codebook}-code book: exp of an entropy over {used:g} codes is at most {used:g})")
    return ""


class SslFlRule(ServerRule):
    """FedAvg over the shared weights of each stage (the Payload decides which keys travel when). Pre-training learns
    from every image, labelled or not, so its sites are weighted by ``n_images`` (the paper's n_c, all images of a
    site); fine-tuning learns from labels, so by ``n_samples`` (labelled images)."""

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

    def check_update(self, phase: str, update: SiteUpdate, ctx: RoundContext) -> None:
        """Fed-BEiT's code statistics bounded by the job's codebook (:func:`code_statistics_refusal`): one site's
        perplexity of 1e8 would pass a collapsed tokenizer's floor check."""
        refusal = code_statistics_refusal(update.meta, int(getattr(self.cfg, "vocab_size", 0)))
        if refusal:
            raise PayloadError(refusal)

    def round_info(self, updates: list[SiteUpdate], ctx: RoundContext) -> dict[str, Any]:
        """Fed-BEiT: each site's codes used and code perplexity, and their image-weighted mean perplexity, each
        site's weight capped at the job's share cap (``robust.max_share``) as in the model's aggregate, so no one
        site's image count stops a healthy job or passes a collapsed tokenizer. ConfigError in pre-training (whose
        targets are the final tokenizer's tokens) for a mean below ``min_code_perplexity``: nearly constant targets
        teach the encoder nothing."""
        reported = [u for u in updates if CODE_PERPLEXITY in u.meta]
        if not reported:
            return {}
        weights = {u.site: float(u.meta.get(N_IMAGES, 1.0)) for u in reported}
        shares = bound(Weighting(weights), self.share_cap).sites if sum(weights.values()) > 0 else \
            dict.fromkeys(weights, 1.0 / len(weights))
        mean = sum(shares[u.site] * float(u.meta[CODE_PERPLEXITY]) for u in reported)
        info = {CODES_USED: {u.site: u.meta[CODES_USED] for u in reported},
                CODE_PERPLEXITY: {u.site: u.meta[CODE_PERPLEXITY] for u in reported}, MEAN_PERPLEXITY: mean}
        floor = float(getattr(self.cfg, "min_code_perplexity", 0.0))
        if ctx.stage == PRETRAIN and mean < floor:
            raise ConfigError(f"fed-beit: the tokenizer's visual tokens have perplexity {mean:.2f} on the sites' images "
                              f"(codes used per site: {sorted(info[CODES_USED].values())}), below "
                              f"method.min_code_perplexity={floor:g}; train the tokenizer longer "
                              "(method.tokenizer_rounds), raise method.dvae_usage_weight, or set "
                              "method.min_code_perplexity=0 to accept it")
        return info
