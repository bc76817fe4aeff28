"""Visual tokenizers of Fed-BEiT: a discrete VAE trained federatedly (the offline default) and DALL-E's dVAE
encoder read from a local file. Both map an image to one token id per ViT patch, row by row over the patch grid."""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from medflare.errors import ConfigError, DataError

DALLE_VOCAB = 8192
DALLE_DOWNSAMPLE = 8  # the DALL-E encoder halves the resolution three times
DALLE_PIXEL_EPS = 0.1  # DALL-E's map_pixels: x * (1 - 2 eps) + eps
# medflare's transforms map pixels to [-1, 1] (mean 0.5, std 0.5); DALL-E wants [0, 1].
DATA_MEAN, DATA_STD = 0.5, 0.5


class DiscreteVae(nn.Module):
    """A small discrete VAE: a convolutional encoder gives logits over ``vocab`` codes per patch, a Gumbel-softmax picks
    (softly) codebook vectors, and a convolutional decoder reconstructs the image. The role BEiT's "customized" dVAE
    plays (spec §4(a)), sized for CPU sites: the encoder halves the resolution ``log2(patch)`` times, so one token
    covers exactly one ViT patch. Trained in the job's "tokenizer" stage on every site's unlabelled images, then frozen.
    Two choices keep the codebook in use after a short stage (without them 10-14 of 512 codes carried every patch of
    PneumoniaMNIST after 20 steps, perplexity 1.5-3): a channel LayerNorm (``GroupNorm(1, hidden)``) before the code
    logits, so the logits follow what differs between patches rather than the features' common all-positive part, and
    ``usage_weight`` x KL(batch-averaged q || uniform), the codebook-diversity term of the VQ literature (wav2vec 2.0's
    diversity loss), which spreads the codes over a batch while each patch may still pick one sharply. Both are
    FedAvg-safe: every site optimises the same loss, no code is re-seeded from one site's data. ``patch`` (the ViT's)
    must be a power of two; ``hidden`` is the convolution width, ``code_dim`` the codebook vector width."""

    def __init__(self, channels: int, patch: int, vocab: int, hidden: int, code_dim: int) -> None:
        super().__init__()
        steps = int(math.log2(patch))
        if 2**steps != patch:
            raise ConfigError(f"the dVAE tokenizer needs a power-of-two patch size, got {patch}")
        down: list[nn.Module] = []
        for step in range(steps):
            down += [nn.Conv2d(channels if step == 0 else hidden, hidden, 4, stride=2, padding=1), nn.ReLU()]
        width = channels if steps == 0 else hidden
        self.encoder = nn.Sequential(
            *down, nn.Conv2d(width, hidden, 3, padding=1), nn.ReLU(), nn.GroupNorm(1, hidden), nn.Conv2d(hidden, vocab, 1)
        )
        self.codebook = nn.Embedding(vocab, code_dim)
        up: list[nn.Module] = []
        for _ in range(steps):
            up += [nn.ConvTranspose2d(hidden, hidden, 4, stride=2, padding=1), nn.ReLU()]
        self.decoder = nn.Sequential(nn.Conv2d(code_dim, hidden, 1), nn.ReLU(), nn.Conv2d(hidden, hidden, 3, padding=1),
                                     nn.ReLU(), *up, nn.Conv2d(hidden, channels, 1))
        self.vocab = vocab
        self.temperature = 1.0  # Gumbel-softmax temperature; the trainer anneals it over the tokenizer stage

    def loss(self, images: torch.Tensor, kl_weight: float = 0.0, usage_weight: float = 0.0) -> torch.Tensor:
        """See :meth:`loss_and_codes`."""
        return self.loss_and_codes(images, kl_weight, usage_weight)[0]

    def loss_and_codes(self, images: torch.Tensor, kl_weight: float = 0.0,
                       usage_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstruction MSE through a Gumbel-softmax code choice, plus ``kl_weight`` x the mean per-patch
        KL(q || uniform) (DALL-E's term) and ``usage_weight`` x KL(mean of q over the batch's patches || uniform)
        (codebook usage); and the hard codes ``[B, N]`` of the batch (what :meth:`tokens` would give)."""
        logits = self.encoder(images)
        soft_codes = F.gumbel_softmax(logits, tau=self.temperature, dim=1)
        vectors = torch.einsum("bvhw,vd->bdhw", soft_codes, self.codebook.weight)
        loss = F.mse_loss(self.decoder(vectors), images)
        log_q = F.log_softmax(logits, dim=1)
        if kl_weight > 0:
            kl = (log_q.exp() * (log_q + math.log(self.vocab))).sum(dim=1).mean()
            loss = loss + kl_weight * kl
        if usage_weight > 0:
            average = log_q.exp().mean(dim=(0, 2, 3))
            loss = loss + usage_weight * (average * (average.clamp_min(1e-12).log() + math.log(self.vocab))).sum()
        return loss, logits.detach().argmax(dim=1).flatten(1)

    @torch.no_grad()
    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        """int64 ``[B, N]``: the most likely code of every patch."""
        return self.encoder(images).argmax(dim=1).flatten(1)


def code_usage(counts: torch.Tensor) -> tuple[int, float]:
    """(codes used, perplexity) of a histogram of token ids: the number of codes with a nonzero count, and
    exp of the entropy of the histogram (1 when one code carries everything, the vocabulary size at uniform)."""
    counts = counts.double()
    total = counts.sum()
    if total <= 0:
        return 0, 0.0
    p = counts[counts > 0] / total
    return int((counts > 0).sum()), float(torch.exp(-(p * p.log()).sum()))


class _DalleConv(nn.Module):
    """A 'same' convolution whose parameters are named ``w`` and ``b``, the layout of DALL-E's weight files."""

    def __init__(self, n_in: int, n_out: int, kernel: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_out, n_in, kernel, kernel) / math.sqrt(n_in * kernel**2))
        self.b = nn.Parameter(torch.zeros(n_out))
        self.padding = (kernel - 1) // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.w, self.b, padding=self.padding)


