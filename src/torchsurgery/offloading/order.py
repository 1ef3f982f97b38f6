"""Recording the order groups run in, to prefetch the next ones along it.

Groups do not always run in creation order (encoder-decoder models, shared blocks,
conditional branches). The first forward records the actual sequence; later forwards
prefetch the groups that followed the current one last time. A group that runs out of
the recorded order is simply not prefetched (a miss, brought in on demand), and the
recording is refreshed from that forward on.
"""

from __future__ import annotations


class OrderRecorder:
    """The sequence of group names seen in the last complete forward.

    Example:
        >>> order = OrderRecorder()
        >>> for name in ["embed", "h.0", "h.1", "head"]:
        ...     order.ran(name)
        >>> order.end_forward()
        >>> order.ahead("h.0", 2)
        ['h.1', 'head']
    """

    def __init__(self) -> None:
        self._recorded: list[str] = []
        self._current: list[str] = []
        self.misses = 0

    @property
    def recorded(self) -> list[str]:
        """The last complete forward's order (empty before the first one ends)."""
        return list(self._recorded)

    def ran(self, name: str) -> None:
        """Note that group ``name`` is running now."""
        if self._recorded:
            position = len(self._current)
            if position >= len(self._recorded) or self._recorded[position] != name:
                self.misses += 1
        self._current.append(name)

    def end_forward(self) -> None:
        """Close the current forward; its order becomes the one to prefetch along."""
        if self._current:
            self._recorded = self._current
        self._current = []

    def ahead(self, name: str, count: int) -> list[str]:
        """The ``count`` groups that followed this occurrence of ``name`` last time."""
        if count <= 0 or not self._recorded:
            return []
        # the occurrence of ``name`` matching how often it has run in this forward
        seen = self._current.count(name)
        positions = [i for i, n in enumerate(self._recorded) if n == name]
        if not positions:
            return []
        start = positions[min(max(seen - 1, 0), len(positions) - 1)] + 1
        return self._recorded[start : start + count]
