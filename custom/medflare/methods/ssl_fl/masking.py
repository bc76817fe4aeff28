"""Which patches a masked-image-modelling step hides: MAE's random masking and BEiT's block-wise masking (pure
torch/numpy). Patches are numbered row by row over the ViT's patch grid, the order of the patch tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from medflare.errors import ConfigError

#: BEiT's block-wise masking places blocks of at least 16 patches on its 14 x 14 grid; smaller grids scale this.
BEIT_MIN_BLOCK_PER_196 = 16
BEIT_MIN_ASPECT = 0.3
BLOCK_ATTEMPTS = 10  # tries to place one block before giving up on the current mask


@dataclass(frozen=True)
class RandomMask:
    """A per-sample random mask of MAE."""

    keep: torch.Tensor  # int64 [B, V]: indices of the visible patches, in the order the encoder sees them
    restore: torch.Tensor  # int64 [B, N]: where patch j sits in [visible..., masked...] (unshuffles the decoder input)
    masked: torch.Tensor  # float [B, N]: 1 for a masked patch, 0 for a visible one


def random_mask(batch: int, num_patches: int, ratio: float, device: torch.device | str = "cpu") -> RandomMask:
    """Hide ``num_patches - int(num_patches * (1 - ratio))`` random patches of every sample independently: each
    draws uniform noise per patch and the smallest stay visible (MAE). A ratio that leaves none or masks nothing
    is refused."""
    visible = int(num_patches * (1.0 - ratio))
    if not 0 < visible < num_patches:
        raise ConfigError(f"mask_ratio {ratio} leaves {visible} of {num_patches} patches visible; use a ratio in (0, 1)")
    shuffle = torch.argsort(torch.rand(batch, num_patches, device=device), dim=1)
    restore = torch.argsort(shuffle, dim=1)
    masked = torch.ones(batch, num_patches, device=device)
    masked[:, :visible] = 0.0
    return RandomMask(keep=shuffle[:, :visible], restore=restore, masked=torch.gather(masked, 1, restore))


def beit_mask_count(num_patches: int, ratio: float) -> int:
    """Patches BEiT masks per image: ``round(ratio * N / 5) * 5`` (0.4 of 196 -> 80), at most N - 1, at least 1."""
    return min(max(int(round(ratio * num_patches / 5)) * 5, 1), num_patches - 1)


class BlockMaskGenerator:
    """BEiT's block-wise masking on a square ``grid``: rectangles of random area and aspect ratio until ``count``
    patches (:func:`beit_mask_count`) are masked. Each block has a target area drawn uniformly between ``min_block`` (0
    = 16 patches per 196, scaled to the grid) and the patches still to mask, and an aspect ratio drawn log-uniformly in
    ``[min_aspect, 1/min_aspect]``; it is placed at a random position and accepted when it masks at least one new patch
    without exceeding ``count``. After ``BLOCK_ATTEMPTS`` failed placements in a row the mask is returned as it is (BEiT
    does the same), so a mask never exceeds ``count``."""

    def __init__(self, grid: int, count: int, min_block: int = 0, min_aspect: float = BEIT_MIN_ASPECT) -> None:
        if not 0 < count < grid * grid:
            raise ConfigError(f"block masking of {count} patches on a {grid}x{grid} grid; mask between 1 and {grid * grid - 1}")
        self.grid, self.count = grid, count
        self.min_block = min_block or max(1, round(BEIT_MIN_BLOCK_PER_196 * grid * grid / 196))
        self.log_aspect = (math.log(min_aspect), math.log(1.0 / min_aspect))

    def __call__(self, rng: np.random.Generator) -> np.ndarray:
        """One bool ``[grid * grid]`` mask, True where a patch is masked."""
        mask = np.zeros((self.grid, self.grid), dtype=bool)
        done = 0
        while done < self.count:
            added = self._place_block(mask, self.count - done, rng)
            if added == 0:
                break
            done += added
        return mask.reshape(-1)

    def batch(self, size: int, rng: np.random.Generator) -> torch.Tensor:
        """A bool ``[size, grid * grid]`` tensor of independent masks."""
        return torch.from_numpy(np.stack([self(rng) for _ in range(size)]))

    def _place_block(self, mask: np.ndarray, budget: int, rng: np.random.Generator) -> int:
        """Mask one block of at most ``budget`` new patches; returns how many it added (0 if none fitted)."""
        low, high = sorted((self.min_block, budget))
        for _ in range(BLOCK_ATTEMPTS):
            area = rng.uniform(low, high)
            aspect = math.exp(rng.uniform(*self.log_aspect))
            height = int(round(math.sqrt(area * aspect)))
            width = int(round(math.sqrt(area / aspect)))
            if not (0 < height < self.grid and 0 < width < self.grid):
                continue
            top = int(rng.integers(0, self.grid - height + 1))
            left = int(rng.integers(0, self.grid - width + 1))
            block = mask[top : top + height, left : left + width]
            added = height * width - int(block.sum())
            if 0 < added <= budget:
                block[...] = True
                return added
        return 0