class _DalleBlock(nn.Module):
    """Residual block: identity (or 1x1 projection) plus the residual path scaled by 1 / layers^2."""

    def __init__(self, n_in: int, n_out: int, layers: int) -> None:
        super().__init__()
        hidden = n_out // 4
        self.id_path = _DalleConv(n_in, n_out, 1) if n_in != n_out else nn.Identity()
        self.res_path = nn.Sequential(OrderedDict([
            ("relu_1", nn.ReLU()), ("conv_1", _DalleConv(n_in, hidden, 3)),
            ("relu_2", nn.ReLU()), ("conv_2", _DalleConv(hidden, hidden, 3)),
            ("relu_3", nn.ReLU()), ("conv_3", _DalleConv(hidden, hidden, 3)),
            ("relu_4", nn.ReLU()), ("conv_4", _DalleConv(hidden, n_out, 1)),
        ]))
        self.post_gain = 1.0 / layers**2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.id_path(x) + self.post_gain * self.res_path(x)


class DalleEncoder(nn.Module):
    """The architecture of OpenAI DALL-E's dVAE encoder (4 groups of 2 blocks, width 256, 8192 codes), with the
    state-dict keys of its published weights, so a converted ``encoder.pkl`` loads into it (Ramesh et al., ICML
    2021, https://github.com/openai/DALL-E, MIT)."""

    def __init__(self, hidden: int = 256, groups: int = 4, blocks_per_group: int = 2, vocab: int = DALLE_VOCAB) -> None:
        super().__init__()
        layers = groups * blocks_per_group
        stages: list[tuple[str, nn.Module]] = [("input", _DalleConv(3, hidden, 7))]
        width = hidden
        for group in range(1, groups + 1):
            out = hidden * 2 ** (group - 1)
            members: list[tuple[str, nn.Module]] = [
                (f"block_{i + 1}", _DalleBlock(width if i == 0 else out, out, layers)) for i in range(blocks_per_group)
            ]
            if group < groups:
                members.append(("pool", nn.MaxPool2d(kernel_size=2)))
            stages.append((f"group_{group}", nn.Sequential(OrderedDict(members))))
            width = out
        stages.append(("output", nn.Sequential(OrderedDict([("relu", nn.ReLU()), ("conv", _DalleConv(width, vocab, 1))]))))
        self.blocks = nn.Sequential(OrderedDict(stages))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Code logits ``[B, vocab, H/8, W/8]`` of RGB images already mapped with DALL-E's ``map_pixels``."""
        return self.blocks(pixels)


class DalleTokenizer(nn.Module):
    """Frozen DALL-E tokens for BEiT from a local encoder file (:func:`load_dalle_encoder`): images are resized to
    ``8 * grid`` pixels so that one code covers one ViT patch (BEiT: 112 px for 14 x 14)."""

    def __init__(self, path: str | Path, grid: int) -> None:
        super().__init__()
        self.encoder = load_dalle_encoder(path)
        self.vocab = int(self.encoder.blocks.output.conv.w.shape[0])
        self.size = DALLE_DOWNSAMPLE * grid
        for parameter in self.encoder.parameters():
            parameter.requires_grad_(False)
        self.eval()

    @torch.no_grad()
    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        """int64 ``[B, N]`` codes of medflare-normalised images (1 or 3 channels)."""
        pixels = (images * DATA_STD + DATA_MEAN).clamp(0.0, 1.0)
        if pixels.shape[1] == 1:
            pixels = pixels.expand(-1, 3, -1, -1)
        pixels = F.interpolate(pixels, size=(self.size, self.size), mode="bicubic", align_corners=False).clamp(0, 1)
        mapped = (1 - 2 * DALLE_PIXEL_EPS) * pixels + DALLE_PIXEL_EPS
        return self.encoder(mapped.float()).argmax(dim=1).flatten(1)


def load_dalle_encoder(path: str | Path) -> DalleEncoder:
    """The DALL-E encoder from a local state-dict file (``weights_only=True``), width and vocabulary read off the file;
    DataError for a missing file or one whose keys or shapes are not the encoder's. OpenAI publishes ``encoder.pkl``, a
    pickled module that needs their ``dall_e`` package to unpickle. Convert it once where that package is installed:
    ``torch.save(dall_e.load_model("encoder.pkl").state_dict(), "dalle_encoder.pt")``."""
    from medflare.models import read_state_dict_file

    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"DALL-E encoder weights not found: {file}. Every site needs the same file at this path")
    state = read_state_dict_file(file)
    width, vocab = state.get("blocks.input.w"), state.get("blocks.output.conv.w")
    encoder = DalleEncoder(hidden=width.shape[0], vocab=vocab.shape[0]) if width is not None and vocab is not None else None
    expected = encoder.state_dict() if encoder is not None else {}
    wrong = sorted(set(expected) ^ set(state)) or [k for k in expected if expected[k].shape != state[k].shape]
    if wrong:
        raise DataError(f"{file} is not a DALL-E encoder state dict (first mismatching keys: {wrong[:3]}); convert "
                        "encoder.pkl with torch.save(dall_e.load_model('encoder.pkl').state_dict(), PATH)")
    assert encoder is not None
    encoder.load_state_dict(state)
    return encoder
