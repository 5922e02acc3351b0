"""Money as integer micro-dollars: budget arithmetic must be exact, never floats."""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_HALF_UP, Decimal

MICROS_PER_USD = 1_000_000


def usd_to_micros(usd: Decimal) -> int:
    """Convert a configured USD amount to micro-dollars (half-up below a micro-dollar)."""
    return int((usd * MICROS_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))


def ceil_micros(amount: Decimal) -> int:
    """Round a measured cost up to a whole micro-dollar: spend is never under-counted."""
    return int(amount.to_integral_value(rounding=ROUND_CEILING))


def format_usd(micros: int, places: int = 2) -> str:
    """``format_usd(52_000_000) == '52.00'``; ``format_usd(19_900, 4) == '0.0199'``."""
    quantum = Decimal(1).scaleb(-places)
    value = (Decimal(micros) / MICROS_PER_USD).quantize(quantum, rounding=ROUND_HALF_UP)
    return f"{value:.{places}f}"
