"""Adapter versions in one running engine: which LoRA adapters are loaded, which requests use
which, which must migrate and which can be unloaded. Pure bookkeeping: no vLLM, no clock.

Under a LoRA trainer a weight version is a PEFT adapter directory (shared/adapters.py).
The engine loads each new one beside those in flight (vLLM `add_lora`, no pause):

    table.add(version, path)             # loaded; new requests now take it
    v = table.acquire()                  # a request starts on the newest version (0 = the base)
    table.release(v)                     # ... and ends
    table.stale(max_staleness)           # versions whose requests must migrate (partial rollout)
    table.unloadable()                   # loaded, not the newest, nothing in flight on them

Version 0 is the base model, which needs no adapter. A version's vLLM LoRA id is version + 1
(vLLM reserves 0).

Multi-LoRA: a version may hold one adapter per agent role (`v%06d/<role>/`,
shared/checkpoint.role_adapters). All of a version's role adapters load together; a request
names its role (`Generate.adapter`, from its session's metadata) and runs on that role's
adapter of the version it took: `table.path(v, role)`, vLLM id `lora_id(v, slot)` with the
role's slot in the version's sorted roles.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


MAX_ROLES = 256  # role adapters one version may hold: they share its block of vLLM LoRA ids
_ROLE_IDS = 1 << 30  # multi-LoRA ids start here, above any single adapter's version + 1


def lora_id(version: int, slot: int | None = None) -> int:
    """vLLM's int id (never 0) of version `version`'s adapter, or of its `slot`-th role's (multi-LoRA)."""
    return version + 1 if slot is None else _ROLE_IDS + version * MAX_ROLES + slot


@dataclass
class AdapterTable:
    newest: int = 0  # the version new requests take
    paths: dict[int, str] = field(default_factory=dict)  # loaded adapters: version -> dir
    inflight: Counter[int] = field(default_factory=Counter)  # version -> requests running on it
    roles: dict[int, tuple[str, ...]] = field(default_factory=dict)  # multi-LoRA versions: their roles, sorted

    def add(self, version: int, path: str, roles: tuple[str, ...] = ()) -> None:
        if version <= self.newest and self.paths:
            raise ValueError(f"adapter version {version} is not newer than {self.newest}")
        if len(roles) > MAX_ROLES:
            raise ValueError(f"{len(roles)} role adapters in one version; at most {MAX_ROLES}")
        self.paths[version] = path
        if roles:
            self.roles[version] = tuple(sorted(roles))
        self.newest = version

    def adapter(self, version: int, role: str = "") -> tuple[int, str] | None:
        """(vLLM id, dir) of the adapter a request of `role` runs with on `version`; None for the base,
        or for a role the version has no adapter for (a multi-LoRA version, the request's role unknown)."""
        path = self.paths.get(version)
        if path is None:
            return None
        roles = self.roles.get(version)
        if roles is None:
            return lora_id(version), path
        if role not in roles:
            return None
        return lora_id(version, roles.index(role)), f"{path}/{role}"

    def acquire(self) -> int:
        self.inflight[self.newest] += 1
        return self.newest

    def release(self, version: int) -> None:
        self.inflight[version] -= 1
        if self.inflight[version] <= 0:
            del self.inflight[version]

    def path(self, version: int) -> str | None:
        """The adapter dir a request on `version` runs with; None for the base."""
        return self.paths.get(version)

    def stale(self, max_staleness: int) -> list[int]:
        """Versions in flight more than `max_staleness` behind the newest (-1: never)."""
        if max_staleness < 0:
            return []
        return sorted(v for v in self.inflight if self.newest - v > max_staleness)

    def unloadable(self) -> list[int]:
        """Loaded adapters that are not the newest and have nothing in flight: no request can take
        them again (new requests take the newest), so they are safe to remove."""
        return sorted(v for v in self.paths if v != self.newest and v not in self.inflight)

    def remove(self, version: int) -> None:
        self.paths.pop(version, None)
        self.roles.pop(version, None)

    def ids(self, version: int) -> list[int]:
        """The vLLM ids a loaded version holds: one, or one per role."""
        if version not in self.roles:
            return [lora_id(version)]
        return [lora_id(version, slot) for slot in range(len(self.roles[version]))]
