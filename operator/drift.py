"""Does a live object already hold what we would apply? A pure, semantic comparison.

Server-side apply of an unchanged object is a no-op on the server, but it is still a request; the
operator compares first so a resync of a converged deployment sends no write at all. Only the
fields we render are compared ("desired is a subset of live"): the API server adds defaults, and
other controllers and people may add fields we do not own.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")
_SUFFIX = {
    None: Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
# Keys whose string values are resource quantities, which the API server rewrites in canonical
# form ("0.5" becomes "500m", "1024Mi" becomes "1Gi").
_QUANTITY_PARENTS = frozenset({"limits", "requests"})
_QUANTITY_KEYS = frozenset({"sizeLimit"})


def parse_quantity(text: str) -> Decimal | None:
    """A Kubernetes quantity as a number, or None when ``text`` is not one."""
    match = _QUANTITY.match(text)
    if match is None:
        return None
    try:
        return Decimal(match.group(1)) * _SUFFIX[match.group(2)]
    except InvalidOperation:
        return None


def _same_quantity(desired: Any, live: Any) -> bool:
    if isinstance(desired, str) and isinstance(live, str):
        a, b = parse_quantity(desired), parse_quantity(live)
        return a is not None and a == b
    return bool(desired == live)


def first_difference(desired: Any, live: Any, path: str = "", parent_key: str = "") -> str | None:
    """The path of the first rendered field that ``live`` lacks or holds differently; None when covered.

    Maps: every desired key must match (extra live keys are fine). An empty desired map or list
    matches an absent one (the server drops empty containers). Lists: same length, item by item
    (Kubernetes lists we render are ordered and fully ours).
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return path or "."
        for key, value in desired.items():
            sub = f"{path}.{key}" if path else key
            if key not in live:
                if value in ({}, []):
                    continue
                return sub
            if key in _QUANTITY_KEYS or parent_key in _QUANTITY_PARENTS:
                if not _same_quantity(value, live[key]):
                    return sub
                continue
            found = first_difference(value, live[key], sub, key)
            if found is not None:
                return found
        return None
    if isinstance(desired, list):
        if not isinstance(live, list) or len(desired) != len(live):
            return path or "."
        for index, (d, v) in enumerate(zip(desired, live, strict=True)):
            found = first_difference(d, v, f"{path}[{index}]", parent_key)
            if found is not None:
                return found
        return None
    if desired == live and type(desired) is type(live):
        return None
    # JSON has one number type: 1 and 1.0 are the same value on the wire.
    if isinstance(desired, int | float) and isinstance(live, int | float) and not isinstance(desired, bool):
        return None if desired == live else path
    return path or "."
