"""The job's class names, which every site's data must match: the data contract's names.

A folder source numbers its classes by the sorted folder names, so two hospitals that spell one class differently
(``normal`` and ``Normal``) would number the same classes differently and train one class as another. A job whose
task names its classes therefore makes each site compare its own names with the job's, in one line that lists
both, before anything trains. A site may map its own spellings to the job's names in its
``local/medflare_site.json`` (``{"data": {"class_map": {"Normal": "normal"}}}``); its labels are then renumbered
into the job's order (a multi-label site's columns reordered). Data that does not name its classes (a MedMNIST
file, a CSV with numeric labels only) is taken in the job's order, as before.

Every job names its classes: from the data its lead points at, ``task.class_names``, or, for a job on site data
whose lead gave none, the placeholder ``<class 1>``, ``<class 2>``, ... that every site refuses until it is filled.
A site may hold a subset of the job's classes (numbered in the job's order, with a note naming the missing ones),
and leave out a class of its own with ``{"class_map": {"cardiomegaly": null}}`` (those images are never read).

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

CLASS_MAP_KEY = "class_map"  # a site's data block: its own class names -> the job's (null: leave the class out)
PLACEHOLDER = "<class {}>"  # a site-data job's class name k (1-based) when its lead named none; sites refuse it
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


def left_out_classes(class_map: Mapping[str, str | None] | None) -> list[str]:
    """The site's classes its ``class_map`` leaves out (mapped to null): a folder or CSV source skips them unread
    (``load_source(left_out=...)``)."""
    return [name for name, job_name in (class_map or {}).items() if job_name is None]


def placeholder_class_names(num_classes: int) -> list[str]:
    """The names a job on site data carries when its lead gave none: ``<class 1>`` .. ``<class K>``. Every site
    refuses them (:func:`placeholder_refusal`) until the lead sets ``task.class_names`` or exports from data."""
    return [PLACEHOLDER.format(k + 1) for k in range(int(num_classes))]


def placeholder_refusal(job_names: Sequence[str] | None, where: str) -> str:
    """Why a site refuses a job whose class names are the placeholder ("" when they are not)."""
    if not job_names or not all(str(name) == PLACEHOLDER.format(k + 1) for k, name in enumerate(job_names)):
        return ""
    return (f"{where}: the job's class names are the placeholder {list(job_names)}; the lead sets them in label "
            "order (--set 'task.class_names=[\"normal\",\"pneumonia\"]' on medflare export) and exports the "
            "job again")  # not --data folder:DIR: a job naming the lead's data is refused at every hospital


def unnamed_job_refusal(site_names: Sequence[str], where: str) -> str:
    """Why a site whose data names its classes refuses a job that names none."""
    return (f"{where}: the job names no classes but this site's data names {list(site_names)}; the lead adds "
            "them in label order (--set 'task.class_names=[...]') and exports the job again")


def align_to_job(splits: DataSplits, job_names: Sequence[str] | None, class_map: Mapping[str, str | None] | None,
                 where: str) -> DataSplits:
    """``splits`` with its labels in the job's class order; the site may hold a subset of the job's classes.

    Args:
        splits: a loaded source; its ``info["class_names"]`` count when ``info["named_classes"]`` says the data
            names its classes.
        job_names: the job's class names in label order (``task.class_names``); None: no job to check against.
        class_map: the site's own name -> the job's name, for the names that differ, or None to leave that class
            out (a folder or CSV source skipped it unread, ``info["left_out"]``; a plugin's rows are dropped
            here, before any image is decoded); only the site sets it.
        where: the site, for the message.

    Returns:
        The splits in the job's order with ``num_classes`` the job's; ``info["class_notes"]`` holds one line per
        job class the site lacks and per class left out (preflight's WARN rows, the site log).

    Raises:
        DataError: the job's names are the placeholder, the site has a class the job lacks (after ``class_map``),
            or ``class_map`` names a class the data does not have or maps two classes to one.
    """
    refusal = placeholder_refusal(job_names, where)
    if refusal:
        raise DataError(refusal)
    site_names = list(splits.info["class_names"]) if splits.info.get("named_classes") else None
    if class_map and site_names is None:
        raise DataError(f"{where}: class_map is set, but the data names no classes (folder names, a CSV's "
                        "class_name or label_<name> columns); remove class_map")
    if site_names is None:
        return _unnamed_in_job_order(splits, job_names, where)
    skipped = dict(splits.info.get("left_out", {}))  # class_map's null classes the loader skipped unread
    mapped = _mapped_names(site_names, dict(class_map or {}), skipped, where)
    splits, notes = _left_out(splits, site_names, mapped, skipped, where)
    absent = set(_absent(splits, site_names))  # a class id naming no image (a CSV's job-order ids with a gap)
    mapped = [None if site in absent else name for site, name in zip(site_names, mapped)]
    if not job_names:  # no job (preflight's view of the site's own data): the site's names, less those left out
        if not notes and None not in mapped:
            return splits
        mapped = [None if name is None else site for site, name in zip(site_names, mapped)]
        job_names = [name for name in mapped if name is not None]
    kept = [same_form(name) for name in mapped if name is not None]
    job_names = [same_form(name) for name in job_names]
    extra = [name for name in kept if name not in job_names]
    if extra:
        mapping = f" (after class_map: {kept})" if class_map else ""
        raise DataError(f"{where}: this site's classes {site_names}{mapping} are not among the job's "
                        f"{list(job_names)}; rename the class folders, map each of the site's names to the job's "
                        'in its local/medflare_site.json, e.g. {"data": {"class_map": {"' + extra[0]
                        + '": "<the job\'s name>"}}}, or leave a class out with {"' + extra[0] + '": null}')
    missing = [name for name in job_names if name not in kept]
    if missing:
        notes.append(_missing_note(missing, where))
    order = np.array([UNLABELED if name is None else job_names.index(same_form(name)) for name in mapped],
                     dtype=np.int64)  # site class id -> the job's (a left-out class has no rows left)
    if not notes and np.array_equal(order, np.arange(len(order))) and site_names == job_names:
        return splits
    sets = {split: _relabelled(getattr(splits, split), order, len(job_names)) for split in ("train", "val", "test")}
    return DataSplits(**sets, info={**splits.info, "class_names": list(job_names), "class_notes": notes})


def _unnamed_in_job_order(splits: DataSplits, job_names: Sequence[str] | None, where: str) -> DataSplits:
    """Data that names no classes (MedMNIST, a CSV of label ids) read in the job's order: its ids must be below
    the job's class count; a job class no image carries is named in a note (the site holds a subset)."""
    if not job_names:
        return splits
    found = splits.train.num_classes  # multi-label: columns, which cannot be widened to the job's
    if found > len(job_names) or (splits.train.multi_label and found != len(job_names)):
        raise DataError(f"{where}: this site's labels go up to {found - 1} but the job has "
                        f"{len(job_names)} classes {list(job_names)}; relabel the data with the job's ids "
                        f"0..{len(job_names) - 1}, in the job's order")
    missing = _absent(splits, job_names)
    if splits.train.num_classes == len(job_names) and not missing:
        return splits
    sets = {split: dataclasses.replace(getattr(splits, split), num_classes=len(job_names))
            for split in ("train", "val", "test")}
    return DataSplits(**sets, info={**splits.info, "class_names": list(job_names),
                                    "class_notes": [_missing_note(missing, where)] if missing else []})


def _absent(splits: DataSplits, job_names: Sequence[str]) -> list[str]:
    """The job's classes no labelled image of ``splits`` carries (single-label data; multi-label: none)."""
    labels = [np.asarray(getattr(splits, split).labels) for split in ("train", "val", "test")]
    if labels[0].ndim == 2:
        return []
    every = np.concatenate(labels)
    counts = np.bincount(every[every != UNLABELED], minlength=len(job_names))
    return [name for name, count in zip(job_names, counts) if count == 0]


def _missing_note(missing: Sequence[str], where: str) -> str:
    return (f"{where}: this site holds no images of the job's class(es) {', '.join(missing)}; it trains on the "
            "others, numbered in the job's order (add images of them to contribute them)")


def _left_out(splits: DataSplits, site_names: list[str], mapped: list[str | None], skipped: Mapping[str, int],
              where: str) -> tuple[DataSplits, list[str]]:
    """``splits`` without the classes ``class_map`` maps to None, and a note saying how many images were left out;
    the labels still number the site's classes. ``skipped``: the left-out classes a folder or CSV loader never
    listed (name -> images), so none of their images was read; a plugin's are dropped here, before any is decoded."""
    dropped = [k for k, name in enumerate(mapped) if name is None]
    if not dropped:
        return splits, [_skipped_note(skipped, 0, [], where)] if skipped else []
    if len(dropped) == len(mapped):
        raise DataError(f"{where}: class_map leaves out every class of this site ({site_names}); keep at least one")
    if splits.train.multi_label:
        raise DataError(f"{where}: class_map cannot leave out a class of multi-label data (an image may hold it "
                        "with others); remove its label_<name> column from the manifest instead")
    sets, left = {}, 0
    for split in ("train", "val", "test"):
        image_set = getattr(splits, split)
        keep = ~np.isin(np.asarray(image_set.labels), dropped)
        left += int((~keep).sum())
        sets[split] = image_set.subset(np.flatnonzero(keep))
    return DataSplits(**sets, info=splits.info), [_skipped_note(skipped, left, [site_names[k] for k in dropped],
                                                                where)]


def _skipped_note(skipped: Mapping[str, int], dropped: int, dropped_names: list[str], where: str) -> str:
    """The line naming the classes ``class_map`` leaves out and how many images they hold."""
    names = ", ".join([*skipped, *dropped_names])
    return (f"{where}: class_map leaves out {names}: {sum(skipped.values()) + dropped} image(s) neither trained "
            "nor checked (map a class to one of the job's names to train on it)")


def _mapped_names(site_names: list[str], class_map: dict[str, str | None], skipped: Mapping[str, int],
                  where: str) -> list[str | None]:
    """The site's names with ``class_map`` applied (None: left out); every key must be one of them (or a class the
    loader ``skipped``), no two may become one."""
    forms = {same_form(name): name for name in [*site_names, *skipped]}  # a key in either form names the class
    class_map = {forms.get(same_form(key), key): value for key, value in class_map.items()}
    unknown = sorted(set(class_map) - set(site_names) - set(skipped))
    if unknown:
        raise DataError(f"{where}: class_map names {unknown}, which are not among this site's classes {site_names}")
    mapped = [None if name in class_map and class_map[name] is None else str(class_map.get(name, name))
              for name in site_names]
    kept = [name for name in mapped if name is not None]
    if len(set(kept)) != len(kept):
        raise DataError(f"{where}: class_map makes two of this site's classes one: {site_names} -> {mapped}")
    return mapped


def _relabelled(image_set: ImageSet, order: np.ndarray, num_classes: int) -> ImageSet:
    """``image_set`` with site class k as job class ``order[k]`` among ``num_classes``: single labels renumbered
    (unlabelled kept; the rows of a left-out class are gone already), multi-hot columns moved (a job class the site
    lacks: not annotated)."""
    labels = np.asarray(image_set.labels)
    if labels.ndim == 2:
        moved = np.full((len(labels), num_classes), UNLABELED, dtype=labels.dtype)
        moved[:, order] = labels
        return dataclasses.replace(image_set, labels=moved, num_classes=num_classes)
    renumbered = np.where(labels == UNLABELED, UNLABELED, order[np.clip(labels, 0, None)])
    return dataclasses.replace(image_set, labels=renumbered.astype(labels.dtype), num_classes=num_classes)
