"""Who the workers are: the public WorkerInfo and the addresses a worker publishes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_NAME = re.compile(r"^[A-Za-z0-9_:\-.]{1,127}$")


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker of the job: its unique ``name`` and its ``id`` (the rank)."""

    id: int
    name: str

    def __str__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


@dataclass(frozen=True, slots=True)
class WorkerAddress:
    """What a worker publishes at rendezvous: identity and where to reach it."""

    name: str
    rank: int
    host: str
    addresses: dict[str, str] = field(default_factory=dict)  # scheme -> address

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(self.rank, self.name)

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "rank": self.rank,
            "host": self.host,
            "addresses": dict(self.addresses),
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> WorkerAddress:
        addresses = data["addresses"]
        assert isinstance(addresses, dict)
        return cls(
            str(data["name"]),
            int(str(data["rank"])),
            str(data["host"]),
            {str(k): str(v) for k, v in addresses.items()},
        )


def validate_name(name: object) -> str:
    """Return ``name`` if it is a legal worker name, else raise ValueError."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"invalid worker name {name!r}: use 1-127 letters, digits, '_', ':', '-' or '.'"
        )
    return name
