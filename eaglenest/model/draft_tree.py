"""A drafting configuration (depth, branching, verified tokens): torch-free, so that the
workflow can name one evaluation job per configuration without loading the decoder
(rules/common.smk plans with no torch import). eaglenest.model.speculate decodes with it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Drafting:
    """One drafting configuration: depth, branching and the verified-token budget (root included)."""

    steps: int
    topk: int = 1
    tokens: int | None = None

    def __post_init__(self):
        if self.steps < 1 or self.topk < 1:
            raise ValueError(f"steps {self.steps} and topk {self.topk} must be >= 1")
        if self.tokens is None:
            object.__setattr__(self, "tokens", self.steps + 1 if self.topk == 1 else self.steps * self.topk + 1)
        if self.tokens < 2:
            raise ValueError(f"tokens {self.tokens} must be >= 2 (the root and at least one drafted token)")

    @property
    def name(self) -> str:
        return f"steps{self.steps}-topk{self.topk}-tokens{self.tokens}"

    @classmethod
    def from_dict(cls, values: dict) -> "Drafting":
        return cls(steps=int(values["steps"]), topk=int(values.get("topk", 1)), tokens=values.get("tokens"))
