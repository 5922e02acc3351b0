"""What tokens cost: Codex token usage × a per-model price table, in micro-dollars.

Prices are USD per million tokens, so one USD/Mtok is exactly one micro-dollar per token and
the arithmetic stays exact in :class:`~decimal.Decimal` until the final ceiling.

Built-in prices are OpenAI's published list prices for a few models (as published in 2025;
check them against your invoice). ``budget.prices`` in config overrides or adds models. A model
with no price fails closed: the run is refused at gate 'budget'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from bothy.config import Price
from bothy.money import ceil_micros

_GPT5 = Price(
    input_per_mtok=Decimal("1.25"),
    cached_input_per_mtok=Decimal("0.125"),
    output_per_mtok=Decimal("10.00"),
)
_GPT5_MINI = Price(
    input_per_mtok=Decimal("0.25"),
    cached_input_per_mtok=Decimal("0.025"),
    output_per_mtok=Decimal("2.00"),
)
_GPT5_NANO = Price(
    input_per_mtok=Decimal("0.05"),
    cached_input_per_mtok=Decimal("0.005"),
    output_per_mtok=Decimal("0.40"),
)
BUILTIN_PRICES: Mapping[str, Price] = {
    "gpt-5": _GPT5,
    "gpt-5-codex": _GPT5,
    "gpt-5.1": _GPT5,
    "gpt-5.1-codex": _GPT5,
    "gpt-5-mini": _GPT5_MINI,
    "gpt-5.1-codex-mini": _GPT5_MINI,
    "gpt-5-nano": _GPT5_NANO,
}


@dataclass(frozen=True)
class TokenUsage:
    """Token counts, as Codex reports them: a thread's running totals, one response's, or
    (by difference) what a turn or a run used.

    ``input_tokens`` includes ``cached_input_tokens``; ``output_tokens`` includes reasoning.
    """

    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    reasoning_output_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def __add__(self, other: TokenUsage) -> TokenUsage:
        return TokenUsage(
            input_tokens=self.input_tokens + other.input_tokens,
            cached_input_tokens=self.cached_input_tokens + other.cached_input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            reasoning_output_tokens=self.reasoning_output_tokens + other.reasoning_output_tokens,
        )

    def since(self, earlier: TokenUsage) -> TokenUsage:
        """What was used between running totals ``earlier`` and these (never below zero)."""
        return TokenUsage(
            input_tokens=max(0, self.input_tokens - earlier.input_tokens),
            cached_input_tokens=max(0, self.cached_input_tokens - earlier.cached_input_tokens),
            output_tokens=max(0, self.output_tokens - earlier.output_tokens),
            reasoning_output_tokens=max(
                0, self.reasoning_output_tokens - earlier.reasoning_output_tokens),
        )

    @classmethod
    def from_codex(cls, breakdown: Mapping[str, Any]) -> TokenUsage:
        """Read a ``tokenUsage.total`` or ``.last`` object from ``thread/tokenUsage/updated``."""

        def count(key: str) -> int:
            value = breakdown.get(key, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"token usage field {key!r} is not a count: {value!r}")
            return value

        return cls(
            input_tokens=count("inputTokens"),
            cached_input_tokens=count("cachedInputTokens"),
            output_tokens=count("outputTokens"),
            reasoning_output_tokens=count("reasoningOutputTokens"),
        )


class PriceTable:
    """Built-in prices overlaid with the operator's ``budget.prices``."""

    def __init__(self, configured: Mapping[str, Price]) -> None:
        self._prices: dict[str, Price] = {**BUILTIN_PRICES, **configured}

    def lookup(self, model: str) -> Price | None:
        return self._prices.get(model)

    def cost_micros(self, price: Price, usage: TokenUsage) -> int:
        """Cost of ``usage`` at ``price``, rounded up to a whole micro-dollar."""
        cached = min(usage.cached_input_tokens, usage.input_tokens)
        uncached = usage.input_tokens - cached
        exact = (
            uncached * price.input_per_mtok
            + cached * price.cached_input_per_mtok
            + usage.output_tokens * price.output_per_mtok
        )
        return ceil_micros(Decimal(exact))
