"""The job's class names, which every site's data must match: the data contract's names.

A folder source numbers its classes by the sorted folder names, so two hospitals that spell one class differently
(``normal`` and ``Normal``) would number the same classes differently and train one class as another. A job whose
task names its classes therefore makes each site compare its own names with the job's, in one line that lists
both, before anything trains. A site may map its own spellings to the job's names in its
``local/medflare_site.json`` (``{"data": {"class_map": {"Normal": "normal"}}}``); its labels are then renumbered
into the job's order (a multi-label site's columns reordered). Data that does not name its classes (a MedMNIST
file, a CSV with numeric labels only) is taken in the job's order, as before.

Names are compared in Unicode NFC (:func:`same_form`): a folder written on macOS spells "é" as "e" and a combining
accent (NFD), a plan as one character, and both name one class. A name holding a control character or a format
character that is invisible (U+200B) or reorders the text (U+202E shows "lamron" as "normal") is refused
(:func:`class_names_refusal`): it would read as another name in the console, the predictions and report.md.
"""

from __future__ import annotations

import dataclasses
import unicodedata
from collections.abc import Mapping, Sequence

import numpy as np

from medflare.data.types import UNLABELED, DataSplits, ImageSet
from medflare.errors import DataError

CLASS_MAP_KEY = "class_map"  # a site's data block: its own class names -> the job's
# The joiners shape letters (Persian, Indic scripts, emoji); every other format character is invisible (U+200B) or
# reorders the text around it (the bidirectional controls, U+202E): with control characters, refused in a name
JOINERS = frozenset("\u200c\u200d")


def _hidden(character: str) -> bool:
    category = unicodedata.category(character)
    return category == "Cc" or (category == "Cf" and character not in JOINERS)


def same_form(name: str) -> str:
    """``name`` in Unicode NFC, the form class names are compared in (NFD "e" + U+0301 and NFC "é" are one name)."""
    return unicodedata.normalize("NFC", str(name))


def class_names_refusal(names: Sequence[str]) -> str:
    """Why ``names`` cannot name a job's classes ("" when they can): a name holding a control character or an
    invisible or bidirectional format character (a joiner excepted), or two names that are one in NFC. Names are
    shown escaped (``ascii``), so the two spellings of one name print differently."""
    for name in names:
        hidden = sorted({c for c in str(name) if _hidden(c)})
        if hidden:
            codes = ", ".join(f"U+{ord(c):04X}" for c in hidden)
            return (f"the class name {ascii(str(name))} holds {codes} (a control, invisible or right-to-left "
                    "character: the name would show as another); rename the class")
    forms = [same_form(name) for name in names]
    repeated = next((name for name, form in zip(names, forms) if forms.count(form) > 1), None)
    if repeated is not None:
        spellings = [ascii(str(name)) for name, form in zip(names, forms) if form == same_form(repeated)]
        return (f"{' and '.join(spellings)} are one class name in Unicode NFC (the same letters, composed or not); "
                "give each class its own name")
    return ""


def align_to_job(splits: DataSplits, job_names: Sequence[str] | None, class_map: Mapping[str, str] | None,
                 where: str) -> DataSplits:
    """``splits`` with its labels in the job's class order.

    Args:
        splits: a loaded source; its ``info["class_names"]`` count when ``info["named_classes"]`` says the data
            names its classes.
        job_names: the job's class names in label order (``task.class_names``); None: the job names none.
        class_map: the site's own name -> the job's name, for the names that differ (only the site sets it).
        where: the site, for the message.

    Raises:
        DataError: the site's names (after ``class_map``) are not the job's, or ``class_map`` names a class the
            data does not have or maps two classes to one.
    """
    site_names = list(splits.info["class_names"]) if splits.info.get("named_classes") else None
    if class_map and site_names is None:
        raise DataError(f"{where}: class_map is set, but the data names no classes (folder names, a CSV's "
                        "class_name or label_<name> columns); remove class_map")
    if not job_names or site_names is None:
        return splits
    job_names = [same_form(name) for name in job_names]
    mapped = [same_form(name) for name in _mapped_names(site_names, dict(class_map or {}), where)]
    if sorted(mapped) != sorted(job_names):
        mapping = f" (after class_map: {mapped})" if class_map else ""
        raise DataError(f"{where}: this site's classes {site_names}{mapping} are not the job's {list(job_names)}; "
                        'rename the class folders, or map each of the site\'s names to the job\'s in its local/'
                        'medflare_site.json, e.g. {"data": {"class_map": {"' + _first_difference(mapped, job_names)
                        + '": "<the job\'s name>"}}}')
    order = np.array([job_names.index(name) for name in mapped], dtype=np.int64)
    if np.array_equal(order, np.arange(len(order))) and site_names == job_names:
        return splits
    sets = {split: _relabelled(getattr(splits, split), order) for split in ("train", "val", "test")}
    return DataSplits(**sets, info={**splits.info, "class_names": list(job_names)})


def _mapped_names(site_names: list[str], class_map: dict[str, str], where: str) -> list[str]:
    """The site's names with ``class_map`` applied; every key must be one of them, no two may become one."""
    forms = {same_form(name): name for name in site_names}  # a class_map key in either form names the site's class
    class_map = {forms.get(same_form(key), key): value for key, value in class_map.items()}
    unknown = sorted(set(class_map) - set(site_names))
    if unknown:
        raise DataError(f"{where}: class_map names {unknown}, which are not among this site's classes {site_names}")
    mapped = [str(class_map.get(name, name)) for name in site_names]
    if len(set(mapped)) != len(mapped):
        raise DataError(f"{where}: class_map makes two of this site's classes one: {site_names} -> {mapped}")
    return mapped


def _first_difference(mapped: list[str], job_names: Sequence[str]) -> str:
    """A site name that is not one of the job's (for the example in the message)."""
    return next((name for name in mapped if name not in job_names), mapped[0])


def _relabelled(image_set: ImageSet, order: np.ndarray) -> ImageSet:
    """``image_set`` with site class k as job class ``order[k]``: single labels renumbered (unlabelled kept),
    multi-hot columns moved."""
    labels = np.asarray(image_set.labels)
    if labels.ndim == 2:
        moved = np.empty_like(labels)
        moved[:, order] = labels
        return dataclasses.replace(image_set, labels=moved)
    renumbered = np.where(labels == UNLABELED, UNLABELED, order[np.clip(labels, 0, None)])
    return dataclasses.replace(image_set, labels=renumbered.astype(labels.dtype))
