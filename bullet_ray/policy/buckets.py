"""Prompt-length buckets that split when crowded and merge when sparse (after BucketServe).

Prompts of similar length batch well: padding-free kernels still waste less when the attention work of a
batch's prompts is alike, and a short prompt does not wait behind a long one's step. The buckets are
half-open length ranges [bounds[k], bounds[k + 1]). `rebalance` looks at the queue's lengths: a bucket
holding more than `split_above` prompts over a range wider than 2 x `min_width` splits at its median
length; two neighbours holding fewer than `merge_below` prompts together merge. At most `max_buckets`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from bullet_ray.errors import ConfigError

DEFAULT_BOUNDS = (0, 256, 1024, 4096)


class LengthBuckets:
    def __init__(self, bounds: Sequence[int] = DEFAULT_BOUNDS, split_above: int = 16, merge_below: int = 2,
                 min_width: int = 32, max_buckets: int = 16) -> None:
        if not bounds or bounds[0] != 0 or list(bounds) != sorted(set(bounds)):
            raise ConfigError("bucket_bounds", f"need strictly ascending lengths starting at 0, got {list(bounds)}")
        if split_above < 2 or merge_below < 1 or min_width < 1 or max_buckets < 1:
            raise ConfigError("buckets", f"split_above >= 2, merge_below >= 1, min_width >= 1, max_buckets >= 1; "
                              f"got {split_above}, {merge_below}, {min_width}, {max_buckets}")
        self.bounds = list(bounds)  # lower edges; the last bucket is open above
        self.split_above = split_above
        self.merge_below = merge_below
        self.min_width = min_width
        self.max_buckets = max_buckets

    def __len__(self) -> int:
        return len(self.bounds)

    def bucket_of(self, length: int) -> int:
        return bisect.bisect_right(self.bounds, max(0, length)) - 1

    def group(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indexes into `lengths`, one list per bucket (in order)."""
        groups: list[list[int]] = [[] for _ in self.bounds]
        for i, n in enumerate(lengths):
            groups[self.bucket_of(n)].append(i)
        return groups

    def rebalance(self, lengths: Sequence[int]) -> bool:
        """Split crowded buckets and merge sparse neighbours for this queue; True if the bounds changed."""
        before = list(self.bounds)
        for k, members in enumerate(self.group(lengths)):
            if len(members) <= self.split_above or len(self.bounds) >= self.max_buckets:
                continue
            values = sorted(lengths[i] for i in members)
            cut = values[len(values) // 2]
            lo = self.bounds[k]
            hi = self.bounds[k + 1] if k + 1 < len(self.bounds) else values[-1] + 1
            if cut - lo >= self.min_width and hi - cut >= self.min_width and cut not in self.bounds:
                bisect.insort(self.bounds, cut)
        counts = [len(g) for g in self.group(lengths)]
        k = 1
        while k < len(self.bounds):
            if counts[k - 1] + counts[k] < self.merge_below:
                del self.bounds[k]
                counts[k - 1] += counts.pop(k)
            else:
                k += 1
        return self.bounds != before
