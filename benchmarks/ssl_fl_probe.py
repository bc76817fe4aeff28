"""Linear probe of exported SSL-FL encoders: how much do their pooled features say about the label?

A diagnostic for the SSL-FL benchmark (docs/benchmarks.md, section SSL-FL). Each encoder file (``encoder.pt``
of a pre-training job) is frozen; its features (``fc_norm`` of the mean patch token, what fine-tuning and
Fed-MAS's prior start from) are computed for a random draw of training images and the whole test split; a
logistic regression fitted on the training features is scored on the test features (balanced accuracy). The
same ViT with freshly drawn weights is the reference: an encoder whose probe is below it starts fine-tuning
from a worse place than no pre-training. The spread of the features across images (mean over dimensions of
their standard deviation) shows a collapse: features that hardly change from image to image.

Usage:
    python benchmarks/ssl_fl_probe.py runs/bench-ssl-fl-b20/fed-mae-pt-pneumonia-a100-s0/encoder.pt ... \
        [--dataset pneumonia] [--train-images 1500] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import balanced_accuracy_score

from medflare.data.checksums import verify_medmnist_file
from medflare.data.transforms import NORMALISE_MEAN, NORMALISE_STD
from medflare.methods.ssl_fl.export import EncoderFeatures, EncoderInfo, load_encoder
from medflare.models.vit import build_vit, vit_size

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "medmnist"
DATASETS = {"retina": "retinamnist.npz", "pneumonia": "pneumoniamnist.npz"}


def images_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 ``[N, H, W(, C)]`` -> medflare-normalised float ``[N, C, H, W]``."""
    x = torch.from_numpy(images).float().div(255)
    x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
    return (x - NORMALISE_MEAN) / NORMALISE_STD


@torch.no_grad()
def features(encoder: EncoderFeatures, images: torch.Tensor, batch: int = 256) -> np.ndarray:
    return torch.cat([encoder(images[i : i + batch]) for i in range(0, len(images), batch)]).numpy()


def probe(encoder: EncoderFeatures, train: tuple[torch.Tensor, np.ndarray], test: tuple[torch.Tensor, np.ndarray]) -> dict[str, float]:
    """Balanced accuracy of a logistic regression on frozen features, and the features' spread across images."""
    train_features, test_features = features(encoder, train[0]), features(encoder, test[0])
    classifier = LogisticRegression(max_iter=2000).fit(train_features, train[1])
    return {"probe_balanced_accuracy": float(balanced_accuracy_score(test[1], classifier.predict(test_features))),
            "feature_std": float(train_features.std(axis=0).mean())}


def fresh_like(info: EncoderInfo, seed: int) -> EncoderFeatures:
    """The ViT an encoder file describes, with newly drawn weights (the no-pre-training reference)."""
    torch.manual_seed(seed)
    network = build_vit(vit_size(info.model), num_classes=1, in_channels=info.in_channels, image_size=info.image_size,
                        patch_size=info.patch_size, layer_scale=1.0 if info.layer_scale else None)
    return EncoderFeatures(network, info).eval()


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("encoders", nargs="+", help="encoder.pt files of SSL-FL pre-training jobs")
    parser.add_argument("--dataset", choices=list(DATASETS), default="pneumonia")
    parser.add_argument("--train-images", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = DATA_DIR / DATASETS[args.dataset]
    verify_medmnist_file(path)
    data = np.load(path)
    draw = np.random.default_rng(args.seed).choice(len(data["train_images"]), args.train_images, replace=False)
    train = (images_tensor(data["train_images"][draw]), data["train_labels"][draw].ravel())
    test = (images_tensor(data["test_images"]), data["test_labels"].ravel())
    rows = []
    for file in args.encoders:
        encoder, info = load_encoder(file)
        rows.append({"encoder": file, **probe(encoder, train, test)})
    rows.append({"encoder": f"fresh weights (seed {args.seed})", **probe(fresh_like(info, args.seed), train, test)})
    print("| encoder | probe balanced accuracy | feature std across images |\n|---|---|---|")
    for row in rows:
        print(f"| {row['encoder']} | {row['probe_balanced_accuracy']:.3f} | {row['feature_std']:.4f} |")
    return rows


if __name__ == "__main__":
    main()
