"""Which adapter each device slot holds, by name: the scheduler's view of the adapters.

A request naming an adapter takes its slot; its prefix-cache entries are keyed by the adapter's
name and load generation, so an adapter loaded again under the same name (other weights) never
reads KV computed with the old ones. An unloaded adapter's slot is reused only once no
unfinished request holds it (the caller says which slots are held).
"""

from __future__ import annotations

from collections.abc import Callable

from fulcrum.config import LoRAConfig


class LoRARegistry:
    def __init__(self, config: LoRAConfig) -> None:
        self.config = config
        # slot -> (name, directory, generation); slot 0 is the base model and holds nothing
        self._slots: list[tuple[str, str, int] | None] = [None] * (config.num_slots + 1)
        self._generation = 0
        for i, (name, path) in enumerate(config.adapters, start=1):
            self.assign(i, name, path)

    def slot(self, name: str) -> int:
        """The adapter's slot; ValueError naming the served adapters if there is none."""
        for i, held in enumerate(self._slots):
            if held is not None and held[0] == name:
                return i
        served = ", ".join(self.adapters()) or "none"
        raise ValueError(f"lora: no adapter named {name!r} (served: {served}).")

    def cache_salt(self, name: str) -> str:
        """The prefix-cache key part of requests that run the adapter ``name``."""
        held = self._slots[self.slot(name)]
        assert held is not None
        return f"lora:{name}#{held[2]}"

    def adapters(self) -> dict[str, str]:
        """name -> directory of every adapter served now, in slot order."""
        return {held[0]: held[1] for held in self._slots if held is not None}

    def free_slot(self, name: str, held_by_requests: Callable[[int], bool]) -> int:
        """A slot ``name`` may be loaded into; ValueError naming the field if ``name`` is
        served already or every slot holds an adapter or a running request's."""
        if any(held is not None and held[0] == name for held in self._slots):
            raise ValueError(f"lora_name: an adapter named {name!r} is loaded already; "
                             "unload it first to load other weights under that name.")  # fmt: skip
        for i in range(1, len(self._slots)):
            if self._slots[i] is None and not held_by_requests(i):
                return i
        taken = len(self._slots) - 1
        raise ValueError(
            f"max_loras: all {taken} adapter slots are in use (adapters, or requests still "
            "running an unloaded one); unload an adapter, or start with a larger max_loras."
        )

    def assign(self, slot: int, name: str, path: str) -> None:
        self._generation += 1
        self._slots[slot] = (name, path, self._generation)

    def remove(self, name: str) -> int:
        """Forget ``name`` (requests already running it finish with it); its slot."""
        slot = self.slot(name)
        self._slots[slot] = None
        return slot
