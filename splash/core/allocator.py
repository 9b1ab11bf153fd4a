"""Page allocators: the controller's single source of truth for every rank's KV pages."""

from __future__ import annotations

from splash.errors import ConfigError


class PageAllocator:
    """Free list of one rank's physical pages. ``reserved`` pages are held back for state the
    current layout keeps beside the KV pool (replicated projections), so capacity follows the
    layout: a sharded-projection layout lends them to KV."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ConfigError(f"a rank needs at least one KV page, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self.reserved = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_available(self) -> int:
        """Pages that can still be handed out under the current reservation."""
        return max(len(self._free) - self.reserved, 0)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_available:
            raise MemoryError(f"need {n} pages, {self.num_available} available")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)


class RankAllocators:
    """One allocator per rank, with all-or-nothing multi-rank allocation."""

    def __init__(self, world: int, num_pages: int) -> None:
        self.ranks = [PageAllocator(num_pages) for _ in range(world)]

    def __getitem__(self, rank: int) -> PageAllocator:
        return self.ranks[rank]

    def can_allocate(self, need: list[int]) -> bool:
        return all(n <= a.num_available for n, a in zip(need, self.ranks))

    def allocate(self, need: list[int]) -> list[list[int]]:
        if not self.can_allocate(need):
            raise MemoryError("not enough pages")
        return [a.allocate(n) for n, a in zip(need, self.ranks)]

    def set_reserved(self, pages: int) -> None:
        for a in self.ranks:
            a.reserved = pages

    def used(self) -> list[int]:
        return [a.num_used for a in self.ranks]
