"""Money as integer micro-dollars: budget arithmetic must be exact, never floats."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from decimal import Decimal

MICROS_PER_USD = 1_000_000
_MICRO_PLACES = 6  # the digits after the point that a micro-dollar amount holds


def usd_to_micros(usd: Decimal) -> int:
    """Convert a configured USD amount to micro-dollars (half-up below a micro-dollar)."""
    from decimal import ROUND_HALF_UP  # (the amount is a Decimal: the module is loaded)

    return int((usd * MICROS_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))


def ceil_micros(amount: Decimal) -> int:
    """Round a measured cost up to a whole micro-dollar: spend is never under-counted."""
    from decimal import ROUND_CEILING

    return int(amount.to_integral_value(rounding=ROUND_CEILING))


def format_usd(micros: int, places: int = 2) -> str:
    """``format_usd(52_000_000) == '52.00'``; ``format_usd(19_900, 4) == '0.0199'``.

    Rounded half up (away from zero), as ``Decimal.quantize(ROUND_HALF_UP)`` would, in
    integers: ``bothy status`` shows money without importing ``decimal``.
    """
    sign = "-" if micros < 0 else ""
    shown = abs(micros)
    if places < _MICRO_PLACES:
        step = 10 ** (_MICRO_PLACES - places)
        shown, left = divmod(shown, step)
        shown += 1 if left * 2 >= step else 0
    else:
        shown *= 10 ** (places - _MICRO_PLACES)
    whole, fraction = divmod(shown, 10**places)
    return f"{sign}{whole}.{fraction:0{places}d}" if places else f"{sign}{whole}"
