"""Decoding of single image files into uint8 `[H, W, C]` arrays.

PNG/JPEG go through PIL. DICOM and NIfTI 2-D slices go through MONAI `LoadImage`, imported lazily so the optional
backends (pydicom, nibabel) are only needed by sites that actually hold such files.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from medflare.errors import DataError

PIL_SUFFIXES = (".png", ".jpg", ".jpeg")
DICOM_SUFFIXES = (".dcm",)
NIFTI_SUFFIXES = (".nii", ".nii.gz")
IMAGE_SUFFIXES = PIL_SUFFIXES + DICOM_SUFFIXES + NIFTI_SUFFIXES

# MONAI reader name and the pip package that backs it, per medical format.
_MONAI_BACKENDS = {
    DICOM_SUFFIXES: ("PydicomReader", "pydicom"),
    NIFTI_SUFFIXES: ("NibabelReader", "nibabel"),
}

# ITU-R 601-2 luma weights, the same as PIL's RGB -> L conversion.
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float64)


def is_image_file(path: str) -> bool:
    """Whether `path` has one of the supported image suffixes (case-insensitive)."""
    return path.lower().endswith(IMAGE_SUFFIXES)


def read_image(path: str, channels: int | None = None) -> np.ndarray:
    """Decodes one image file into uint8 `[H, W, channels]`.

    Grayscale is repeated to 3 channels and RGB is reduced to luma when `channels` asks for it; an alpha channel
    is dropped. `channels=None` keeps the file's own channel count (1 or 3).

    Raises:
        DataError: The file is missing, unreadable or not a 2-D image, or its reader backend is not installed.
    """
    if not os.path.isfile(path):
        raise DataError(f"Image file '{path}' does not exist; fix the path or remove the entry.")
    lower = path.lower()
    try:
        if lower.endswith(PIL_SUFFIXES):
            pixels = _read_with_pil(path)
        elif lower.endswith(DICOM_SUFFIXES + NIFTI_SUFFIXES):
            pixels = _read_with_monai(path)
        else:
            raise DataError(f"Image file '{path}' has an unsupported suffix; use one of {', '.join(IMAGE_SUFFIXES)}.")
    except DataError:
        raise
    except Exception as err:  # PIL/MONAI raise many unrelated types for a broken file
        raise DataError(
            f"Cannot decode image file '{path}' ({type(err).__name__}: {err}); replace or remove the file."
        ) from err
    return to_channels(pixels, channels)


def to_channels(pixels: np.ndarray, channels: int | None) -> np.ndarray:
    """Converts uint8 `[H, W]` or `[H, W, C]` (C in 1, 3, 4) to uint8 `[H, W, channels]` (None = keep C)."""
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if pixels.shape[-1] == 4:
        pixels = pixels[:, :, :3]
    have = pixels.shape[-1]
    if channels is None or have == channels:
        return np.ascontiguousarray(pixels)
    if have == 1 and channels == 3:
        return np.repeat(pixels, 3, axis=2)
    if have == 3 and channels == 1:
        luma = pixels.astype(np.float64) @ _LUMA
        return np.clip(np.rint(luma), 0, 255).astype(np.uint8)[:, :, None]
    raise DataError(f"Cannot convert an image with {have} channels to {channels}.")


def rescale_to_uint8(pixels: np.ndarray) -> np.ndarray:
    """Maps any numeric array to uint8 by per-image min-max scaling (constant images become 0)."""
    if pixels.dtype == np.uint8:
        return pixels
    values = pixels.astype(np.float64)
    low, high = float(values.min()), float(values.max())
    if high <= low:
        return np.zeros(values.shape, dtype=np.uint8)
    return np.rint((values - low) * (255.0 / (high - low))).astype(np.uint8)


def _read_with_pil(path: str) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        image.load()  # force full decoding here, so a truncated file fails now and not inside a DataLoader
        if image.mode in ("I;16", "I;16B", "I;16L"):
            # 16-bit grayscale: PIL's convert("L") clips at 255, so scale the full range instead.
            return (np.asarray(image, dtype=np.uint16) // 257).astype(np.uint8)
        if image.mode in ("I", "F"):
            return rescale_to_uint8(np.asarray(image))
        if image.mode not in ("L", "RGB", "RGBA"):
            image = image.convert("RGBA" if "A" in image.mode or "transparency" in image.info else "RGB")
        return np.asarray(image, dtype=np.uint8)


def _read_with_monai(path: str) -> np.ndarray:
    lower = path.lower()
    reader, package = next(backend for suffixes, backend in _MONAI_BACKENDS.items() if lower.endswith(suffixes))
    if importlib.util.find_spec(package) is None:
        raise DataError(
            f"Reading '{path}' needs the optional package '{package}', which is not installed; "
            f"run `pip install {package}` on this site."
        )
    from monai.transforms import LoadImage

    volume = np.asarray(LoadImage(image_only=True, reader=reader)(path))
    volume = np.squeeze(volume)
    if volume.ndim == 3 and volume.shape[-1] in (3, 4):
        rgb = True
    elif volume.ndim == 2:
        rgb = False
    else:
        raise DataError(
            f"Image file '{path}' has shape {volume.shape}; medflare reads 2-D slices only. "
            "Extract the slices you want to classify into separate files first."
        )
    # MONAI puts the x (column) axis first; swap to the row-major [H, W] layout that PIL uses.
    volume = np.swapaxes(volume, 0, 1)
    if rgb:
        return rescale_to_uint8(volume[:, :, :3])
    return rescale_to_uint8(volume)
